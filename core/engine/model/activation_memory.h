#pragma once
// The engine's estimate of a forward_backward's peak activation memory (issue 17 item 5):
// the one place that knows what DecoderModel keeps per token, per layer and per chunk of
// logits, as the coefficients core/common/activation_memory.h evaluates per request. Torch
// free (it reads ModelConfig only), so unit tests and the load reply share it.

#include <cstdint>

#include "core/common/activation_memory.h"
#include "core/engine/model/hf_config.h"

namespace twinkle::engine {

struct ActivationSetup {
  int64_t itemsize = 4;           // bytes per element of the model's dtype
  bool checkpointing = false;     // engine.activation_checkpointing
  int64_t logit_chunk_rows = 0;   // resolved (LogitChunkRows), > 0
  bool flash_attention = true;    // false: attention materialises [heads, L, L] scores
  int64_t max_lora_rank = 0;      // 0 = no limit (the estimate assumes rank 64)
};

// Coefficients of bytes(request) = fixed + token · Σ L + seq_sq · Σ L² for `config`.
ActivationCost ActivationCostOf(const ModelConfig& config, const ActivationSetup& setup);

}  // namespace twinkle::engine
