// Loss registry, validation of specs and inputs, and dispatch to the loss families
// (tinker_losses.cc, twinkle_token_losses.cc, twinkle_preference_losses.cc).
#include "core/engine/loss/loss.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/engine/loss/loss_internal.h"

namespace twinkle::engine {
namespace loss_internal {
namespace {

// epsilon_high's default is "whatever epsilon is"; NaN marks that until it is resolved.
constexpr double kSameAsEpsilon = std::numeric_limits<double>::quiet_NaN();

const std::vector<std::string>& DpoLossTypes() {
  static const auto* types = new std::vector<std::string>{"sigmoid", "hinge", "ipo", "kto_pair"};
  return *types;
}

const std::vector<LossDef>& Registry() {
  static const auto* defs = [] {
    // Twinkle's GRPOLoss(epsilon, epsilon_high, beta); its variants take the same parameters.
    const std::vector<std::pair<std::string, double>> grpo_params = {
        {"epsilon", 0.2}, {"epsilon_high", kSameAsEpsilon}, {"beta", 0.0}};
    auto dr_grpo_params = grpo_params;
    dr_grpo_params.emplace_back("max_completion_length", 1024);
    const std::vector<std::string> grpo_optional = {"logprobs", "ref_logprobs", "mask", "weights"};
    return new std::vector<LossDef>{
        {"cross_entropy", Kind::kCe, {}, {}, {}, {"weights"}},
        {"importance_sampling", Kind::kIs, {}, {}, {"logprobs", "advantages"}, {"weights"}},
        {"ppo",
         Kind::kPpo,
         {{"clip_low_threshold", 0.8}, {"clip_high_threshold", 1.2}},
         {},
         {"logprobs", "advantages"},
         {"weights", "clip_low_threshold", "clip_high_threshold"}},
        {"cispo",
         Kind::kCispo,
         {{"clip_low_threshold", 0.0}, {"clip_high_threshold", 4.0}},
         {},
         {"logprobs", "advantages"},
         {"weights", "clip_low_threshold", "clip_high_threshold"}},
        {"dro", Kind::kDro, {{"beta", 0.05}}, {}, {"logprobs", "advantages"}, {"weights"}},
        // Tinker's GSPO (GSPO-token). The clip range defaults to the GSPO paper's
        // (Zheng et al. 2025, §5.1: 3e-4 below, 4e-4 above 1); docs/losses.md.
        {"gspo",
         Kind::kGspo,
         {{"clip_low_threshold", 1.0 - 3e-4}, {"clip_high_threshold", 1.0 + 4e-4}},
         {},
         {"logprobs", "advantages"},
         {"weights", "sequence_ratio_mask"}},
        // Tinker's StableReinforce; the public documentation leaves the formula open, this
        // one is docs/losses.md's choice. "logprobs" are the recorded sampler log-probs (the
        // Tinker layer fills them from the sequences its datums' provenance names) and
        // "stability_mask" marks the positions that have one (0/1).
        {"stable_reinforce",
         Kind::kStableReinforce,
         {{"kl_coeff", 0.0}, {"clip_high_threshold", 2.0}},
         {},
         {"logprobs", "advantages"},
         {"weights", "stability_mask"}},
        {"twinkle:cross_entropy",
         Kind::kTwinkleCe,
         {},
         {{"reduction", "mean"}},
         {},
         {"mask", "weights"}},
        // Deviation from Twinkle: missing advantages are an error here, not a silent zero loss.
        {"twinkle:grpo", Kind::kTwinkleGrpo, grpo_params, {}, {"advantages"}, grpo_optional},
        {"twinkle:gspo", Kind::kTwinkleGspo, grpo_params, {}, {"advantages"}, grpo_optional},
        // Twinkle's CISPO clips at 1 + epsilon only; it accepts epsilon_high (a GRPO parameter)
        // but never uses it, and so does this one.
        {"twinkle:cispo", Kind::kTwinkleCispo, grpo_params, {}, {"advantages"}, grpo_optional},
        {"twinkle:bnpo", Kind::kTwinkleBnpo, grpo_params, {}, {"advantages"}, grpo_optional},
        {"twinkle:dr_grpo",
         Kind::kTwinkleDrGrpo,
         dr_grpo_params,
         {},
         {"advantages"},
         grpo_optional},
        // reference_free is a boolean, sent as 0 or 1. Deviation from Twinkle: without
        // ref_logprobs (and not reference_free) this is an error, not a silent zero loss.
        {"twinkle:dpo",
         Kind::kTwinkleDpo,
         {{"beta", 0.1}, {"label_smoothing", 0.0}, {"reference_free", 0.0}, {"sft_weight", 0.0}},
         {{"loss_type", "sigmoid"}},
         {},
         {"ref_logprobs", "mask", "weights"}},
    };
  }();
  return *defs;
}

const LossDef* FindLoss(const std::string& name) {
  for (const LossDef& def : Registry()) {
    if (name == def.name) return &def;
  }
  return nullptr;
}

bool Contains(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

std::string Quoted(const std::vector<std::string>& names) {
  if (names.empty()) return "none";
  return absl::StrCat("'", absl::StrJoin(names, "', '"), "'");
}

std::string ShapeString(const at::Tensor& t) {
  return absl::StrCat("[", absl::StrJoin(t.sizes(), ", "), "]");
}

// Checks on tensor values (finite, 0/1 masks, clip bounds) are queued as device booleans and
// read back with one synchronisation: an .item() per datum and input would stall a GPU
// hundreds of times per batch. Host tensors are checked at once by a plain loop instead
// (AddHost): on a CPU engine the ATen ops of a check cost more than the loop.
class ValueChecks {
 public:
  void Add(std::string error, const at::Tensor& ok) {
    checks_.push_back({std::move(error), static_cast<int>(oks_.size())});
    oks_.push_back(ok.reshape({}));
  }
  enum class Check { kFinite, kZeroOrOne };
  // t: 1-D. Falls back to Add for device tensors and dtypes the loop does not read.
  void AddHost(std::string error, const at::Tensor& t, Check check) {
    std::optional<bool> ok;
    if (t.is_cpu() && t.dim() == 1) {
      if (t.scalar_type() == at::kFloat) ok = Holds<float>(t, check);
      else if (t.scalar_type() == at::kDouble) ok = Holds<double>(t, check);
    }
    if (!ok.has_value()) {
      const at::Tensor d = t.detach();
      Add(std::move(error), check == Check::kFinite ? at::isfinite(d).all() : ((d == 0) | (d == 1)).all());
    } else {
      checks_.push_back({std::move(error), *ok ? kPassed : kFailed});
    }
  }
  // The first failed check, in the order they were added.
  absl::Status Run(const LossDef& def) const {
    const bool* flags = nullptr;
    at::Tensor ok;
    if (!oks_.empty()) {
      ok = at::stack(oks_).cpu();
      flags = ok.data_ptr<bool>();
    }
    for (const auto& [error, index] : checks_) {
      if (index == kFailed || (index >= 0 && !flags[index])) return Bad(def, error);
    }
    return absl::OkStatus();
  }

 private:
  static constexpr int kPassed = -1, kFailed = -2;  // host checks, done at once

  template <typename T>
  static bool Holds(const at::Tensor& t, Check check) {
    const T* p = t.const_data_ptr<T>();
    const int64_t n = t.size(0), stride = t.stride(0);
    bool ok = true;
    for (int64_t i = 0; i < n; ++i) {
      const T v = p[i * stride];
      ok &= check == Check::kFinite ? std::isfinite(v) : (v == T(0) || v == T(1));
    }
    return ok;
  }

  std::vector<std::pair<std::string, int>> checks_;  // error, index into oks_ or kPassed/kFailed
  std::vector<at::Tensor> oks_;
};

absl::StatusOr<Prepared> Prepare(const LossDef& def, const LossSpec& spec,
                                 const std::vector<LossDatum>& datums) {
  if (datums.empty()) return Bad(def, "needs at least one datum");
  const at::Tensor& first = datums[0].logprobs;
  if (!first.defined() || !at::isFloatingType(first.scalar_type())) {
    return Bad(def, "datum 0: logprobs must be a floating-point tensor");
  }
  // Half-precision log-probs would lose the small ratio differences PPO-style losses clip
  // on; compute in float32 at least (autograd casts the gradient back).
  const c10::ScalarType dtype = at::promote_types(first.scalar_type(), at::kFloat);
  const bool twinkle = FamilyOf(def.kind) != Family::kTinker;
  const bool clips = def.kind == Kind::kPpo || def.kind == Kind::kCispo;
  std::vector<std::string> accepted = def.required;
  accepted.insert(accepted.end(), def.optional.begin(), def.optional.end());

  ValueChecks checks;
  Prepared out;
  out.reserve(datums.size());
  for (size_t i = 0; i < datums.size(); ++i) {
    const std::string where = absl::StrCat("datum ", i);
    const at::Tensor& lp = datums[i].logprobs;
    // [T, K]: soft targets (K target tokens per position, Tinker's top-k distillation),
    // which only cross_entropy takes.
    if (!lp.defined() || lp.dim() < 1 || lp.dim() > 2) {
      return Bad(def, absl::StrCat(where, ": logprobs must be a tensor [T] or [T, K], got ",
                                   lp.defined() ? ShapeString(lp) : "none"));
    }
    if (lp.dim() == 2 && def.kind != Kind::kCe) {
      return Bad(def, absl::StrCat(where, ": 2-D target_tokens ", ShapeString(lp),
                                   " (soft targets) are only accepted by cross_entropy"));
    }
    if (lp.scalar_type() != first.scalar_type() || lp.device() != first.device()) {
      return Bad(def, absl::StrCat(where, ": logprobs dtype/device differ from datum 0"));
    }
    checks.AddHost(absl::StrCat(where, ": logprobs are not all finite"), lp, ValueChecks::Check::kFinite);
    PreparedDatum d;
    d.lp = lp.scalar_type() == dtype ? lp : lp.to(dtype);
    for (const auto& [name, tensor] : datums[i].inputs) {
      if (!Contains(accepted, name)) {
        return Bad(def, absl::StrCat(where, ": unknown input '", name,
                                     "' (accepted: ", Quoted(accepted), ")"));
      }
      if (!tensor.defined() || !tensor.sizes().equals(lp.sizes())) {
        return Bad(def, absl::StrCat(where, ": input '", name, "' has shape ",
                                     tensor.defined() ? ShapeString(tensor) : "none",
                                     ", expected ", ShapeString(lp), " like logprobs"));
      }
      // Inputs are data, never part of the graph.
      at::Tensor t = tensor.requires_grad() ? tensor.detach() : tensor;
      if (t.device() != lp.device() || t.scalar_type() != dtype) t = t.to(lp.device(), dtype);
      checks.AddHost(absl::StrCat(where, ": input '", name, "' has non-finite values"), t,
                     ValueChecks::Check::kFinite);
      // Twinkle's losses normalise by the number of unmasked tokens, which is only defined
      // for 0/1 masks; real-valued weights belong to the Tinker losses.
      if ((twinkle && (name == "mask" || name == "weights")) ||
          name == "stability_mask") {
        checks.AddHost(absl::StrCat(where, ": input '", name, "' must be 0 or 1 per token"), t,
                       ValueChecks::Check::kZeroOrOne);
      }
      d.in.emplace(name, std::move(t));
    }
    for (const std::string& name : def.required) {
      if (d.Get(name) == nullptr) {
        return Bad(def, absl::StrCat(where, ": missing required input '", name, "'"));
      }
    }
    if (clips) {  // per-token thresholds override the scalar config for their tokens
      const at::Tensor* lo = d.Get("clip_low_threshold");
      const at::Tensor* hi = d.Get("clip_high_threshold");
      const at::Tensor shape = d.lp.detach();
      d.clip_low = lo ? *lo : at::full_like(shape, ConfigValue(spec, def, "clip_low_threshold"));
      d.clip_high = hi ? *hi : at::full_like(shape, ConfigValue(spec, def, "clip_high_threshold"));
      if (lo || hi) {
        checks.Add(absl::StrCat(where, ": per-token clip thresholds need 0 <= low <= high"),
                   ((d.clip_low >= 0) & (d.clip_low <= d.clip_high)).all());
      }
    }
    out.push_back(std::move(d));
  }
  if (absl::Status s = checks.Run(def); !s.ok()) return s;
  return out;
}

// Range checks of one loss's numeric and string config (keys and types already checked).
absl::Status CheckRanges(const LossSpec& spec, const LossDef& def) {
  auto get = [&](const std::string& key) { return ConfigValue(spec, def, key); };
  auto non_negative = [&](const std::string& key) -> absl::Status {
    if (get(key) < 0) return Bad(def, absl::StrCat(key, " must be >= 0, got ", get(key)));
    return absl::OkStatus();
  };
  if (IsGrpoFamily(def.kind)) {
    const double eps = get("epsilon");
    // The lower clip bound 1 - epsilon is a ratio, so it must stay non-negative; CISPO only
    // clips from above (at 1 + epsilon).
    if (def.kind == Kind::kTwinkleCispo) {
      if (absl::Status s = non_negative("epsilon"); !s.ok()) return s;
    } else if (eps < 0 || eps > 1) {
      return Bad(def, absl::StrCat("epsilon must be in [0, 1], got ", eps));
    }
    if (spec.config.count("epsilon_high")) {
      if (absl::Status s = non_negative("epsilon_high"); !s.ok()) return s;
    }
    if (def.kind == Kind::kTwinkleDrGrpo) {
      const double length = get("max_completion_length");
      if (length < 1 || length != std::floor(length)) {
        return Bad(def,
                   absl::StrCat("max_completion_length must be a positive integer, got ", length));
      }
    }
    return non_negative("beta");
  }
  switch (def.kind) {
    case Kind::kPpo:
    case Kind::kCispo: {
      const double lo = get("clip_low_threshold"), hi = get("clip_high_threshold");
      if (lo < 0 || lo > hi) {
        return Bad(def, absl::StrCat("need 0 <= clip_low_threshold <= clip_high_threshold, got ",
                                     lo, " and ", hi));
      }
      return absl::OkStatus();
    }
    case Kind::kDro:
      return non_negative("beta");
    case Kind::kGspo: {
      const double lo = get("clip_low_threshold"), hi = get("clip_high_threshold");
      if (lo < 0 || lo > 1 || hi < 1) {
        return Bad(def, absl::StrCat("need 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got ",
                                     lo, " and ", hi));
      }
      return absl::OkStatus();
    }
    case Kind::kStableReinforce:
      if (get("clip_high_threshold") <= 0) {
        return Bad(def, absl::StrCat("clip_high_threshold must be > 0, got ", get("clip_high_threshold")));
      }
      return non_negative("kl_coeff");
    case Kind::kTwinkleDpo: {
      // ipo divides by beta; z = beta * margin is meaningless at 0.
      if (get("beta") <= 0) return Bad(def, absl::StrCat("beta must be > 0, got ", get("beta")));
      const double smoothing = get("label_smoothing");
      if (smoothing < 0 || smoothing > 1) {
        return Bad(def, absl::StrCat("label_smoothing must be in [0, 1], got ", smoothing));
      }
      const std::string type = StringConfigValue(spec, def, "loss_type");
      if (smoothing > 0 && type != "sigmoid") {
        return Bad(def,
                   absl::StrCat("label_smoothing > 0 needs loss_type 'sigmoid', got '", type, "'"));
      }
      const double free = get("reference_free");
      if (free != 0 && free != 1) {
        return Bad(def, absl::StrCat("reference_free must be 0 or 1 (a boolean), got ", free));
      }
      return non_negative("sft_weight");
    }
    default:
      return absl::OkStatus();
  }
}

}  // namespace

Family FamilyOf(Kind kind) {
  switch (kind) {
    case Kind::kCe:
    case Kind::kIs:
    case Kind::kPpo:
    case Kind::kCispo:
    case Kind::kDro:
    case Kind::kGspo:
    case Kind::kStableReinforce:
      return Family::kTinker;
    case Kind::kTwinkleDpo:
      return Family::kTwinklePreference;
    default:
      return Family::kTwinkleToken;
  }
}

bool IsGrpoFamily(Kind kind) {
  return kind == Kind::kTwinkleGrpo || kind == Kind::kTwinkleGspo || kind == Kind::kTwinkleCispo ||
         kind == Kind::kTwinkleBnpo || kind == Kind::kTwinkleDrGrpo;
}

double ConfigValue(const LossSpec& spec, const LossDef& def, const std::string& key) {
  if (auto it = spec.config.find(key); it != spec.config.end()) return it->second;
  for (const auto& [name, value] : def.numeric) {
    if (name == key) return value;
  }
  return 0.0;
}

std::string StringConfigValue(const LossSpec& spec, const LossDef& def, const std::string& key) {
  if (auto it = spec.string_config.find(key); it != spec.string_config.end()) return it->second;
  for (const auto& [name, value] : def.strings) {
    if (name == key) return value;
  }
  return "";
}

absl::Status Bad(const LossDef& def, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("loss '", def.name, "': ", what));
}

}  // namespace loss_internal

using loss_internal::Bad;
using loss_internal::Contains;
using loss_internal::FindLoss;
using loss_internal::LossDef;
using loss_internal::Quoted;

std::vector<std::string> SupportedLossNames() {
  std::vector<std::string> names;
  for (const LossDef& def : loss_internal::Registry()) names.emplace_back(def.name);
  return names;
}

absl::Status ValidateLossSpec(const LossSpec& spec) {
  const LossDef* def = FindLoss(spec.name);
  if (def == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown loss '", spec.name, "' (supported: ", Quoted(SupportedLossNames()), ")"));
  }
  std::vector<std::string> numeric_keys, string_keys;
  for (const auto& [key, unused] : def->numeric) numeric_keys.push_back(key);
  for (const auto& [key, unused] : def->strings) string_keys.push_back(key);
  std::vector<std::string> all_keys = numeric_keys;
  all_keys.insert(all_keys.end(), string_keys.begin(), string_keys.end());
  auto unknown_key = [&](const std::string& key) {
    return Bad(*def,
               absl::StrCat("unknown config key '", key, "' (accepted: ", Quoted(all_keys), ")"));
  };
  for (const auto& [key, value] : spec.config) {
    if (Contains(string_keys, key)) return Bad(*def, absl::StrCat(key, " must be a string"));
    if (!Contains(numeric_keys, key)) return unknown_key(key);
    if (!std::isfinite(value)) return Bad(*def, absl::StrCat(key, " must be finite"));
  }
  for (const auto& [key, value] : spec.string_config) {
    if (Contains(numeric_keys, key)) return Bad(*def, absl::StrCat(key, " must be a number"));
    if (!Contains(string_keys, key)) return unknown_key(key);
    if (key == "reduction" && value != "mean" && value != "sum") {
      return Bad(*def, absl::StrCat("reduction must be 'mean' or 'sum', got '", value, "'"));
    }
    if (key == "loss_type" && !Contains(loss_internal::DpoLossTypes(), value)) {
      return Bad(*def, absl::StrCat("loss_type must be one of ",
                                    Quoted(loss_internal::DpoLossTypes()), ", got '", value, "'"));
    }
  }
  return loss_internal::CheckRanges(spec, *def);
}

absl::StatusOr<LossResult> ComputeLoss(const LossSpec& spec, const std::vector<LossDatum>& datums,
                                       const LossContext& context) {
  if (absl::Status s = ValidateLossSpec(spec); !s.ok()) return s;
  const LossDef& def = *FindLoss(spec.name);
  if (context.window_tokens < 0 || context.window_sequences < 0) {
    return Bad(def, "window_tokens and window_sequences must be >= 0");
  }
  try {
    absl::StatusOr<loss_internal::Prepared> prepared = loss_internal::Prepare(def, spec, datums);
    if (!prepared.ok()) return prepared.status();
    switch (loss_internal::FamilyOf(def.kind)) {
      case loss_internal::Family::kTinker:
        return loss_internal::TinkerLoss(def, spec, *prepared);
      case loss_internal::Family::kTwinkleToken:
        return loss_internal::TwinkleTokenLoss(def, spec, *prepared, context);
      case loss_internal::Family::kTwinklePreference:
        return loss_internal::TwinklePreferenceLoss(def, spec, *prepared, context);
    }
    return absl::InternalError("unreachable");
  } catch (const std::exception& e) {  // c10::Error included: never throw out of the engine
    return absl::InternalError(absl::StrCat("loss '", spec.name, "': ", e.what()));
  }
}

}  // namespace twinkle::engine
