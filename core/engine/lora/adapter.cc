#include "core/engine/lora/adapter.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace twinkle::engine {
namespace {

// Everything a tenant can name: the decoder layers' linears (a model has some of them), then
// the output projection.
constexpr LinearKind kTargetKinds[] = {
    LinearKind::kQ,         LinearKind::kK,       LinearKind::kV,       LinearKind::kO,
    LinearKind::kGate,      LinearKind::kUp,      LinearKind::kDown,    LinearKind::kLmHead,
    LinearKind::kInProjQkv, LinearKind::kInProjZ, LinearKind::kInProjB, LinearKind::kInProjA,
    LinearKind::kOutProj,   LinearKind::kRouter,  LinearKind::kSharedExpertGate};

}  // namespace

absl::StatusOr<std::vector<LinearKind>> ParseTargets(const std::vector<std::string>& names) {
  std::set<LinearKind> wanted;
  for (const std::string& name : names) {
    if (name == "all-linear") {
      wanted.insert(std::begin(kAllLinearKinds), std::end(kAllLinearKinds));
      wanted.insert(LinearKind::kRouter);  // only where PEFT wraps it (Qwen3-MoE)
      wanted.insert(LinearKind::kSharedExpertGate);
      continue;
    }
    bool found = false;
    for (LinearKind kind : kTargetKinds) {
      if (name == LinearKindName(kind)) {
        wanted.insert(kind);
        found = true;
      }
    }
    if (!found) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown LoRA target module '", name,
          "' (accepted: all-linear, q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, "
          "lm_head; Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj; Qwen3-MoE: gate "
          "(the router); Qwen3.5-MoE: shared_expert_gate)"));
    }
  }
  if (wanted.empty()) return ParseTargets({"all-linear"});
  return std::vector<LinearKind>(wanted.begin(), wanted.end());  // enum order
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
  std::vector<LinearKind> targets = config.targets;
  if (targets.empty()) targets = *ParseTargets({"all-linear"});
  std::sort(targets.begin(), targets.end());
  targets.erase(std::unique(targets.begin(), targets.end()), targets.end());
  const auto has = [](const std::vector<LinearKind>& v, LinearKind kind) {
    return std::find(v.begin(), v.end(), kind) != v.end();
  };
  const bool all_linear = std::all_of(std::begin(kAllLinearKinds), std::end(kAllLinearKinds),
                                      [&](LinearKind kind) { return has(targets, kind); });
  const ModelConfig& mc = model.config();
  // What the adapter holds weights for: the targets as PEFT resolves them on this model.
  std::vector<LinearKind> kinds = targets;
  const auto erase = [&](LinearKind kind) { kinds.erase(std::remove(kinds.begin(), kinds.end(), kind), kinds.end()); };
  if (mc.model_type == "qwen3_moe") {
    // PEFT 0.21 + transformers 5 (peft/utils/transformers_weight_conversion.py, qwen3_moe ->
    // the qwen2_moe pattern): gate_proj and up_proj -> target parameter gate_up_proj (both
    // needed: they are fused), down_proj -> down_proj, gate -> gate.weight; the remaining
    // target_modules no longer name the MLP, so a dense-MLP layer's linears are not wrapped.
    const bool gate = has(targets, LinearKind::kGate), up = has(targets, LinearKind::kUp);
    if (gate != up) {
      return absl::InvalidArgumentError(absl::StrCat(
          "LoRA target ", gate ? "gate_proj" : "up_proj", " without ", gate ? "up_proj" : "gate_proj", ": ",
          mc.architecture, " fuses both into the experts' gate_up_proj (PEFT target_parameters), so they "
          "are targeted together or not at all"));
    }
    if (gate) kinds.push_back(LinearKind::kExpertsGateUp);
    if (has(targets, LinearKind::kDown)) kinds.push_back(LinearKind::kExpertsDown);
    erase(LinearKind::kGate);
    erase(LinearKind::kUp);
    erase(LinearKind::kDown);
  } else {
    // Elsewhere PEFT maps nothing: a router that is no Linear (Qwen3.5-MoE's
    // Qwen3_5MoeTopKRouter) is refused by name and left out of all-linear.
    if (!mc.moe_layers.empty() && !all_linear && has(targets, LinearKind::kRouter)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "LoRA target gate: the router of ", mc.architecture,
          " is not a Linear layer, and PEFT cannot target it (nor does all-linear)"));
    }
    erase(LinearKind::kRouter);
  }
  const bool param_wrapper = std::any_of(kinds.begin(), kinds.end(), [](LinearKind kind) {
    return IsExpertKind(kind) || kind == LinearKind::kRouter;
  });
  if (param_wrapper && config.dropout != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lora dropout ", config.dropout, " with LoRA on the experts or the router of ", mc.architecture,
        ": PEFT's ParamWrapper (target_parameters) does not work with lora_dropout != 0"));
  }
  // As PEFT: a named module the model does not have is no error as long as some named one
  // exists ("all-linear" names the linears of every family).
  const int64_t layers = mc.num_hidden_layers;
  const auto present = [&](LinearKind kind) {
    for (int64_t layer = 0; layer < (kind == LinearKind::kLmHead ? 1 : layers); ++layer) {
      if (model.HasLinear(layer, kind)) return true;
    }
    return false;
  };
  if (std::none_of(kinds.begin(), kinds.end(), present)) {
    std::vector<std::string> names;
    for (LinearKind kind : targets) {
      if (kind != LinearKind::kRouter && kind != LinearKind::kSharedExpertGate) names.push_back(LinearKindName(kind));
    }
    if (names.empty()) {
      for (LinearKind kind : targets) names.push_back(LinearKindName(kind));
    }
    return absl::InvalidArgumentError(absl::StrCat("none of the LoRA target modules [",
                                                   absl::StrJoin(names, ", "), "] is in the ",
                                                   mc.architecture, " model"));
  }
  kinds.erase(std::remove_if(kinds.begin(), kinds.end(), [&](LinearKind kind) { return !present(kind); }),
              kinds.end());
  // The targets as given, less what this model lacks (create_adapter with them rebuilds it).
  targets.erase(std::remove_if(targets.begin(), targets.end(),
                               [&](LinearKind kind) {
                                 if (kind == LinearKind::kGate || kind == LinearKind::kUp) {
                                   return !has(kinds, kind) && !has(kinds, LinearKind::kExpertsGateUp);
                                 }
                                 if (kind == LinearKind::kDown) {
                                   return !has(kinds, kind) && !has(kinds, LinearKind::kExpertsDown);
                                 }
                                 return !has(kinds, kind);
                               }),
                targets.end());
  adapter->config_.targets = targets;
  const double rank2 = 2.0 * r;
  adapter->gate_up_scale_ = config.use_rslora ? 2.0 * config.alpha / std::sqrt(rank2) : 2.0 * config.alpha / rank2;
  const auto targeted = [&](LinearKind kind) { return has(kinds, kind); };
  // One (A, B) pair: A drawn from `gen` (so the draw order fixes every adapter's init).
  // Expert kinds (PEFT's ParamWrapper on a 3-D parameter): A [E·r, in], B [out, E·r], with
  // gate_up_proj's r doubled; A's bound is still 1/sqrt(in).
  const auto add_pair = [&](LinearKind kind, const std::string& prefix) {
    const auto [in, out] = model.LinearShape(kind);
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    const int64_t rank = IsExpertKind(kind) ? (kind == LinearKind::kExpertsGateUp ? 2 : 1) * config.rank * mc.num_experts
                                            : config.rank;
    at::Tensor a = at::empty({rank, in}, fp32).uniform_(-bound, bound, gen).to(device);
    at::Tensor b = at::zeros({out, rank}, fp32.device(device));
    a.set_requires_grad(true);
    b.set_requires_grad(true);
    adapter->named_.emplace_back(prefix + ".lora_A.weight", a);
    adapter->named_.emplace_back(prefix + ".lora_B.weight", b);
    adapter->weights_[kind].emplace_back(a, b);
  };
  for (int64_t layer = 0; layer < layers; ++layer) {
    for (LinearKind kind : kAllLinearKinds) {  // fixed order, whatever order targets came in
      if (!targeted(kind)) continue;
      if (!model.HasLinear(layer, kind)) {
        // A hybrid model's layer without this linear: an empty place keeps a(layer, kind)
        // indexed by layer; nothing asks for it (the model only runs linears it has).
        adapter->weights_[kind].emplace_back();
        continue;
      }
      add_pair(kind, "base_model.model." + LinearModulePath(mc, layer, kind));
    }
    // The MoE block's parameters after its linears, in PEFT's order: the experts (PEFT nests
    // its wrappers: gate_up_proj, wrapped first, is the inner one, `experts.base_layer`, when
    // down_proj is wrapped too), then the router, then the shared expert's gate.
    for (LinearKind kind : kMoeKinds) {
      if (!targeted(kind)) continue;
      if (!model.HasLinear(layer, kind)) {
        adapter->weights_[kind].emplace_back();
        continue;
      }
      const bool inner = kind == LinearKind::kExpertsGateUp && targeted(LinearKind::kExpertsDown);
      add_pair(kind, "base_model.model." + LinearModulePath(mc, layer, kind) + (inner ? ".base_layer" : ""));
    }
  }
  // Last, as PEFT orders it (and so adapters without it keep their draws and order). PEFT
  // wraps lm_head even when it shares its weight with the embedding; so do we.
  if (targeted(LinearKind::kLmHead)) add_pair(LinearKind::kLmHead, "base_model.model.lm_head");

  absl::StatusOr<std::unique_ptr<Optimizer>> optimizer = adapter->NewOptimizer(config.optimizer);
  if (!optimizer.ok()) return optimizer.status();
  adapter->optimizer_ = *std::move(optimizer);
  adapter->config_.optimizer = adapter->optimizer_->kind_name();
  return adapter;
}

