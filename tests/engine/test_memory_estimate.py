"""The engine's activation-memory estimate (issue 17 item 5) against the memory a step really
takes: the coefficients its load_model reply carries (activation_fixed_bytes,
activation_token_bytes, activation_seq_sq_bytes, activation_chunk_rows,
activation_chunk_row_bytes; the coordinator's admission evaluates them the same way,
core/common/activation_memory.h) give, for one sequence of L tokens,

    estimate = fixed + chunk_row · min(chunk_rows, L) + token · L + seq_sq · L²

and a fresh worker's peak RSS over its loaded RSS for one forward_backward of that sequence
(VmHWM - VmRSS, test_memory.step_peak_mib, as tests/bench/bench_memory.py) must stay at or
below it, and the estimate within 3x of it (an estimate far above reality would refuse work
that fits). A few lengths, with and without activation checkpointing, on a small random
Qwen3 whose vocabulary makes the logit chunks count. CPU only: RSS is host memory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import DEVICE
from test_memory import random_qwen3, step_peak_mib

MIB = 2**20


def estimate_bytes(info: dict[str, object], lengths: list[int]) -> int:
    chunk = min(int(info["activation_chunk_rows"]), sum(lengths))
    return (int(info["activation_fixed_bytes"]) + int(info["activation_chunk_row_bytes"]) * chunk
            + int(info["activation_token_bytes"]) * sum(lengths)
            + int(info["activation_seq_sq_bytes"]) * sum(n * n for n in lengths))


@pytest.mark.skipif(DEVICE != "cpu", reason="measures host RSS: CPU workers only")
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_estimate_bounds_the_measured_peak_within_3x(tmp_path: Path, checkpointing: bool) -> None:
    model_dir = random_qwen3(tmp_path / "model", 8000, hidden=128, layers=4)
    rows = []
    for length in (512, 2048, 4096):
        measured_mib, info = step_peak_mib(model_dir, length, ["all-linear", "lm_head"], max_lora_rank=8,
                                           activation_checkpointing=checkpointing)
        assert int(info["activation_token_bytes"]) > 0, info
        assert int(info["activation_seq_sq_bytes"]) == 0  # the CPU flash kernel keeps no scores
        estimate_mib = estimate_bytes(info, [length]) / MIB
        rows.append((length, measured_mib, estimate_mib))
        print(f"{'checkpointed' if checkpointing else 'plain'} {length} tokens: measured peak "
              f"{measured_mib:.1f} MiB, estimate {estimate_mib:.1f} MiB, ratio {estimate_mib / measured_mib:.2f} "
              f"(fixed {int(info['activation_fixed_bytes']) / MIB:.0f} MiB, chunk "
              f"{int(info['activation_chunk_rows'])} x {int(info['activation_chunk_row_bytes'])} B, "
              f"{int(info['activation_token_bytes'])} B/token)")
    for length, measured_mib, estimate_mib in rows:
        assert measured_mib <= estimate_mib, f"{length} tokens: measured {measured_mib:.1f} > estimate {estimate_mib:.1f} MiB"
        assert estimate_mib <= 3 * measured_mib, f"{length} tokens: estimate {estimate_mib:.1f} > 3x measured {measured_mib:.1f} MiB"


@pytest.mark.skipif(DEVICE != "cpu", reason="measures host RSS: CPU workers only")
@pytest.mark.parametrize("variant", ["qwen2", "qwen3_moe", "qwen3_5", "qwen3_5_moe"])
def test_estimate_bounds_moe_and_hybrid_models(reference_models: Path, variant: str) -> None:
    """The MoE and Gated DeltaNet terms (not calibrated separately): the same bounds on the
    tiny reference models (hidden 64, vocabulary 256, so the 64 MiB fixed term weighs most),
    one 4096-token sequence, plain and checkpointed."""
    for checkpointing in (False, True):
        measured_mib, info = step_peak_mib(reference_models / variant, 4096, ["all-linear"], max_lora_rank=8,
                                           activation_checkpointing=checkpointing)
        estimate_mib = estimate_bytes(info, [4096]) / MIB
        print(f"{variant} {'checkpointed' if checkpointing else 'plain'} 4096 tokens: measured peak "
              f"{measured_mib:.1f} MiB, estimate {estimate_mib:.1f} MiB, ratio {estimate_mib / measured_mib:.2f}")
        assert measured_mib <= estimate_mib
        assert estimate_mib <= 3 * measured_mib
