#pragma once
// Training losses on per-token log-probs, for both API surfaces:
//   Tinker (tinker-protocol.md §9): cross_entropy, importance_sampling, ppo, cispo, dro — plain
//     sums over every token of every datum, scale set by the caller's weights/advantages.
//   Twinkle (twinkle-api.md §6): twinkle:cross_entropy, twinkle:grpo, twinkle:gspo,
//     twinkle:cispo, twinkle:bnpo, twinkle:dr_grpo — masked means whose normalisers may span a
//     whole gradient-accumulation window (LossContext), so that the gradients of several
//     micro-batches add up to the gradient of one big batch — and twinkle:dpo, a mean over
//     (chosen, rejected) pairs of interleaved datums.
// The model side only supplies lp_t (log-prob of each target token); everything here is a few
// element-wise ops, so the losses are computed by LibTorch autograd, not by hand-written
// backward code.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace twinkle::engine {

// One datum (sequence) of one adapter's op.
struct LossDatum {
  // [T] current policy's log-prob of each target token (graph input); [T, K] for soft
  // targets (K target tokens per position, cross_entropy only: Σ −weights·logprobs).
  at::Tensor logprobs;
  // loss_fn_inputs except target_tokens, each [T]: "weights", "logprobs" (sampler / old
  // policy), "advantages", "ref_logprobs", "clip_low_threshold"/"clip_high_threshold"
  // (per-token overrides), "mask". Which names a loss accepts: see the registry in loss.cc.
  std::map<std::string, at::Tensor> inputs;
};

struct LossSpec {
  std::string name;
  std::map<std::string, double> config;
  // Non-numeric settings (Tinker's loss_fn_config_v2 may carry strings; Twinkle's
  // cross-entropy takes reduction = "mean" | "sum", its DPO loss_type). Booleans (DPO's
  // reference_free) are numbers 0 / 1 in `config`.
  std::map<std::string, std::string> string_config;
};

// Normalisers for Twinkle's mean losses; 0 = count within this call.
struct LossContext {
  int64_t window_tokens = 0;     // masked tokens of this adapter over its accumulation window
  int64_t window_sequences = 0;  // sequences of this adapter over its accumulation window
};

struct LossResult {
  at::Tensor total;  // scalar to call backward on
  // Per datum [T], detached: each token's contribution to `total` (normaliser included), so
  // the elements of all datums sum to `total` (DPO spreads each pair's loss over the pair's
  // tokens; see twinkle_preference_losses.cc). Same dtype as the computation (float32 or
  // float64); callers that reply to Tinker convert to float32.
  std::vector<at::Tensor> elementwise;
  std::map<std::string, double> metrics;  // "name:reduction" keys, e.g. "loss:sum", "loss:mean"
};

// Every loss name ComputeLoss accepts, Tinker names first.
std::vector<std::string> SupportedLossNames();

// Checks the name, the config keys and their ranges without touching any tensor.
absl::Status ValidateLossSpec(const LossSpec& spec);

// Validates spec and inputs, then builds the loss graph. The computation runs in the dtype of
// the datums' logprobs (float16/bfloat16 are promoted to float32); inputs are cast to it.
absl::StatusOr<LossResult> ComputeLoss(const LossSpec& spec, const std::vector<LossDatum>& datums,
                                       const LossContext& context = {});

}  // namespace twinkle::engine
