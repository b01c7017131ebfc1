"""Seeded conversations for the chat-rendering equality tests: system prompts, multi-turn chats,
thinking (in reasoning_content or as <think> in the content), tools and tool calls, tool
results, assistant prefill (continue_final_message), with the Unicode of corpus.py in them."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import corpus

TOOL_NAMES = ["get_weather", "search", "calc", "lookup_user", "send_email", "翻訳", "run_sql"]


@dataclass
class Case:
    messages: list[dict[str, Any]]  # OpenAI-style; tool call arguments as dicts
    tools: list[dict[str, Any]] | None
    add_generation_prompt: bool
    continue_final_message: bool
    enable_thinking: bool


def _text(rng: random.Random, pieces: int = 8) -> str:
    text = corpus.random_string(rng, [], max_pieces=pieces)
    if rng.random() < 0.2:
        text = rng.choice([" ", "\n", "\n\n", "  \t"]) + text + rng.choice([" ", "\n", "\n\n", ""])
    return text or "hi"


def _value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if roll < 0.35:
        return _text(rng, 4)
    if roll < 0.5:
        return rng.randint(-1000, 10**6)
    if roll < 0.6:
        return rng.choice([0.5, 3.14159, -2.0, 1e-7, 1e16, 123456.789, 0.1 + 0.2])
    if roll < 0.7:
        return rng.choice([True, False, None])
    if depth < 2 and roll < 0.85:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if depth < 2:
        return {f"k{i}": _value(rng, depth + 1) for i in range(rng.randint(0, 3))}
    return "leaf"


def _tool(rng: random.Random, name: str) -> dict[str, Any]:
    props = {
        f"p{i}_{rng.choice(['city', 'query', 'n', 'flag', 'ünï'])}": {
            "type": rng.choice(["string", "integer", "number", "boolean", "array"]),
            "description": _text(rng, 3),
        }
        for i in range(rng.randint(0, 3))
    }
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": _text(rng, 5),
            "parameters": {"type": "object", "properties": props, "required": list(props)[:1]},
        },
    }


def _tool_call(rng: random.Random, names: list[str], index: int) -> dict[str, Any]:
    args = {f"a{i}": _value(rng) for i in range(rng.randint(0, 3))}
    return {"id": f"call_{index}", "type": "function", "function": {"name": rng.choice(names), "arguments": args}}


def _assistant(rng: random.Random, thinking: bool) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": _text(rng)}
    if thinking:
        roll = rng.random()
        if roll < 0.3:
            message["reasoning_content"] = _text(rng, 6)
        elif roll < 0.6:
            message["content"] = f"<think>\n{_text(rng, 6)}\n</think>\n\n{message['content']}"
    return message


def make_case(rng: random.Random, family: str) -> Case:
    tools_ok = family in ("qwen3", "qwen3_5", "llama3")
    thinking = family in ("qwen3", "qwen3_5")
    use_tools = tools_ok and rng.random() < 0.4
    tools = [_tool(rng, name) for name in rng.sample(TOOL_NAMES, rng.randint(1, 3))] if use_tools else None
    names = [t["function"]["name"] for t in tools] if tools else []
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": _text(rng)})
    calls = 0
    for turn in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": _text(rng)})
        if tools and rng.random() < 0.6:
            count = 1 if family == "llama3" else rng.randint(1, 3)
            content = "" if family == "llama3" or rng.random() < 0.5 else _text(rng, 4)
            call_message: dict[str, Any] = {
                "role": "assistant",
                "content": content,
                "tool_calls": [_tool_call(rng, names, calls + k) for k in range(count)],
            }
            if thinking and rng.random() < 0.3:
                call_message["reasoning_content"] = _text(rng, 4)
            messages.append(call_message)
            for k in range(count):
                result = json.dumps(_value(rng), ensure_ascii=False) if rng.random() < 0.5 else _text(rng, 4)
                messages.append({"role": "tool", "tool_call_id": f"call_{calls + k}", "content": result})
            calls += count
        messages.append(_assistant(rng, thinking))
    prefill = rng.random() < 0.25
    if not prefill:
        if rng.random() < 0.7:
            messages.append({"role": "user", "content": _text(rng)})
        else:
            messages.pop()  # end on the tool results or the user turn
            if messages[-1]["role"] == "assistant":
                messages.pop()
    else:
        last = messages[-1]
        last.pop("reasoning_content", None)
        last["content"] = _text(rng, 4).strip() or "Sure"
    return Case(
        messages=messages,
        tools=tools,
        add_generation_prompt=not prefill and rng.random() < 0.85,
        continue_final_message=prefill,
        enable_thinking=rng.random() < 0.5,
    )


def for_cpp(case: Case, family: str) -> list[dict[str, Any]]:
    """The messages as the C++ gets them: tool call arguments as JSON text (OpenAI's form)."""
    out = []
    for m in case.messages:
        m = dict(m)
        if "tool_calls" in m:
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False)}}
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def for_template(case: Case, family: str) -> list[dict[str, Any]]:
    """The messages as the Jinja template gets them: Qwen3's template writes string arguments
    verbatim (what OpenAI clients send), the others expand a dict."""
    return for_cpp(case, family) if family == "qwen3" else [dict(m) for m in case.messages]
