"""Templates on a real tokenizer (the tiny model's: Qwen chat tokens and a ChatML template),
checked against transformers' own apply_chat_template and against tokenizing each assistant
turn on its own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from twinkle.data_format import Message, Trajectory
from twinkle.template import Qwen3_5Template, Template
from twinkle.template._masking import MaskingError

SYSTEM = "You are a helpful assistant."


def conversation() -> Trajectory:
    return Trajectory(messages=[
        Message(role="system", content=SYSTEM),
        Message(role="user", content="What is the capital of France?"),
        Message(role="assistant", content="The capital of France is Paris."),
        Message(role="user", content="Write a short poem about the moon."),
        Message(role="assistant", content="The moon is pale, the night is deep."),
    ])


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir: Path):
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="module")
def template(tokenizer_dir: Path) -> Qwen3_5Template:
    return Qwen3_5Template(str(tokenizer_dir), max_length=512)


def unshift(labels: np.ndarray) -> list[int]:
    """HF-style labels (labels[i] is token i) from Twinkle's shifted ones."""
    values = labels.tolist()
    return [-100] + values[:-1]


def test_input_ids_are_the_chat_template_tokens(template, hf_tokenizer):
    traj = conversation()
    feature = template.batch_encode([traj])[0]
    reference = hf_tokenizer.apply_chat_template([dict(m) for m in traj["messages"]], tokenize=True)
    reference_ids = reference["input_ids"] if isinstance(reference, dict) or hasattr(reference, "keys") else reference
    assert feature["input_ids"].tolist() == list(reference_ids)
    assert feature["input_ids"].dtype == np.int64
    n = len(reference_ids)
    assert feature["length"] == n
    assert feature["attention_mask"].tolist() == [1] * n
    assert feature["position_ids"].tolist() == list(range(n))


def test_only_assistant_turns_and_their_end_token_train(template, hf_tokenizer):
    feature = template.batch_encode([conversation()])[0]
    ids = feature["input_ids"].tolist()
    labels = unshift(feature["labels"])
    im_end = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    expected_runs = [
        hf_tokenizer.encode(text, add_special_tokens=False) + [im_end]
        for text in ("The capital of France is Paris.", "The moon is pale, the night is deep.")
    ]
    runs, current = [], []
    for token, label in zip(ids, labels):
        if label == -100:
            if current:
                runs.append(current)
                current = []
        else:
            assert label == token
            current.append(label)
    if current:
        runs.append(current)
    assert runs == expected_runs
    # Shifted: position i predicts token i + 1; the last position predicts nothing.
    shifted = feature["labels"].tolist()
    for i, label in enumerate(shifted[:-1]):
        assert label == -100 or label == ids[i + 1]
    assert shifted[-1] == -100


def test_generation_prompt_matches_transformers_and_trains_nothing(template, hf_tokenizer):
    traj = Trajectory(messages=[Message(role="system", content=SYSTEM), Message(role="user", content="Hello!")])
    feature = template.batch_encode([traj], add_generation_prompt=True)[0]
    reference = hf_tokenizer.apply_chat_template([dict(m) for m in traj["messages"]], tokenize=True,
                                                 add_generation_prompt=True)
    assert feature["input_ids"].tolist() == list(reference["input_ids"])
    assert template.decode(feature["input_ids"]).endswith("<|im_start|>assistant\n")
    assert set(feature["labels"].tolist()) == {-100}


def test_default_system_is_added_before_a_leading_user_turn(tokenizer_dir):
    template = Qwen3_5Template(str(tokenizer_dir), default_system="Be brief.")
    traj = Trajectory(messages=[Message(role="user", content="Hi"), Message(role="assistant", content="Hello")])
    text = template.decode(template.batch_encode([traj])[0]["input_ids"])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_columns_in_columns_out(template):
    traj = conversation()
    columns = {"messages": [traj["messages"], traj["messages"][:3]]}
    out = template.batch_encode(columns)
    assert set(out) >= {"input_ids", "labels", "attention_mask", "position_ids", "length"}
    assert len(out["input_ids"]) == 2


