"""Token equality of the C++ chat renderers with transformers' apply_chat_template rendering
each family's own template (templates/, see its README), on ≥ 50 seeded conversations per family:
system prompts, multi-turn, thinking on/off, assistant prefill, tools and tool calls where the
family has them. Both the text and the token ids (HF's tokenizer on the reference text, ours on
ours) must be equal."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

import conversations

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "scripts"))
from make_tiny_model import CHAT_TEMPLATE as TINY_CHATML  # noqa: E402

CONVERSATIONS_PER_FAMILY = 120
# renderer → (its reference template, the family tokenizer it is tokenized with, BOS token)
RENDERERS = {
    "qwen3": ((HERE / "templates" / "qwen3.jinja").read_text(), "qwen3", None),
    "qwen3_5": ((HERE / "templates" / "qwen3_5.jinja").read_text(), "qwen3_5", None),
    "llama3": ((HERE / "templates" / "llama3.jinja").read_text(), "llama3", "<|begin_of_text|>"),
    "chatml": (TINY_CHATML, "qwen3", None),
}


def _hf(renderer: str, family_paths: dict[str, Path]) -> PreTrainedTokenizerFast:
    template, family, bos = RENDERERS[renderer]
    tok = PreTrainedTokenizerFast(tokenizer_file=str(family_paths[family]), bos_token=bos)
    tok.chat_template = template
    return tok


def _reference(tok: PreTrainedTokenizerFast, case: conversations.Case, renderer: str) -> str:
    kwargs = {"enable_thinking": case.enable_thinking} if renderer in ("qwen3", "qwen3_5") else {}
    return tok.apply_chat_template(
        conversations.for_template(case, renderer), tools=case.tools, tokenize=False,
        add_generation_prompt=case.add_generation_prompt, continue_final_message=case.continue_final_message,
        **kwargs,
    )


def _request(case: conversations.Case, renderer: str) -> dict:
    return {"render": {
        "renderer": renderer, "messages": conversations.for_cpp(case, renderer), "tools": case.tools,
        "add_generation_prompt": case.add_generation_prompt, "enable_thinking": case.enable_thinking,
        "continue_final_message": case.continue_final_message,
    }}


@pytest.mark.parametrize("renderer", list(RENDERERS))
def test_render_equals_apply_chat_template(renderer: str, family_paths: dict[str, Path], tools) -> None:
    tok = _hf(renderer, family_paths)
    rng = random.Random(sum(map(ord, renderer)))
    cases = [conversations.make_case(rng, renderer) for _ in range(CONVERSATIONS_PER_FAMILY)]
    references = [_reference(tok, c, renderer) for c in cases]
    answers = tools[RENDERERS[renderer][1]].run([_request(c, renderer) for c in cases])
    kinds = {"tools": 0, "prefill": 0, "system": 0, "multi_turn": 0, "no_thinking": 0}
    for i, (case, ref, ans) in enumerate(zip(cases, references, answers)):
        assert "text" in ans, f"case {i}: {ans} for {case}"
        assert ans["text"] == ref, f"case {i}: text differs\n ours={ans['text']!r}\n   hf={ref!r}\n case={case}"
        assert ans["ids"] == tok(ref, add_special_tokens=False)["input_ids"], f"case {i}: ids differ"
        kinds["tools"] += case.tools is not None
        kinds["prefill"] += case.continue_final_message
        kinds["system"] += case.messages[0]["role"] == "system"
        kinds["multi_turn"] += sum(m["role"] == "user" for m in case.messages) > 1
        kinds["no_thinking"] += not case.enable_thinking
    print(f"\n{renderer}: {len(cases)} conversations equal to apply_chat_template ({kinds})")
    assert len(cases) >= 50
    if renderer != "chatml":
        assert kinds["tools"] > 0 and kinds["prefill"] > 0 and kinds["system"] > 0 and kinds["multi_turn"] > 0


def test_template_refusals_are_refused(family_paths: dict[str, Path], tools) -> None:
    """What the templates raise on, the renderers refuse (with a message, not a wrong prompt)."""
    bad = [
        ("qwen3_5", [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]),
        ("qwen3_5", [{"role": "assistant", "content": "no user"}]),
        ("llama3", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}]),
        ("chatml", [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]),
        ("qwen3", [{"role": "narrator", "content": "x"}]),
        ("qwen3", []),
    ]
    for renderer, messages in bad:
        answer = tools["qwen3"].run([{"render": {"renderer": renderer, "messages": messages}}])[0]
        assert "error" in answer, f"{renderer} rendered {messages}: {answer}"