absl::StatusOr<std::unique_ptr<Optimizer>> Adapter::NewOptimizer(const std::string& kind) const {
  std::vector<at::Tensor> params;
  params.reserve(named_.size());
  for (const auto& [name, t] : named_) params.push_back(t);
  return Optimizer::Create(kind, std::move(params));
}

absl::Status Adapter::ResetOptimizer(const std::string& kind) {
  absl::StatusOr<std::unique_ptr<Optimizer>> optimizer = NewOptimizer(kind);
  if (!optimizer.ok()) return optimizer.status();
  optimizer_ = *std::move(optimizer);
  config_.optimizer = optimizer_->kind_name();
  return absl::OkStatus();
}

absl::Status Adapter::Restore(const AdapterStateUpdate& update) {
  std::map<std::string, const at::Tensor*> ours;
  for (const auto& [name, t] : named_) ours[name] = &t;
  // Returns our parameter named `name` after checking `t` against it.
  const auto check = [&](const char* what, const std::string& name,
                         const at::Tensor& t) -> absl::StatusOr<const at::Tensor*> {
    auto it = ours.find(name);
    if (it == ours.end()) {
      return absl::InvalidArgumentError(absl::StrCat("adapter has no ", what, " '", name, "'"));
    }
    if (!t.defined() || !at::isFloatingType(t.scalar_type())) {
      return absl::InvalidArgumentError(absl::StrCat(what, " '", name, "' must be a floating-point tensor"));
    }
    if (!t.sizes().equals(it->second->sizes())) {
      return absl::InvalidArgumentError(absl::StrCat(what, " '", name, "' has shape ", c10::str(t.sizes()),
                                                     "; the adapter's is ", c10::str(it->second->sizes())));
    }
    return it->second;
  };

  // 1. Validate and stage everything, in the parameters' dtype and on their device. A failure
  // here (bad input, or a device out of memory) returns with nothing changed.
  std::vector<std::pair<const at::Tensor*, at::Tensor>> weights, grads;
  std::unique_ptr<Optimizer> optimizer;
  try {
    c10::NoGradGuard no_grad;
    for (const auto& [name, t] : update.weights) {
      absl::StatusOr<const at::Tensor*> param = check("weight", name, t);
      if (!param.ok()) return param.status();
      if (!at::isfinite(t).all().item<bool>()) {
        return absl::InvalidArgumentError(absl::StrCat("weight '", name, "' has non-finite values"));
      }
      weights.emplace_back(*param, t.to((*param)->options()));
    }
    if (update.grads.has_value()) {
      // Non-finite gradients are restored as they were: the next optimizer step refuses them,
      // exactly as it would have without the round trip.
      for (const auto& [name, t] : *update.grads) {
        absl::StatusOr<const at::Tensor*> param = check("gradient", name, t);
        if (!param.ok()) return param.status();
        // A copy of our own: autograd accumulates into it in place.
        grads.emplace_back(*param, t.to((*param)->options(), /*non_blocking=*/false, /*copy=*/true));
      }
    }
    if (update.micro_batches_since_step.has_value() && *update.micro_batches_since_step < 0) {
      return absl::InvalidArgumentError(absl::StrCat("micro_batches_since_step must be >= 0, got ",
                                                     *update.micro_batches_since_step));
    }
    if (update.reset_optimizer && !update.optimizer_state.empty()) {
      return absl::InvalidArgumentError("reset_optimizer and an optimizer state are exclusive");
    }
    if (update.reset_optimizer) {
      absl::StatusOr<std::unique_ptr<Optimizer>> fresh = NewOptimizer(
          update.optimizer_kind.empty() ? optimizer_->kind_name() : update.optimizer_kind);
      if (!fresh.ok()) return fresh.status();
      optimizer = *std::move(fresh);
    } else if (!update.optimizer_kind.empty() || !update.optimizer_state.empty()) {
      // A candidate optimizer takes the state, so a rejected state leaves the live one as is.
      absl::StatusOr<std::unique_ptr<Optimizer>> candidate = NewOptimizer(
          update.optimizer_kind.empty() ? optimizer_->kind_name() : update.optimizer_kind);
      if (!candidate.ok()) return candidate.status();
      if (!update.optimizer_state.empty()) {
        if (absl::Status s = (*candidate)->LoadState(update.optimizer_state); !s.ok()) return s;
        optimizer = *std::move(candidate);
      } else if ((*candidate)->kind() != optimizer_->kind()) {
        optimizer = *std::move(candidate);
      }  // else: the kind it already has and no state: keep the live optimizer
    }
  } catch (const std::exception& e) {
    return absl::ResourceExhaustedError(absl::StrCat("staging adapter state: ", e.what()));
  }

  // 2. Commit: same-device copies and handle swaps only.
  c10::NoGradGuard no_grad;  // copy into the leaves without recording the copy
  for (auto& [param, t] : weights) const_cast<at::Tensor*>(param)->copy_(t);
  if (update.grads.has_value()) {
    for (const auto& [name, t] : named_) const_cast<at::Tensor&>(t).mutable_grad() = at::Tensor();
    for (auto& [param, g] : grads) const_cast<at::Tensor*>(param)->mutable_grad() = std::move(g);
  }
  if (optimizer != nullptr) {
    optimizer_ = std::move(optimizer);
    config_.optimizer = optimizer_->kind_name();
  }
  if (update.micro_batches_since_step.has_value()) {
    micro_batches_since_step = *update.micro_batches_since_step;
  }
  return absl::OkStatus();
}

