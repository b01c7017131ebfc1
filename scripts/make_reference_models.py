#!/usr/bin/env python3
"""Builds tiny random HF models, one per supported decoder variant, for numerical tests.

Every variant the engine implements is covered: Llama (untied, llama3 RoPE scaling; tied,
linear scaling), Qwen2 (q/k/v bias), Qwen3 (q/k norm; tied and untied, the transformers-5
`rope_parameters` layout that save_pretrained writes), Qwen3.5 (Gated DeltaNet layers
interleaved with gated full attention, partial rotary with mrope sections; a CausalLM
checkpoint, and a ConditionalGeneration one with a small vision tower and tied embeddings).
Weights are drawn with a fixed seed and every parameter (norms and biases included, which
transformers initialises to constants) is perturbed, so a weight the engine ignored would show
in the logits. Qwen3-MoE: experts in some layers, a dense MLP in others.

Usage: make_reference_models.py OUT_DIR  -> OUT_DIR/<variant>/ (HF directory each)
Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

# Qwen3.5 text model: DeltaNet and full-attention layers alternate; grouped value heads
# (4 value heads per 2 key heads) with key and value head sizes that differ; a quarter of each
# attention head rotated, with (text-irrelevant) mrope sections as published configs have.
QWEN3_5_TEXT: dict[str, Any] = dict(
    COMMON, head_dim=32, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_hidden_layers=4, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
    linear_num_key_heads=2, linear_num_value_heads=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True})
QWEN3_5_VISION: dict[str, Any] = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                      num_position_embeddings=16, patch_size=4)

VARIANTS: dict[str, tuple[type[PreTrainedModel], Any]] = {
    "llama-llama3-rope": (
        LlamaForCausalLM,
        lambda: LlamaConfig(**COMMON, rope_theta=500000.0, tie_word_embeddings=False,
                            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    ),
    "llama-tied-linear-rope": (
        LlamaForCausalLM,
        lambda: LlamaConfig(**COMMON, rope_theta=10000.0, tie_word_embeddings=True,
                            rope_scaling={"rope_type": "linear", "factor": 2.0}),
    ),
    "qwen2": (
        Qwen2ForCausalLM,
        lambda: Qwen2Config(**COMMON, rope_theta=1000000.0, tie_word_embeddings=True),
    ),
    "qwen3": (
        Qwen3ForCausalLM,
        lambda: Qwen3Config(**COMMON, head_dim=16, rope_theta=1000000.0, tie_word_embeddings=False),
    ),
    "qwen3-tied": (
        Qwen3ForCausalLM,
        lambda: Qwen3Config(**COMMON, head_dim=16, rope_theta=1000000.0, tie_word_embeddings=True),
    ),
    # Experts in layers 0 and 2, a dense MLP in layer 1; top-2 of 8 experts, not renormalised
    # (Qwen3MoeConfig's default).
    "qwen3_moe": (
        Qwen3MoeForCausalLM,
        lambda: Qwen3MoeConfig(**dict(COMMON, num_hidden_layers=3), head_dim=16, rope_theta=1000000.0,
                               tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                               moe_intermediate_size=32, norm_topk_prob=False, decoder_sparse_step=1,
                               mlp_only_layers=[1]),
    ),
    "qwen3_5": (
        Qwen3_5ForCausalLM,
        lambda: Qwen3_5TextConfig(**QWEN3_5_TEXT, tie_word_embeddings=False),
    ),
    "qwen3_5-vl": (
        Qwen3_5ForConditionalGeneration,
        lambda: Qwen3_5Config(text_config=dict(QWEN3_5_TEXT, tie_word_embeddings=True),
                              vision_config=QWEN3_5_VISION, tie_word_embeddings=True),
    ),
    # Qwen3.5 text model with experts in every layer: top-2 of 8 and a gated shared expert.
    "qwen3_5_moe": (
        Qwen3_5MoeForCausalLM,
        lambda: Qwen3_5MoeTextConfig(**{k: v for k, v in QWEN3_5_TEXT.items() if k != "intermediate_size"},
                                     tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                                     moe_intermediate_size=32, shared_expert_intermediate_size=48),
    ),
}

# Parameters transformers initialises to constants, perturbed around their own centre:
# Qwen3.5's RMSNorms scale by (1 + w) (w starts at 0), its gated DeltaNet norm by w (starts
# at 1), dt_bias starts at 1.
ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
                "k_norm.weight", "model.norm.weight", "language_model.norm.weight")


def make(variant: str, out: Path, seed: int = 0, text_overrides: dict[str, Any] | None = None) -> Path:
    """text_overrides: settings of the text model to change (e.g. vocab_size and the special
    token ids, to serve the model with a real tokenizer)."""
    model_cls, config_fn = VARIANTS[variant]
    torch.manual_seed(seed)
    config = config_fn()
    text_config = getattr(config, "text_config", config)
    for key, value in (text_overrides or {}).items():
        setattr(text_config, key, value)
    config.torch_dtype = torch.float32
    model = model_cls(config).eval()
    qwen3_5 = variant.startswith("qwen3_5")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if qwen3_5 and name.endswith(ZERO_CENTRED):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("norm.weight") or (qwen3_5 and name.endswith("dt_bias")):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.05 * torch.randn_like(p))
    target = out / variant
    model.save_pretrained(target, safe_serialization=True)
    return target


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--variant", choices=sorted(VARIANTS), action="append")
    args = parser.parse_args(argv)
    for variant in args.variant or sorted(VARIANTS):
        print(make(variant, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
