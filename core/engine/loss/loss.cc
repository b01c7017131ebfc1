#include "core/engine/loss/loss.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace twinkle::engine {
namespace {

enum class Kind { kCe, kIs, kPpo, kCispo, kDro, kTwinkleCe, kTwinkleGrpo };

struct LossDef {
  const char* name;
  Kind kind;
  std::vector<std::pair<std::string, double>> numeric;  // accepted numeric keys, defaults
  std::vector<std::string> strings;                     // accepted string keys
  std::vector<std::string> required;                    // required inputs
  std::vector<std::string> optional;                    // optional inputs
};

// epsilon_high's default is "whatever epsilon is"; NaN marks that until it is resolved.
constexpr double kSameAsEpsilon = std::numeric_limits<double>::quiet_NaN();

const std::vector<LossDef>& Registry() {
  static const auto* defs = new std::vector<LossDef>{
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
      {"twinkle:cross_entropy", Kind::kTwinkleCe, {}, {"reduction"}, {}, {"mask", "weights"}},
      // Deviation from Twinkle: missing advantages are an error here, not a silent zero loss.
      {"twinkle:grpo",
       Kind::kTwinkleGrpo,
       {{"epsilon", 0.2}, {"epsilon_high", kSameAsEpsilon}, {"beta", 0.0}},
       {},
       {"advantages"},
       {"logprobs", "ref_logprobs", "mask", "weights"}},
  };
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

double ConfigValue(const LossSpec& spec, const LossDef& def, const std::string& key) {
  if (auto it = spec.config.find(key); it != spec.config.end()) return it->second;
  for (const auto& [name, value] : def.numeric) {
    if (name == key) return value;
  }
  return 0.0;
}

absl::Status Bad(const LossDef& def, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("loss '", def.name, "': ", what));
}

std::string ShapeString(const at::Tensor& t) {
  return absl::StrCat("[", absl::StrJoin(t.sizes(), ", "), "]");
}

// The datums of one call, cast to the compute dtype and checked.
struct PreparedDatum {
  at::Tensor lp;
  std::map<std::string, at::Tensor> in;
  at::Tensor clip_low, clip_high;  // ppo/cispo: per token, config where not overridden
  const at::Tensor* Get(const std::string& name) const {
    auto it = in.find(name);
    return it == in.end() ? nullptr : &it->second;
  }
};

// Checks on tensor values (finite, 0/1 masks, clip bounds) are queued as device booleans and
// read back with one synchronisation: an .item() per datum and input would stall a GPU
// hundreds of times per batch.
class ValueChecks {
 public:
  void Add(std::string error, const at::Tensor& ok) {
    errors_.push_back(std::move(error));
    oks_.push_back(ok.reshape({}));
  }
  absl::Status Run(const LossDef& def) const {
    if (oks_.empty()) return absl::OkStatus();
    const at::Tensor ok = at::stack(oks_).cpu();
    const bool* flags = ok.data_ptr<bool>();
    for (size_t i = 0; i < errors_.size(); ++i) {
      if (!flags[i]) return Bad(def, errors_[i]);
    }
    return absl::OkStatus();
  }

