#include "core/engine/lora/adapter.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace twinkle::engine {

absl::StatusOr<std::vector<LinearKind>> ParseTargets(const std::vector<std::string>& names) {
  std::vector<LinearKind> out;
  for (const std::string& name : names) {
    if (name == "all-linear") return std::vector<LinearKind>(std::begin(kAllLinearKinds), std::end(kAllLinearKinds));
    bool found = false;
    for (LinearKind kind : kAllLinearKinds) {
      if (name == LinearKindName(kind)) {
        out.push_back(kind);
        found = true;
      }
    }
    if (!found) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown LoRA target module '", name,
          "' (accepted: all-linear, q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"));
    }
  }
  if (out.empty()) return std::vector<LinearKind>(std::begin(kAllLinearKinds), std::end(kAllLinearKinds));
  return out;
}

absl::StatusOr<std::unique_ptr<Adapter>> Adapter::Create(const AdapterConfig& config,
                                                         const DecoderModel& model,
                                                         c10::Device device) {
  if (config.rank < 1) return absl::InvalidArgumentError(absl::StrCat("LoRA rank must be >= 1, got ", config.rank));
  if (!(config.alpha > 0) || !std::isfinite(config.alpha)) {
    return absl::InvalidArgumentError(absl::StrCat("lora_alpha must be positive, got ", config.alpha));
  }
  if (!(config.dropout >= 0 && config.dropout < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("lora dropout must be in [0, 1), got ", config.dropout));
  }
  auto adapter = std::unique_ptr<Adapter>(new Adapter());
  adapter->config_ = config;
  const double r = static_cast<double>(config.rank);
  adapter->scale_ = config.use_rslora ? config.alpha / std::sqrt(r) : config.alpha / r;

  // PEFT: A ~ kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)); B = 0. Drawn on the
  // CPU from the adapter's seed so the same seed gives the same adapter on any device.
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(config.seed);
  const at::TensorOptions fp32 = at::TensorOptions().dtype(at::kFloat);
  const std::vector<LinearKind> targets =
      config.targets.empty() ? std::vector<LinearKind>(std::begin(kAllLinearKinds), std::end(kAllLinearKinds))
                             : config.targets;
  std::vector<at::Tensor> params;
  const int64_t layers = model.config().num_hidden_layers;
  for (int64_t layer = 0; layer < layers; ++layer) {
    for (LinearKind kind : kAllLinearKinds) {  // fixed order, whatever order targets came in
      if (std::find(targets.begin(), targets.end(), kind) == targets.end()) continue;
      const auto [in, out] = model.LinearShape(kind);
      const double bound = 1.0 / std::sqrt(static_cast<double>(in));
      at::Tensor a = at::empty({config.rank, in}, fp32).uniform_(-bound, bound, gen).to(device);
      at::Tensor b = at::zeros({out, config.rank}, fp32.device(device));
      a.set_requires_grad(true);
      b.set_requires_grad(true);
      const bool attn = kind == LinearKind::kQ || kind == LinearKind::kK || kind == LinearKind::kV ||
                        kind == LinearKind::kO;
      const std::string prefix = absl::StrCat("base_model.model.model.layers.", layer, ".",
                                              attn ? "self_attn." : "mlp.", LinearKindName(kind));
      adapter->named_.emplace_back(prefix + ".lora_A.weight", a);
      adapter->named_.emplace_back(prefix + ".lora_B.weight", b);
      adapter->weights_[kind].emplace_back(a, b);
      params.push_back(a);
      params.push_back(b);
    }
  }
  absl::StatusOr<std::unique_ptr<Optimizer>> optimizer = Optimizer::Create(config.optimizer, params);
  if (!optimizer.ok()) return optimizer.status();
  adapter->optimizer_ = *std::move(optimizer);
  return adapter;
}

absl::Status Adapter::SetWeights(const std::map<std::string, at::Tensor>& weights) {
  std::map<std::string, const at::Tensor*> ours;
  for (const auto& [name, t] : named_) ours[name] = &t;
  for (const auto& [name, t] : weights) {
    auto it = ours.find(name);
    if (it == ours.end()) return absl::InvalidArgumentError(absl::StrCat("adapter has no weight '", name, "'"));
    if (!t.sizes().equals(it->second->sizes())) {
      return absl::InvalidArgumentError(absl::StrCat("weight '", name, "' has shape ", c10::str(t.sizes()),
                                                     "; the adapter's is ", c10::str(it->second->sizes())));
    }
    if (!at::isfinite(t).all().item<bool>()) {
      return absl::InvalidArgumentError(absl::StrCat("weight '", name, "' has non-finite values"));
    }
  }
  c10::NoGradGuard no_grad;  // copy into the leaves without recording the copy
  for (const auto& [name, t] : weights) {
    const_cast<at::Tensor*>(ours[name])->copy_(t);
  }
  return absl::OkStatus();
}

}  // namespace twinkle::engine
