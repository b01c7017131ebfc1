"""The supported tokenizer families, made locally with HF `tokenizers` (no hub).

Each family is a small byte-level BPE vocabulary trained here, wrapped in that family's real
tokenizer.json configuration: normalizer, pre-tokenizer split regex, ByteLevel step,
ignore_merges, and its added/special tokens with their flags. Training is seeded by its
corpus only (the BPE trainer is deterministic), so the files are the same on every run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

import corpus

# Qwen2 / Qwen3 (tokenizer.json of Qwen/Qwen3-*): single digits.
QWEN2_SPLIT: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5: combining marks (\p{M}) join letters and leave punctuation runs.
QWEN35_SPLIT: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3 / 3.1: digit runs of up to three.
LLAMA3_SPLIT: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# (content, special) in the families' id order; all normalized=False as in their files.
QWEN_ADDED: Final = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]
LLAMA3_ADDED: Final = [
    ("<|begin_of_text|>", True), ("<|end_of_text|>", True), ("<|reserved_special_token_0|>", True),
    ("<|reserved_special_token_1|>", True), ("<|finetune_right_pad_id|>", True),
    ("<|reserved_special_token_2|>", True), ("<|start_header_id|>", True), ("<|end_header_id|>", True),
    ("<|eom_id|>", True), ("<|eot_id|>", True), ("<|python_tag|>", True),
] + [(f"<|reserved_special_token_{i}|>", True) for i in range(3, 40)]


@dataclass(frozen=True)
class Family:
    name: str
    split_regex: str | None  # None: plain ByteLevel(use_regex=True), GPT-2's regex
    nfc: bool
    ignore_merges: bool
    added: list[tuple[str, bool]]
    string_merges: bool = False  # write merges as "a b" strings (older files) instead of [a, b]
    extra_added: list[dict] = field(default_factory=list)  # added tokens with other flags


FAMILIES: Final = [
    Family("qwen3", QWEN2_SPLIT, nfc=True, ignore_merges=False, added=QWEN_ADDED, string_merges=True),
    Family("qwen3_5", QWEN35_SPLIT, nfc=True, ignore_merges=False, added=QWEN_ADDED),
    Family("llama3", LLAMA3_SPLIT, nfc=False, ignore_merges=True, added=LLAMA3_ADDED),
    # GPT-2-style ByteLevel(use_regex=True), plus added tokens with the flags the families above
    # leave at their defaults (normalized, lstrip/rstrip, single_word).
    Family(
        "bytelevel",
        None,
        nfc=True,
        ignore_merges=False,
        added=[("<|endoftext|>", True)],
        extra_added=[
            {"content": "<mask>", "special": True, "lstrip": True},
            {"content": "[R]", "special": False, "rstrip": True},
            {"content": "word", "special": False, "single_word": True},
            {"content": "café", "special": False, "normalized": True},
            {"content": "ﬁx", "special": False, "normalized": False},
        ],
    ),
]
VOCAB_SIZE: Final = 3000


def build(family: Family, out_dir: Path) -> Path:
    """Trains `family`'s tokenizer, writes out_dir/<name>/tokenizer.json and returns its path."""
    tok = Tokenizer(models.BPE(ignore_merges=family.ignore_merges))
    if family.nfc:
        tok.normalizer = normalizers.NFC()
    if family.split_regex is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(family.split_regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.training_corpus(), trainer)
    for content, special in family.added:
        token = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        if special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    for spec in family.extra_added:
        token = AddedToken(
            spec["content"], special=spec.get("special", False), normalized=spec.get("normalized", False),
            lstrip=spec.get("lstrip", False), rstrip=spec.get("rstrip", False),
            single_word=spec.get("single_word", False),
        )
        if spec.get("special", False):
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    data = json.loads(tok.to_str())
    data["model"]["ignore_merges"] = family.ignore_merges
    if family.string_merges:
        data["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]
    path = out_dir / family.name / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return path


def load(path: Path) -> Tokenizer:
    """The HF reference for a written tokenizer.json (read back from the file, as the C++ does)."""
    return Tokenizer.from_file(str(path))