 private:
  std::vector<std::string> errors_;
  std::vector<at::Tensor> oks_;
};

absl::StatusOr<std::vector<PreparedDatum>> Prepare(const LossDef& def, const LossSpec& spec,
                                                   const std::vector<LossDatum>& datums) {
  if (datums.empty()) return Bad(def, "needs at least one datum");
  const at::Tensor& first = datums[0].logprobs;
  if (!first.defined() || !at::isFloatingType(first.scalar_type())) {
    return Bad(def, "datum 0: logprobs must be a floating-point tensor");
  }
  // Half-precision log-probs would lose the small ratio differences PPO-style losses clip
  // on; compute in float32 at least (autograd casts the gradient back).
  const c10::ScalarType dtype = at::promote_types(first.scalar_type(), at::kFloat);
  const bool twinkle = def.kind == Kind::kTwinkleCe || def.kind == Kind::kTwinkleGrpo;
  const bool clips = def.kind == Kind::kPpo || def.kind == Kind::kCispo;
  std::vector<std::string> accepted = def.required;
  accepted.insert(accepted.end(), def.optional.begin(), def.optional.end());

  ValueChecks checks;
  std::vector<PreparedDatum> out;
  out.reserve(datums.size());
  for (size_t i = 0; i < datums.size(); ++i) {
    const std::string where = absl::StrCat("datum ", i);
    const at::Tensor& lp = datums[i].logprobs;
    if (!lp.defined() || lp.dim() != 1) {
      return Bad(def, absl::StrCat(where, ": logprobs must be a 1-D tensor [T], got ",
                                   lp.defined() ? ShapeString(lp) : "none"));
    }
    if (lp.scalar_type() != first.scalar_type() || lp.device() != first.device()) {
      return Bad(def, absl::StrCat(where, ": logprobs dtype/device differ from datum 0"));
    }
    checks.Add(absl::StrCat(where, ": logprobs are not all finite"),
               at::isfinite(lp.detach()).all());
    PreparedDatum d;
    d.lp = lp.to(dtype);
    for (const auto& [name, tensor] : datums[i].inputs) {
      if (!Contains(accepted, name)) {
        return Bad(def, absl::StrCat(where, ": unknown input '", name,
                                     "' (accepted: ", Quoted(accepted), ")"));
      }
      if (!tensor.defined() || tensor.dim() != 1 || tensor.size(0) != lp.size(0)) {
        return Bad(def, absl::StrCat(where, ": input '", name, "' has shape ",
                                     tensor.defined() ? ShapeString(tensor) : "none",
                                     ", expected [", lp.size(0), "] like logprobs"));
      }
      // Inputs are data, never part of the graph.
      at::Tensor t = tensor.detach().to(lp.device(), dtype);
      checks.Add(absl::StrCat(where, ": input '", name, "' has non-finite values"),
                 at::isfinite(t).all());
      // Twinkle's losses normalise by the number of unmasked tokens, which is only defined
      // for 0/1 masks; real-valued weights belong to the Tinker losses.
      if (twinkle && (name == "mask" || name == "weights")) {
        checks.Add(absl::StrCat(where, ": input '", name, "' must be 0 or 1 per token"),
                   ((t == 0) | (t == 1)).all());
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

}  // namespace

std::vector<std::string> SupportedLossNames() {
  std::vector<std::string> names;
  for (const LossDef& def : Registry()) names.emplace_back(def.name);
  return names;
}

absl::Status ValidateLossSpec(const LossSpec& spec) {
  const LossDef* def = FindLoss(spec.name);
  if (def == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown loss '", spec.name, "' (supported: ", Quoted(SupportedLossNames()), ")"));
  }
  std::vector<std::string> numeric_keys;
  for (const auto& [key, unused] : def->numeric) numeric_keys.push_back(key);
  std::vector<std::string> all_keys = numeric_keys;
  all_keys.insert(all_keys.end(), def->strings.begin(), def->strings.end());
  auto unknown_key = [&](const std::string& key) {
    return Bad(*def,
               absl::StrCat("unknown config key '", key, "' (accepted: ", Quoted(all_keys), ")"));
  };
  for (const auto& [key, value] : spec.config) {
    if (Contains(def->strings, key)) return Bad(*def, absl::StrCat(key, " must be a string"));
    if (!Contains(numeric_keys, key)) return unknown_key(key);
    if (!std::isfinite(value)) return Bad(*def, absl::StrCat(key, " must be finite"));
  }
  for (const auto& [key, value] : spec.string_config) {
    if (Contains(numeric_keys, key)) return Bad(*def, absl::StrCat(key, " must be a number"));
    if (!Contains(def->strings, key)) return unknown_key(key);
    if (key == "reduction" && value != "mean" && value != "sum") {
      return Bad(*def, absl::StrCat("reduction must be 'mean' or 'sum', got '", value, "'"));
    }
  }
  auto get = [&](const std::string& key) { return ConfigValue(spec, *def, key); };
  switch (def->kind) {
    case Kind::kPpo:
    case Kind::kCispo: {
      const double lo = get("clip_low_threshold"), hi = get("clip_high_threshold");
      if (lo < 0 || lo > hi) {
        return Bad(*def, absl::StrCat("need 0 <= clip_low_threshold <= clip_high_threshold, got ",
                                      lo, " and ", hi));
      }
      break;
    }
    case Kind::kDro:
      if (get("beta") < 0) return Bad(*def, absl::StrCat("beta must be >= 0, got ", get("beta")));
      break;
    case Kind::kTwinkleGrpo: {
      const double eps = get("epsilon");
      // The lower clip bound 1 - epsilon is a ratio, so it must stay non-negative.
      if (eps < 0 || eps > 1) {
        return Bad(*def, absl::StrCat("epsilon must be in [0, 1], got ", eps));
      }
      if (spec.config.count("epsilon_high") && get("epsilon_high") < 0) {
        return Bad(*def, absl::StrCat("epsilon_high must be >= 0, got ", get("epsilon_high")));
      }
      if (get("beta") < 0) return Bad(*def, absl::StrCat("beta must be >= 0, got ", get("beta")));
      break;
    }
    default:
      break;
  }
  return absl::OkStatus();
}

absl::StatusOr<LossResult> ComputeLoss(const LossSpec& spec, const std::vector<LossDatum>& datums,
                                       const LossContext& context) {
  if (absl::Status s = ValidateLossSpec(spec); !s.ok()) return s;
  const LossDef& def = *FindLoss(spec.name);
  if (context.window_tokens < 0 || context.window_sequences < 0) {
    return Bad(def, "window_tokens and window_sequences must be >= 0");
  }
  auto get = [&](const std::string& key) { return ConfigValue(spec, def, key); };
  try {
    absl::StatusOr<std::vector<PreparedDatum>> prepared = Prepare(def, spec, datums);
    if (!prepared.ok()) return prepared.status();
    const size_t n = prepared->size();

    // Per datum: each token's loss term (graph-connected) and its 0/1 or real weight.
    std::vector<at::Tensor> terms(n), masks(n);
    for (size_t i = 0; i < n; ++i) {
      const PreparedDatum& d = (*prepared)[i];
      const at::Tensor& lp = d.lp;
      const at::Tensor* q = d.Get("logprobs");
      const at::Tensor* adv = d.Get("advantages");
      at::Tensor term;
      switch (def.kind) {
        case Kind::kCe:
        case Kind::kTwinkleCe:
          term = -lp;
          break;
        case Kind::kIs:
          term = -(at::exp(lp - *q) * *adv);
          break;
        case Kind::kPpo:
        case Kind::kCispo: {
          const at::Tensor ratio = at::exp(lp - *q);
          const at::Tensor clipped = at::clamp(ratio, d.clip_low, d.clip_high);
          if (def.kind == Kind::kPpo) {
            term = -at::minimum(ratio * *adv, clipped * *adv);
          } else {
            // CISPO: the clipped ratio is a constant weight on the REINFORCE term.
            term = -(clipped.detach() * lp * *adv);
          }
          break;
        }
        case Kind::kDro:
          term = -(lp * *adv - 0.5 * get("beta") * at::square(lp - *q));
          break;
        case Kind::kTwinkleGrpo: {
          // Missing old log-probs: on-policy, ratio 1 whose gradient is still d exp(lp - lp').
          const at::Tensor old = q ? *q : lp.detach();
          const at::Tensor ratio = at::exp(at::clamp(lp - old, -20.0, 20.0));
          const double eps = get("epsilon");
          const double eps_high = spec.config.count("epsilon_high") ? get("epsilon_high") : eps;
          const at::Tensor clipped = at::clamp(ratio, 1.0 - eps, 1.0 + eps_high);
          term = -at::minimum(ratio * *adv, clipped * *adv);
          const double beta = get("beta");
          if (const at::Tensor* ref = d.Get("ref_logprobs"); ref != nullptr && beta > 0) {
            const at::Tensor diff = *ref - lp;  // k3 estimator of KL(pi || ref)
            term = term + beta * (at::exp(diff) - diff - 1.0);
          }
          break;
        }
      }
      at::Tensor mask;
      if (const at::Tensor* w = d.Get("weights")) mask = *w;
      if (const at::Tensor* m = d.Get("mask")) mask = mask.defined() ? mask * *m : *m;
      if (mask.defined()) term = term * mask;
      terms[i] = term;
      masks[i] = mask;
    }

    // Tokens that count: nonzero weight (all tokens of a datum without weights or mask).
    // Counted on the device and read back once, for the same reason as ValueChecks.
    std::vector<int64_t> tokens(n);
    std::vector<at::Tensor> counts;
    for (size_t i = 0; i < n; ++i) {
      tokens[i] = terms[i].size(0);
      if (masks[i].defined()) counts.push_back((masks[i] != 0).sum());
    }
    if (!counts.empty()) {
      const at::Tensor counted = at::stack(counts).cpu();
      const int64_t* values = counted.data_ptr<int64_t>();
      for (size_t i = 0, c = 0; i < n; ++i) {
        if (masks[i].defined()) tokens[i] = values[c++];
      }
    }
    int64_t total_tokens = 0;
    for (int64_t t : tokens) total_tokens += t;

    std::string loss_metric = "loss:sum";
    if (def.kind == Kind::kTwinkleCe) {
      auto it = spec.string_config.find("reduction");
      if (it == spec.string_config.end() || it->second == "mean") {
        loss_metric = "loss:mean";
        if (context.window_tokens > 0 && context.window_tokens < total_tokens) {
          return Bad(def, absl::StrCat("window_tokens ", context.window_tokens,
                                       " is smaller than this call's ", total_tokens, " tokens"));
        }
        const int64_t denom =
            context.window_tokens > 0 ? context.window_tokens : std::max<int64_t>(total_tokens, 1);
        for (at::Tensor& term : terms) term = term / static_cast<double>(denom);
      }
    } else if (def.kind == Kind::kTwinkleGrpo) {
      loss_metric = "loss:mean";
      const int64_t seqs = static_cast<int64_t>(n);
      if (context.window_sequences > 0 && context.window_sequences < seqs) {
        return Bad(def, absl::StrCat("window_sequences ", context.window_sequences,
                                     " is smaller than this call's ", seqs, " sequences"));
      }
      const double num_seqs =
          static_cast<double>(context.window_sequences > 0 ? context.window_sequences : seqs);
      for (size_t i = 0; i < n; ++i) {
        terms[i] = terms[i] / (static_cast<double>(std::max<int64_t>(tokens[i], 1)) * num_seqs);
      }
    }

    LossResult result;
    result.total = at::zeros({}, terms[0].options());
    for (const at::Tensor& term : terms) {
      result.total = result.total + term.sum();
      result.elementwise.push_back(term.detach());
    }
    result.metrics[loss_metric] = result.total.item<double>();
    result.metrics["num_tokens:sum"] = static_cast<double>(total_tokens);
    result.metrics["num_sequences:sum"] = static_cast<double>(n);
    return result;
  } catch (const std::exception& e) {  // c10::Error included: never throw out of the engine
    return absl::InternalError(absl::StrCat("loss '", spec.name, "': ", e.what()));
  }
}

}  // namespace twinkle::engine