Adapter::PeftTargets Adapter::peft_targets() const {
  PeftTargets out;
  const bool params = targets(LinearKind::kExpertsGateUp) || targets(LinearKind::kExpertsDown) ||
                      targets(LinearKind::kRouter);
  for (LinearKind kind : config_.targets) {
    const bool mlp = kind == LinearKind::kGate || kind == LinearKind::kUp || kind == LinearKind::kDown;
    // Qwen3-MoE: the MLP names became parameters (a dense-MLP layer is no target any more).
    if (kind == LinearKind::kRouter || (mlp && !targets(kind))) continue;
    out.target_modules.push_back(LinearKindName(kind));
  }
  if (params) {
    if (targets(LinearKind::kExpertsGateUp)) {
      out.target_parameters.push_back("gate_up_proj");
      out.rank_pattern[".*\\.gate_up_proj"] = 2 * config_.rank;
      out.alpha_pattern[".*\\.gate_up_proj"] = 2 * config_.alpha;
    }
    if (targets(LinearKind::kExpertsDown)) out.target_parameters.push_back("down_proj");
    if (targets(LinearKind::kRouter)) out.target_parameters.push_back("gate.weight");
  }
  return out;
}

std::pair<at::Tensor, at::Tensor> Adapter::InferenceWeights(int64_t layer, LinearKind kind) const {
  const auto& [a, b] = weights_.at(kind)[layer];
  if (IsExpertKind(kind)) return {a.detach(), b.detach()};
  std::vector<Transposed>& per_layer = transposed_[kind];
  if (per_layer.size() != weights_.at(kind).size()) per_layer.resize(weights_.at(kind).size());
  Transposed& t = per_layer[layer];
  if (!t.a.defined() || !t.a_source.is_same(a) || t.a_version != a._version()) {
    const c10::NoGradGuard no_grad;
    t.a = a.detach().t().contiguous().t();
    t.a_source = a;
    t.a_version = a._version();
  }
  if (!t.b.defined() || !t.b_source.is_same(b) || t.b_version != b._version()) {
    const c10::NoGradGuard no_grad;
    t.b = b.detach().t().contiguous().t();
    t.b_source = b;
    t.b_version = b._version();
  }
  return {t.a, t.b};
}

}  // namespace twinkle::engine
