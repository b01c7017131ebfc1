"""Qwen3_5Template on a Qwen3.5 tokenizer: the qwen3_5 family's tokenizer.json (trained locally by
tests/tokenizer/families.py, the same file the C++ tokenizer is checked against) with Qwen3.5's
own chat template (core/tokenizer/templates/qwen3_5.jinja, from Qwen/Qwen3.5-35B-A3B). For 60
seeded conversations (system or not, 1-4 turns, thinking as reasoning_content or as <think> in
the content, enable_thinking on and off, with and without a generation prompt) the SDK's
input_ids equal transformers' apply_chat_template token for token, and each assistant turn
trains what the model writes of it (its rendered text through <|im_end|>, its reasoning too
where the template renders it; nothing else)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from twinkle.data_format import Message, Trajectory
from twinkle.template import Qwen3_5Template

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "tokenizer"))
import families  # noqa: E402  (the locally trained family tokenizers)

TEMPLATE = REPO / "core" / "tokenizer" / "templates" / "qwen3_5.jinja"
CONVERSATIONS = 60
WORDS = ["the", "moon", "is", "pale", "Paris", "数学", "emoji 🙂", "x = 42;", "  spaced", "naïve",
         "\ttab", "line\nbreak", "3.14159", "Grüße", "ok"]


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen3_5")
    family = next(f for f in families.FAMILIES if f.name == "qwen3_5")
    directory = families.build(family, out).parent
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer",
        "chat_template": TEMPLATE.read_text(encoding="utf-8"),
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "model_max_length": 262144,
    }), encoding="utf-8")
    return directory


def text(rng: random.Random, words: int = 6) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, words)))


def conversation(rng: random.Random) -> tuple[list[dict[str, Any]], bool, bool]:
    """Messages ending on an assistant turn (a training row), or on a user turn with a
    generation prompt; enable_thinking; add_generation_prompt."""
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": text(rng)})
    for _ in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": text(rng)})
        answer: dict[str, Any] = {"role": "assistant", "content": text(rng)}
        roll = rng.random()
        if roll < 0.3:
            answer["reasoning_content"] = text(rng, 8)
        elif roll < 0.5:
            answer["content"] = f"<think>\n{text(rng, 8)}\n</think>\n\n{answer['content']}"
        messages.append(answer)
    prompt = rng.random() < 0.25
    if prompt:
        messages.append({"role": "user", "content": text(rng)})
    return messages, rng.random() < 0.5, prompt


def reference_ids(tokenizer: Any, messages: list[dict[str, Any]], thinking: bool, prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt,
                                        enable_thinking=thinking)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def trained_runs(ids: list[int], shifted_labels: list[int]) -> list[list[int]]:
    """The runs of trained tokens (Twinkle's labels are shifted left by one)."""
    labels = [-100] + shifted_labels[:-1]
    runs: list[list[int]] = []
    current: list[int] = []
    for token, label in zip(ids, labels):
        if label == -100:
            if current:
                runs.append(current)
            current = []
        else:
            assert label == token
            current.append(token)
    if current:
        runs.append(current)
    return runs


def test_qwen3_5_template_equals_apply_chat_template(qwen3_5_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(str(qwen3_5_dir))
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    templates = {flag: Qwen3_5Template(str(qwen3_5_dir), max_length=None, enable_thinking=flag)
                 for flag in (False, True)}
    rng = random.Random(35)
    checked = trained = 0
    for _ in range(CONVERSATIONS):
        messages, thinking, prompt = conversation(rng)
        traj = Trajectory(messages=[Message(**m) for m in messages])  # type: ignore[typeddict-item]
        feature = templates[thinking].batch_encode([traj], add_generation_prompt=prompt)[0]
        ids = feature["input_ids"].tolist()
        assert ids == reference_ids(hf, messages, thinking, prompt), messages
        checked += 1
        runs = trained_runs(ids, feature["labels"].tolist())
        if prompt:
            assert runs == [], "a prompt row trains nothing"
            continue
        # Every assistant turn trains: what the model writes of it, through <|im_end|>. That is
        # the turn's body (between its "<|im_start|>assistant\n" header and <|im_end|>) less
        # what a generation prompt already holds: nothing for an old turn, "<think>\n" (or the
        # empty think block, thinking off) for a last turn, where Qwen3.5 renders reasoning.
        assistants = [m for m in messages if m["role"] == "assistant"]
        assert len(runs) == len(assistants), (len(runs), len(assistants))
        rendered = hf.decode(ids)
        bodies = [part.split("<|im_end|>")[0] + "<|im_end|>"
                  for part in rendered.split("<|im_start|>assistant\n")[1:]]
        for body, run, message in zip(bodies, runs, assistants):
            written = hf.decode(run)
            assert body.endswith(written) and run[-1] == im_end, (body, written)
            head = body[: len(body) - len(written)]
            # With thinking off the generation prompt holds an empty think block.
            prompts = ("", "<think>\n") if thinking else ("", "<think>\n", "<think>\n\n</think>\n\n")
            # Labels go by token: a token that starts before the turn (the "\n\n" token of an
            # empty "<think>\n\n</think>") stays untrained, so whitespace may join the head.
            assert any(head.startswith(p) and not head[len(p):].strip() for p in prompts), (head, body)
            answer = message["content"].split("</think>")[-1].strip()
            assert answer in written, (answer, written)
        if not bodies[-1].startswith("<think>\n\n</think>"):  # its reasoning is trained too
            assert bodies[-1].startswith("<think>\n") and hf.decode(runs[-1]) == bodies[-1][len("<think>\n"):], \
                (bodies[-1], hf.decode(runs[-1]))
        trained += 1
    print(f"{checked} conversations equal apply_chat_template; {trained} training rows masked as rendered")
    assert trained >= CONVERSATIONS // 2
