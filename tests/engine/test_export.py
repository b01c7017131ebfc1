"""Merged export (`twinkle-engine export`), held against PEFT's merge_and_unload: the same
weights, and memory that stays near one tensor instead of the whole model (it streams)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from engine_harness import repo_root

ENGINE = Path(os.environ.get("TWINKLE_ENGINE_BIN", repo_root() / "build/bin/twinkle-engine"))


def make_base(out: Path, layers: int, hidden: int, vocab: int, dtype: torch.dtype, tied: bool) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                         tie_word_embeddings=tied, max_position_embeddings=256)
    model = Qwen3ForCausalLM(config).to(dtype)
    model.save_pretrained(out, safe_serialization=True)
    return model


def make_adapter(base: Qwen3ForCausalLM, out: Path, targets: list[str], rank: int = 8) -> Any:
    torch.manual_seed(1)
    peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=16, target_modules=targets, init_lora_weights=False))
    peft_model.save_pretrained(out, save_embedding_layers=False)  # LoRA weights only, as the server saves
    return peft_model


def run_export(model_dir: Path, adapter_dir: Path, parent: Path, name: str) -> tuple[int, dict[str, Any], int]:
    """Runs the export; returns (exit status, its JSON line, its peak RSS in bytes as it
    reports it: VmHWM, which starts afresh at exec, unlike getrusage's ru_maxrss)."""
    proc = subprocess.run([str(ENGINE), "export", "--model-dir", str(model_dir), "--adapter-dir", str(adapter_dir),
                           "--parent", str(parent), "--name", name], stdout=subprocess.PIPE, check=False)
    reply = json.loads(proc.stdout)
    return proc.returncode, reply, int(reply["peak_rss_bytes"])


@pytest.mark.parametrize("tied", [False, True])
def test_export_equals_peft_merge_and_unload(tmp_path: Path, tied: bool) -> None:
    base = make_base(tmp_path / "base", layers=2, hidden=64, vocab=512, dtype=torch.float32, tied=tied)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    embed = base.model.embed_tokens.weight.detach().clone()
    peft_model = make_adapter(base, tmp_path / "adapter", targets)
    code, reply, _ = run_export(tmp_path / "base", tmp_path / "adapter", tmp_path / "exports", "merged")
    assert code == 0, reply
    merged = dict(peft_model.merge_and_unload().state_dict())
    # Merging a tied lm_head in place changes the embedding through the tie as well; the
    # export unties instead, so the input embedding stays the base model's.
    merged["model.embed_tokens.weight"] = embed
    got = load_file(Path(reply["path"]) / "model.safetensors")
    config = json.loads((Path(reply["path"]) / "config.json").read_text())
    assert config["tie_word_embeddings"] is False  # the adapter changed lm_head: untied
    assert set(got) == set(merged), set(got) ^ set(merged)
    worst = max(float((got[k] - merged[k].float()).abs().max()) for k in merged)
    print(f"export vs PEFT merge_and_unload (tied={tied}): max |dW| = {worst:.3e} over {len(merged)} tensors")
    assert worst <= 1e-6
    assert (Path(reply["path"]) / "checkpoint_metadata.json").exists()


def test_export_streams_in_about_one_tensor_of_memory(tmp_path: Path) -> None:
    """A bf16 base of ~90 MB (~180 MB as fp32): loading it whole in fp32 and serialising it,
    as the export used to, needs ~360 MB above the process's baseline; streaming needs
    about the largest tensor."""
    layers, hidden, vocab = 12, 512, 8192
    base = make_base(tmp_path / "base", layers=layers, hidden=hidden, vocab=vocab, dtype=torch.bfloat16, tied=False)
    fp32_bytes = sum(p.numel() for p in base.parameters()) * 4
    largest = max(p.numel() for p in base.parameters()) * 4
    make_adapter(base.float(), tmp_path / "adapter", ["q_proj", "v_proj", "down_proj"])
    # Baseline: the same process that fails once the base is opened (the adapter is missing).
    code, reply, baseline = run_export(tmp_path / "base", tmp_path / "missing", tmp_path / "exports", "none")
    assert code == 1 and "adapter_config.json" in reply["message"], reply
    code, reply, peak = run_export(tmp_path / "base", tmp_path / "adapter", tmp_path / "exports", "merged")
    assert code == 0, reply
    mib = 1 << 20
    print(f"export of a {fp32_bytes / mib:.0f} MiB (fp32) model: peak RSS {peak / mib:.0f} MiB, "
          f"baseline {baseline / mib:.0f} MiB, growth {(peak - baseline) / mib:.0f} MiB, "
          f"largest tensor {largest / mib:.0f} MiB, written {reply['bytes'] / mib:.0f} MiB")
    assert reply["bytes"] >= fp32_bytes
    assert peak - baseline < fp32_bytes / 4


def test_export_refuses_an_adapter_that_does_not_fit(tmp_path: Path) -> None:
    make_base(tmp_path / "small", layers=2, hidden=64, vocab=512, dtype=torch.float32, tied=False)
    other = make_base(tmp_path / "wide", layers=2, hidden=128, vocab=512, dtype=torch.float32, tied=False)
    make_adapter(other, tmp_path / "adapter", ["q_proj"])
    code, reply, _ = run_export(tmp_path / "small", tmp_path / "adapter", tmp_path / "exports", "merged")
    assert code == 1
    assert reply["code"] == 9 and "does not fit the base weight" in reply["message"], reply  # FAILED_PRECONDITION
    assert not (tmp_path / "exports" / "merged").exists()
