#include "core/training/lr_scheduler.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace twinkle::training {
namespace {

constexpr double kPi = 3.14159265358979323846;  // == Python's math.pi
constexpr double kInf = std::numeric_limits<double>::infinity();

struct KeySpec {
  const char* name;
  bool required;
  double default_value;  // when not required
  bool integer;          // a step count: must be a whole number
  double min;
  bool min_inclusive;
  double max;  // inclusive
};

struct KindSpec {
  const char* name;
  const char* alias;  // Twinkle's / torch's class name
  LrScheduler::Kind kind;
  std::vector<KeySpec> keys;
};

// Keys read {name, required, default, integer, min, min_inclusive, max}; ranges are torch's
// (LinearLR rejects start_factor outside (0, 1] and end_factor outside [0, 1]).
const std::vector<KindSpec>& Kinds() {
  static const auto* kinds = new std::vector<KindSpec>{
      {"constant", "constant", LrScheduler::Kind::kConstant, {}},
      {"linear",
       "LinearLR",
       LrScheduler::Kind::kLinear,
       {{"start_factor", false, 1.0 / 3, false, 0, false, 1},
        {"end_factor", false, 1.0, false, 0, true, 1},
        {"total_iters", false, 5, true, 1, true, kInf}}},
      {"cosine",
       "CosineAnnealingLR",
       LrScheduler::Kind::kCosine,
       {{"T_max", true, 0, true, 1, true, kInf}, {"eta_min", false, 0, false, 0, true, kInf}}},
      {"cosine_warmup",
       "CosineWarmupScheduler",
       LrScheduler::Kind::kCosineWarmup,
       {{"num_warmup_steps", true, 0, true, 0, true, kInf},
        {"num_training_steps", true, 0, true, 0, true, kInf},
        {"num_cycles", false, 0.5, false, 0, true, kInf}}},
      {"linear_warmup",
       "LinearWarmupScheduler",
       LrScheduler::Kind::kLinearWarmup,
       {{"num_warmup_steps", true, 0, true, 0, true, kInf},
        {"num_training_steps", true, 0, true, 0, true, kInf}}},
  };
  return *kinds;
}

std::string Lower(absl::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string KeyNames(const KindSpec& kind) {
  if (kind.keys.empty()) return "none";
  std::vector<std::string> names;
  for (const KeySpec& key : kind.keys) names.push_back(key.name);
  return absl::StrJoin(names, ", ");
}

absl::Status CheckValue(const KindSpec& kind, const KeySpec& key, double v) {
  const bool in_range = std::isfinite(v) && (key.min_inclusive ? v >= key.min : v > key.min) &&
                        v <= key.max && (!key.integer || std::floor(v) == v);
  if (in_range) return absl::OkStatus();
  std::string range = absl::StrCat(key.min_inclusive ? ">= " : "> ", key.min);
  if (std::isfinite(key.max)) absl::StrAppend(&range, " and <= ", key.max);
  return absl::InvalidArgumentError(absl::StrCat("lr scheduler ", kind.name, ": ", key.name,
                                                 " must be ", key.integer ? "a whole number " : "",
                                                 range, ", got ", v));
}

}  // namespace

absl::StatusOr<std::unique_ptr<LrScheduler>> LrScheduler::Create(const SchedulerSpec& spec) {
  const std::string name = Lower(spec.name);
  const KindSpec* kind = nullptr;
  std::vector<std::string> accepted;
  for (const KindSpec& k : Kinds()) {
    if (name == k.name || name == Lower(k.alias)) kind = &k;
    accepted.push_back(k.name == Lower(k.alias) ? std::string(k.name)
                                                : absl::StrCat(k.name, " (", k.alias, ")"));
  }
  if (kind == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown lr scheduler '", spec.name, "' (accepted: ", absl::StrJoin(accepted, ", "), ")"));
  }
  for (const auto& [key, value] : spec.config) {
    const bool known = std::any_of(kind->keys.begin(), kind->keys.end(),
                                   [&key = key](const KeySpec& k) { return key == k.name; });
    if (!known) {
      return absl::InvalidArgumentError(absl::StrCat("lr scheduler ", kind->name,
                                                     ": unknown config key '", key,
                                                     "' (accepted: ", KeyNames(*kind), ")"));
    }
  }
  std::map<std::string, double> config;
  for (const KeySpec& key : kind->keys) {
    auto it = spec.config.find(key.name);
    if (it == spec.config.end() && key.required) {
      return absl::InvalidArgumentError(absl::StrCat("lr scheduler ", kind->name, ": ", key.name,
                                                     " is required (keys: ", KeyNames(*kind), ")"));
    }
    const double value = it == spec.config.end() ? key.default_value : it->second;
    if (absl::Status s = CheckValue(*kind, key, value); !s.ok()) return s;
    config[key.name] = value;
  }
  return std::unique_ptr<LrScheduler>(new LrScheduler(kind->kind, std::move(config)));
}

double LrScheduler::LearningRate(double base_lr, int64_t step) const {
  const double e = static_cast<double>(std::max<int64_t>(step, 0));
  switch (kind_) {
    case Kind::kConstant:
      return base_lr;
    case Kind::kLinear: {
      // torch LinearLR._get_closed_form_lr.
      const double start = Get("start_factor"), end = Get("end_factor");
      const double total = Get("total_iters");
      return base_lr * (start + (end - start) * std::min(total, e) / total);
    }
    case Kind::kCosine: {
      // torch CosineAnnealingLR._get_closed_form_lr; past T_max it rises again (period
      // 2·T_max), as torch's does.
      const double eta_min = Get("eta_min");
      return eta_min + (base_lr - eta_min) * (1 + std::cos(kPi * e / Get("T_max"))) / 2;
    }
    case Kind::kCosineWarmup:
    case Kind::kLinearWarmup: {
      // transformers' lr_lambda for LambdaLR: lr = base_lr * lambda(step).
      const double warmup = Get("num_warmup_steps"), training = Get("num_training_steps");
      if (e < warmup) return base_lr * (e / std::max(1.0, warmup));
      const double rest = std::max(1.0, training - warmup);
      if (kind_ == Kind::kLinearWarmup) {
        return base_lr * std::max(0.0, (training - e) / rest);
      }
      const double progress = (e - warmup) / rest;
      return base_lr *
             std::max(0.0, 0.5 * (1.0 + std::cos(kPi * Get("num_cycles") * 2.0 * progress)));
    }
  }
  return base_lr;
}

}  // namespace twinkle::training