@pytest.mark.parametrize("strategy", ["raise", "left", "right", "split", "delete"])
def test_truncation_strategies(tokenizer_dir, strategy):
    full = Qwen3_5Template(str(tokenizer_dir), max_length=None).batch_encode([conversation()])[0]
    n = len(full["input_ids"])
    limit = 20
    template = Qwen3_5Template(str(tokenizer_dir), max_length=limit, truncation_strategy=strategy)
    if strategy == "raise":
        with pytest.raises(ValueError, match="exceeds max_length"):
            template.batch_encode([conversation()])
        assert template.check(conversation()) is None
        return
    out = template.batch_encode([conversation()])
    if strategy == "delete":
        assert out == []
        return
    ids = full["input_ids"].tolist()
    if strategy == "left":
        assert [f["input_ids"].tolist() for f in out] == [ids[-limit:]]
    elif strategy == "right":
        assert [f["input_ids"].tolist() for f in out] == [ids[:limit]]
    else:
        assert [f["input_ids"].tolist() for f in out] == [ids[s:s + limit] for s in range(0, n, limit)]
    for f in out:
        assert f["length"] == len(f["input_ids"]) <= limit
        assert f["position_ids"].tolist() == list(range(f["length"]))


def test_concat_input_feature_trains_the_completion_only(template):
    prompt = Trajectory(messages=[Message(role="user", content="Hello!")], user_data=[("ground_truth", "4")])
    feature = template.batch_encode([prompt], add_generation_prompt=True)[0]
    row = {**prompt, **feature}
    completion = template.tokenizer.encode("I am fine, thank you.", add_special_tokens=False)
    completion.append(template.tokenizer.convert_tokens_to_ids("<|im_end|>"))
    joined = template.concat_input_feature(row, completion)
    n_prompt = len(feature["input_ids"])
    assert joined["input_ids"].tolist() == feature["input_ids"].tolist() + completion
    assert unshift(joined["labels"]) == [-100] * n_prompt + completion
    assert joined["messages"][-1] == {"role": "assistant", "content": "I am fine, thank you."}
    assert joined["user_data"] == [("ground_truth", "4")]
    assert len(row["messages"]) == 1  # the prompt row is not modified


def test_without_chat_template_qwen_falls_back_to_chatml_and_plain_template_refuses(tokenizer_dir, tmp_path):
    copy = tmp_path / "no-chat-template"
    shutil.copytree(tokenizer_dir, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    (copy / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat template"):
        Template(str(copy))
    with_fallback = Qwen3_5Template(str(copy))
    reference = Qwen3_5Template(str(tokenizer_dir))
    a = with_fallback.batch_encode([conversation()])[0]
    b = reference.batch_encode([conversation()])[0]
    assert a["input_ids"].tolist() == b["input_ids"].tolist()
    assert a["labels"].tolist() == b["labels"].tolist()


# A template that shows only the answer part of earlier assistant turns (as Qwen3's drops old
# reasoning), so rendering a prefix of the conversation is not a prefix of the whole.
DROPPING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and not loop.last %}{%- set content = content.split('</think>')[-1] %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_turns_rendered_differently_later_are_still_masked_right(tokenizer_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.chat_template = DROPPING_TEMPLATE
    tokenizer.save_pretrained(str(tmp_path / "dropping"))
    template = Qwen3_5Template(str(tmp_path / "dropping"))
    traj = Trajectory(messages=[
        Message(role="user", content="one"),
        Message(role="assistant", content="<think>hidden</think>first answer"),
        Message(role="user", content="two"),
        Message(role="assistant", content="<think>shown</think>second answer"),
    ])
    feature = template.batch_encode([traj])[0]
    trained = [t for t in unshift(feature["labels"]) if t != -100]
    assert template.decode(trained) == "first answer<|im_end|><think>shown</think>second answer<|im_end|>"


def test_a_template_that_hides_assistant_content_is_refused(tokenizer_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.chat_template = (
        "{%- for message in messages %}{%- if message['role'] != 'assistant' %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{%- endif %}{%- endfor %}"
    )
    tokenizer.save_pretrained(str(tmp_path / "hiding"))
    template = Qwen3_5Template(str(tmp_path / "hiding"))
    traj = Trajectory(messages=[Message(role="assistant", content="x"), Message(role="user", content="y")])
    with pytest.raises(MaskingError):
        template.batch_encode([traj])


def test_plain_text_mode_trains_everything(tokenizer_dir):
    template = Template(str(tokenizer_dir), use_chat_template=False)
    feature = template.batch_encode([Trajectory(messages=[Message(role="user", content="The quick brown fox")])])[0]
    ids = feature["input_ids"].tolist()
    assert ids == template.tokenizer.encode("The quick brown fox", add_special_tokens=False)
    assert feature["labels"].tolist() == ids[1:] + [-100]
