#!/usr/bin/env python3
"""Create a tiny random Qwen3ForCausalLM in Hugging Face format, fully offline.

The model is for tests and local runs: a byte-level BPE tokenizer trained on a small
built-in English corpus, a 2-layer Qwen3 decoder (hidden 64, GQA 4/2 heads, tied
embeddings) with weights drawn from torch.manual_seed(0), saved as float32
model.safetensors next to config.json and the tokenizer files.

The output is deterministic and the script is idempotent: when OUTPUT_DIR already holds
the marker file `.twinkle-tiny-model-v1` with the current version, it does nothing. The
model is written into a temporary sibling directory and renamed into place, so a reader
never sees a half-written model.

Usage: python scripts/make_tiny_model.py OUTPUT_DIR [--force]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Final

MARKER_NAME: Final = ".twinkle-tiny-model-v1"
MARKER_VERSION: Final = 1
TARGET_VOCAB_SIZE: Final = 1024
SEED: Final = 0

ENDOFTEXT: Final = "<|endoftext|>"
IM_START: Final = "<|im_start|>"
IM_END: Final = "<|im_end|>"
SPECIAL_TOKENS: Final = [ENDOFTEXT, IM_START, IM_END]

CHAT_TEMPLATE: Final = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CORPUS: Final = """\
The quick brown fox jumps over the lazy dog. A small model can still learn the shape of a
sentence: subjects come first, verbs follow, and objects close the thought. When the morning
light falls across the kitchen table, the bread is warm and the coffee is strong.

Training a language model means showing it many examples and asking it to predict the next
token. Each step computes a loss, the gradient of that loss with respect to every weight, and
an update that moves the weights a little in the direction that lowers the loss. Low rank
adapters add two thin matrices beside a frozen weight, so each tenant trains only a few
parameters while the base model stays shared.

The server holds one base model in memory and lets many users train their own adapters at the
same time. Requests arrive over the network, wait in a queue, and are fused into one forward
and backward pass. Every result goes back to the user who asked for it, and no user can see
another user's weights, data, or checkpoints.

Rivers run to the sea, and the sea returns as rain over the hills. Farmers watch the sky in
spring, plant their seeds in rows, and wait for the first green leaves. In autumn they gather
apples, wheat, and pumpkins, and the village holds a market in the square.

Numbers also matter: one, two, three, four, five, six, seven, eight, nine, ten. Dates such as
2024-05-17 and times such as 09:30 appear in logs. Questions end with a question mark? Lists
use commas; sentences end with periods. Quotes look like "this", and code looks like
def add(a, b): return a + b.

A user asks the assistant a question, and the assistant answers politely and briefly. Hello!
How are you today? I am fine, thank you. What is the capital of France? The capital of France
is Paris. Please write a short poem about the moon. The moon is pale, the night is deep, the
stars keep watch while children sleep.
"""


def train_tokenizer() -> Any:
    """Train a byte-level BPE tokenizer on CORPUS and return it (a tokenizers.Tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The corpus is small, so training stops once no pair is left to merge: the vocabulary
    # ends up a little under TARGET_VOCAB_SIZE (839 tokens with this corpus).
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def wrap_tokenizer(raw: Any) -> Any:
    """Wrap a tokenizers.Tokenizer as a PreTrainedTokenizerFast with a ChatML chat template."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_config(tokenizer: Any) -> Any:
    """The tiny Qwen3 configuration, sized to the tokenizer's vocabulary."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        architectures=["Qwen3ForCausalLM"],
        dtype="float32",
    )


def build_model(config: Any) -> Any:
    """Random float32 Qwen3ForCausalLM, deterministic for a given config."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(SEED)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    model.eval()
    return model


def read_marker_version(directory: Path) -> int | None:
    """The version in directory's marker file, or None when absent or unreadable."""
    try:
        data = json.loads((directory / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    version = data.get("version") if isinstance(data, dict) else None
    return version if isinstance(version, int) else None


def is_current(directory: Path) -> bool:
    return read_marker_version(directory) == MARKER_VERSION


def make_readable(root: Path) -> None:
    """mkdtemp and safetensors create owner-only modes; a model dir is shared read-only data."""
    root.chmod(0o755)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def fsync_tree(root: Path) -> None:
    """fsync every file under root, then every directory (children before parents)."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as handle:
                os.fsync(handle.fileno())
        fsync_dir(Path(dirpath))


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_model(staging: Path) -> None:
    """Write tokenizer, config, weights and (last) the marker into staging."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = wrap_tokenizer(train_tokenizer())
    tokenizer.save_pretrained(staging)
    model = build_model(build_config(tokenizer))
    model.save_pretrained(staging)
    make_readable(staging)
    marker = {"version": MARKER_VERSION, "generator": "scripts/make_tiny_model.py", "seed": SEED}
    (staging / MARKER_NAME).write_text(json.dumps(marker, sort_keys=True) + "\n", encoding="utf-8")
    fsync_tree(staging)


def check_replaceable(output: Path, force: bool) -> None:
    """Refuse to replace a non-empty directory that this script did not create."""
    if not output.exists() or force:
        return
    if not output.is_dir():
        raise SystemExit(f"make_tiny_model: {output} exists and is not a directory")
    if read_marker_version(output) is None and any(output.iterdir()):
        raise SystemExit(
            f"make_tiny_model: {output} is not empty and has no {MARKER_NAME} marker; "
            "refusing to overwrite it (use --force)"
        )


def install(staging: Path, output: Path) -> None:
    """Move staging into place as output; an existing output (stale or empty) is replaced."""
    if output.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
        os.rename(output, trash / output.name)
        os.rename(staging, output)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(staging, output)
    fsync_dir(output.parent)


def make_tiny_model(output: Path, force: bool = False) -> bool:
    """Create the model at output. Returns False when an up-to-date model was already there."""
    output = output.absolute()
    if is_current(output) and not force:
        return False
    check_replaceable(output, force)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    try:
        write_model(staging)
        if is_current(output) and not force:
            return False  # a concurrent run installed the same model meanwhile
        try:
            install(staging, output)
        except OSError:
            # A concurrent run may have installed the same model first.
            if is_current(output):
                return False
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return True


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "output_dir", type=Path, help="directory to create (e.g. models/tiny-qwen3)"
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    created = make_tiny_model(args.output_dir, force=args.force)
    state = "created" if created else "up to date"
    print(f"make_tiny_model: {args.output_dir} {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
