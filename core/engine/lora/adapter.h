#pragma once
// One tenant's LoRA adapter: fp32 master weights A [r, in] and B [out, r] for every targeted
// linear of every layer, initialised as PEFT does (A kaiming-uniform, B zero) from the
// adapter's own seeded generator, plus its optimizer and step counter. Parameters are leaf
// tensors; autograd accumulates their gradients across forward_backward calls.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <map>
#include <memory>
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
  std::vector<LinearKind> targets;  // empty = all linear layers
  uint64_t seed = 0;
  std::string optimizer = "adamw";
};

// Parses PEFT-style target names: "all-linear" or q_proj, k_proj, ... (InvalidArgument on
// an unknown name, listing the accepted ones).
absl::StatusOr<std::vector<LinearKind>> ParseTargets(const std::vector<std::string>& names);

class Adapter {
 public:
  static absl::StatusOr<std::unique_ptr<Adapter>> Create(const AdapterConfig& config,
                                                         const DecoderModel& model,
                                                         c10::Device device);

  const AdapterConfig& config() const { return config_; }
  double scale() const { return scale_; }
  bool targets(LinearKind kind) const { return weights_.count(kind) > 0; }
  const at::Tensor& a(int64_t layer, LinearKind kind) const { return weights_.at(kind)[layer].first; }
  const at::Tensor& b(int64_t layer, LinearKind kind) const { return weights_.at(kind)[layer].second; }

  // Every parameter with its PEFT key ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"),
  // in a fixed order (the optimizer's parameter order).
  const std::vector<std::pair<std::string, at::Tensor>>& named_parameters() const { return named_; }

  Optimizer& optimizer() { return *optimizer_; }
  // forward_backward calls since the last optimizer step: seeds dropout so accumulation
  // micro-batches draw different masks, and a fused step draws what a solo step would.
  int64_t micro_batches_since_step = 0;

  // Replaces weights by PEFT key; every key must exist with the same shape.
  absl::Status SetWeights(const std::map<std::string, at::Tensor>& weights);

 private:
  Adapter() = default;
  AdapterConfig config_;
  double scale_ = 1.0;
  std::map<LinearKind, std::vector<std::pair<at::Tensor, at::Tensor>>> weights_;
  std::vector<std::pair<std::string, at::Tensor>> named_;
  std::unique_ptr<Optimizer> optimizer_;
};

}  // namespace twinkle::engine
