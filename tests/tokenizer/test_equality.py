"""Exact equality of the C++ tokenizer with HF tokenizers, encode and decode, per family.

For every family (families.py): ≥ 10,000 seeded strings encoded by both and compared id for
id; their ids decoded by both (with and without skip_special_tokens); random id sequences,
including ones that split UTF-8 characters, decoded by both and through the StreamDecoder.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import corpus
import families

STRINGS_PER_FAMILY = 10_000
RANDOM_ID_SEQUENCES = 2_000
FAMILY_NAMES = [f.name for f in families.FAMILIES]


def _specials(family: families.Family) -> list[str]:
    return [content for content, _ in family.added] + [spec["content"] for spec in family.extra_added]


def _family(name: str) -> families.Family:
    return next(f for f in families.FAMILIES if f.name == name)


def _first_mismatch(ours: list, theirs: list, inputs: list) -> str:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return f"#{i} input={inputs[i]!r}\n ours={a!r}\n   hf={b!r}"
    return ""


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_encode_decode_equal_hf(name: str, family_paths: dict[str, Path], tools) -> None:
    family = _family(name)
    hf = families.load(family_paths[name])
    texts = corpus.make_strings(seed=hash_seed(name), count=STRINGS_PER_FAMILY, specials=_specials(family))
    assert len(texts) >= STRINGS_PER_FAMILY
    theirs = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    ours = tools[name].encode(texts)
    mismatches = sum(a != b for a, b in zip(ours, theirs))
    assert mismatches == 0, f"{mismatches}/{len(texts)} encodings differ; first: {_first_mismatch(ours, theirs, texts)}"
    print(f"\n{name}: {len(texts)} strings encoded, equal to HF")
    for skip in (False, True):
        hf_text = hf.decode_batch(theirs, skip_special_tokens=skip)
        our_text = tools[name].decode(theirs, skip_special=skip)
        bad = sum(a != b for a, b in zip(our_text, hf_text))
        assert bad == 0, f"skip_special={skip}: {bad} decodes differ; first: {_first_mismatch(our_text, hf_text, theirs)}"


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_random_ids_decode_and_stream_equal_hf(name: str, family_paths: dict[str, Path], tools) -> None:
    hf = families.load(family_paths[name])
    vocab_size = hf.get_vocab_size(with_added_tokens=True)
    rng = random.Random(hash_seed(name) + 1)
    texts = corpus.make_strings(seed=hash_seed(name) + 2, count=RANDOM_ID_SEQUENCES, specials=_specials(_family(name)))
    seqs: list[list[int]] = []
    for text in texts:
        if rng.random() < 0.5:
            # Slices of real encodings: starts and ends inside multi-byte characters.
            ids = hf.encode(text, add_special_tokens=False).ids
            a = rng.randint(0, len(ids))
            seqs.append(ids[a : rng.randint(a, len(ids))])
        else:
            seqs.append([rng.randrange(vocab_size) for _ in range(rng.randint(0, 40))])
    for skip in (False, True):
        hf_text = hf.decode_batch(seqs, skip_special_tokens=skip)
        our_text = tools[name].decode(seqs, skip_special=skip)
        bad = sum(a != b for a, b in zip(our_text, hf_text))
        assert bad == 0, f"skip_special={skip}: {bad} decodes differ; first: {_first_mismatch(our_text, hf_text, seqs)}"
        chunks = tools[name].stream(seqs, skip_special=skip)
        joined = ["".join(c) for c in chunks]
        bad = sum(a != b for a, b in zip(joined, hf_text))
        assert bad == 0, f"stream skip_special={skip}: {bad} differ; first: {_first_mismatch(joined, hf_text, seqs)}"
        # Held back, never repaired early: no chunk ends in a replacement character that the
        # full decode does not have at that place.
        for seq, parts, full in zip(seqs, chunks, hf_text):
            assert len(parts) == len(seq) + 1
            assert all(full.startswith("".join(parts[: i + 1])) for i in range(len(parts)))


def hash_seed(name: str) -> int:
    """A stable per-family seed (Python's hash() is salted per process)."""
    return sum(ord(c) * 31**i for i, c in enumerate(name)) % 1_000_003
