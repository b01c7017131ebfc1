#pragma once
// One tenant's LoRA adapter: fp32 master weights A [r, in] and B [out, r] for every targeted
// linear of every layer, initialised as PEFT does (A kaiming-uniform, B zero) from the
// adapter's own seeded generator, plus its optimizer and step counter; lm_head (the logits
// projection, tied or not) can be a target too. Parameters are leaf tensors; autograd
// accumulates their gradients across forward_backward calls.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "core/engine/model/decoder.h"
#include "core/engine/optim/optimizer.h"

namespace twinkle::engine {

struct AdapterConfig {
  std::string id;
  int64_t rank = 8;
  double alpha = 16;
  double dropout = 0.0;
  bool use_rslora = false;          // scale alpha / sqrt(r) instead of alpha / r
  std::vector<LinearKind> targets;  // empty = all linear layers (PEFT's all-linear)
  uint64_t seed = 0;
  std::string optimizer = "adamw";
};

// Parses PEFT-style target names: "all-linear", q_proj, k_proj, ..., down_proj, lm_head,
// gate (an MoE router), shared_expert_gate (InvalidArgument on an unknown name, listing the
// accepted ones). "all-linear" does not include lm_head, as in PEFT; ["all-linear",
// "lm_head"] is the union. It does include the router and shared_expert_gate: what they
// mean on a given model, as on the MLP names, is Adapter::Create's business.
absl::StatusOr<std::vector<LinearKind>> ParseTargets(const std::vector<std::string>& names);

// What set_adapter_state restores; a part left absent keeps the adapter's current value.
struct AdapterStateUpdate {
  std::map<std::string, at::Tensor> weights;  // by PEFT key, any subset; any float dtype/device
  // Set: the accumulated gradients become exactly these (by PEFT key; a parameter not named
  // has none afterwards, as after zero_grad).
  std::optional<std::map<std::string, at::Tensor>> grads;
  // "" = keep. Another kind than the current one replaces the optimizer (fresh, step 0,
  // unless optimizer_state is given too).
  std::string optimizer_kind;
  // Non-empty: the optimizer's whole state, named as Optimizer::StateTensors names it.
  std::vector<std::pair<std::string, at::Tensor>> optimizer_state;
  // true: a fresh optimizer (step 0, no moments) of optimizer_kind or the current kind;
  // optimizer_state must then be empty.
  bool reset_optimizer = false;
  std::optional<int64_t> micro_batches_since_step;
};

class Adapter {
 public:
  static absl::StatusOr<std::unique_ptr<Adapter>> Create(const AdapterConfig& config,
                                                         const DecoderModel& model,
                                                         c10::Device device);

  // The config it was created with; targets resolved (never empty) and optimizer the
  // current optimizer's kind, so create_adapter with it rebuilds an equal adapter.
  //
  // MoE models, as PEFT 0.21 with transformers 5 resolves the targets:
  // - Qwen3-MoE (model_type qwen3_moe): PEFT maps gate_proj and up_proj (both or neither)
  //   onto the experts' fused gate_up_proj and down_proj onto down_proj (target_parameters,
  //   3-D LoRA, kExpertsGateUp/kExpertsDown; gate_up gets rank 2r and alpha 2α), and
  //   all-linear also wraps the router (gate). Dense-MLP layers (mlp_only_layers) then get
  //   no MLP LoRA, as in PEFT. LoRA dropout is refused there (PEFT's ParamWrapper refuses it).
  // - Qwen3.5-MoE: PEFT maps nothing; gate_proj/up_proj/down_proj are the shared expert's
  //   Linears, all-linear adds shared_expert_gate, and the router (not a Linear) is refused.
  const AdapterConfig& config() const { return config_; }
  double scale() const { return scale_; }
  // The scale of one target kind: scale() except for the experts' gate_up_proj, whose rank
  // and alpha PEFT doubles (alpha / r alike; with rsLoRA 2·alpha / sqrt(2r)).
  double scale(LinearKind kind) const {
    return kind == LinearKind::kExpertsGateUp ? gate_up_scale_ : scale_;
  }
  bool targets(LinearKind kind) const { return weights_.count(kind) > 0; }
  // lm_head has one (A, B) pair for the whole model: layer 0. Undefined tensors for a layer
  // without that linear (Qwen3.5: q_proj in a DeltaNet layer, in_proj_qkv in an attention one).
  const at::Tensor& a(int64_t layer, LinearKind kind) const { return weights_.at(kind)[layer].first; }
  const at::Tensor& b(int64_t layer, LinearKind kind) const { return weights_.at(kind)[layer].second; }
  // A and B for inference (generation): the same values and shapes, but laid out transposed
  // (Aᵀ [in, r] and Bᵀ [r, out] dense, seen as [r, in] and [out, r] views), which is how the
  // CPU LoRA kernels read them for a few rows; with plain A and B they would transpose both
  // on every call. Cached, and rebuilt when a weight changed (its version counter moved,
  // as optim_step and set_adapter_state do) or was replaced. Expert kinds (3-D, read per
  // expert by the decoder) come as they are, detached.
  std::pair<at::Tensor, at::Tensor> InferenceWeights(int64_t layer, LinearKind kind) const;

  // The targets as PEFT's adapter_config.json states them for this adapter on this model:
  // target_modules; Qwen3-MoE: target_parameters ("gate_up_proj", "down_proj", "gate.weight")
  // and, with gate_up_proj, rank_pattern {".*\\.gate_up_proj": 2r} and alpha_pattern {…: 2α}.
  struct PeftTargets {
    std::vector<std::string> target_modules, target_parameters;
    std::map<std::string, int64_t> rank_pattern;
    std::map<std::string, double> alpha_pattern;
  };
  PeftTargets peft_targets() const;

  // Every parameter with its PEFT key ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
  // "base_model.model.model.language_model.layers.0.linear_attn.in_proj_qkv.lora_A.weight" for
  // a ConditionalGeneration checkpoint, "base_model.model.lm_head.lora_A.weight"), in a fixed order (the optimizer's parameter
  // order): layer by layer, then lm_head.
  const std::vector<std::pair<std::string, at::Tensor>>& named_parameters() const { return named_; }

  Optimizer& optimizer() { return *optimizer_; }
  // forward_backward calls since the last optimizer step: seeds dropout so accumulation
  // micro-batches draw different masks, and a fused step draws what a solo step would.
  int64_t micro_batches_since_step = 0;

  // Replaces the optimizer by a fresh one of `kind` (Optimizer::Create's names): state reset,
  // step 0. Gradients are kept, so the next step applies what was accumulated.
  absl::Status ResetOptimizer(const std::string& kind);

  // Applies `update` all or nothing: every part is validated (unknown keys, shapes, optimizer
  // kind and state, a negative counter) and staged on the device before anything changes.
  absl::Status Restore(const AdapterStateUpdate& update);

 private:
  Adapter() = default;
  absl::StatusOr<std::unique_ptr<Optimizer>> NewOptimizer(const std::string& kind) const;

  AdapterConfig config_;
  double scale_ = 1.0;
  double gate_up_scale_ = 1.0;
  std::map<LinearKind, std::vector<std::pair<at::Tensor, at::Tensor>>> weights_;
  std::vector<std::pair<std::string, at::Tensor>> named_;
  std::unique_ptr<Optimizer> optimizer_;
  struct Transposed {
    at::Tensor a_source, b_source;  // what the copies were made from, and at which versions
    int64_t a_version = -1, b_version = -1;
    at::Tensor a, b;
  };
  mutable std::map<LinearKind, std::vector<Transposed>> transposed_;
};

}  // namespace twinkle::engine
