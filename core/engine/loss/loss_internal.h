#pragma once
// Shared by the loss implementation files, not part of the loss API (see loss.h):
//   loss.cc                        registry, spec/input validation, dispatch
//   tinker_losses.cc               Tinker's plain-sum losses (tinker-protocol.md §9, docs/losses.md)
//   twinkle_token_losses.cc        Twinkle's per-token losses: cross_entropy and the GRPO
//                                  family (grpo, gspo, cispo, bnpo, dr_grpo)
//   twinkle_preference_losses.cc   Twinkle's sequence-level preference loss (dpo)

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/engine/loss/loss.h"

namespace twinkle::engine::loss_internal {

enum class Kind {
  // Tinker
  kCe,
  kIs,
  kPpo,
  kCispo,
  kDro,
  kGspo,             // Tinker's GSPO-token: one clipped sequence ratio, per-token gradients
  kStableReinforce,  // REINFORCE with a truncated importance weight against recorded samples
  // Twinkle, per token
  kTwinkleCe,
  kTwinkleGrpo,
  kTwinkleGspo,
  kTwinkleCispo,
  kTwinkleBnpo,
  kTwinkleDrGrpo,
  // Twinkle, per sequence pair
  kTwinkleDpo,
};

enum class Family { kTinker, kTwinkleToken, kTwinklePreference };

Family FamilyOf(Kind kind);

// GRPO and its variants share the per-token objective and its config keys.
bool IsGrpoFamily(Kind kind);

struct LossDef {
  const char* name;
  Kind kind;
  std::vector<std::pair<std::string, double>> numeric;       // accepted numeric keys, defaults
  std::vector<std::pair<std::string, std::string>> strings;  // accepted string keys, defaults
  std::vector<std::string> required;                         // required inputs
  std::vector<std::string> optional;                         // optional inputs
};

// The spec's value for a numeric key, else the registry default (0 for unknown keys).
double ConfigValue(const LossSpec& spec, const LossDef& def, const std::string& key);
// Same for string keys ("" for unknown keys).
std::string StringConfigValue(const LossSpec& spec, const LossDef& def, const std::string& key);

// InvalidArgument "loss '<name>': <what>".
absl::Status Bad(const LossDef& def, absl::string_view what);

// One datum of a call, cast to the compute dtype and checked.
struct PreparedDatum {
  at::Tensor lp;
  std::map<std::string, at::Tensor> in;
  at::Tensor clip_low, clip_high;  // Tinker ppo/cispo: per token, config where not overridden
  const at::Tensor* Get(const std::string& name) const {
    auto it = in.find(name);
    return it == in.end() ? nullptr : &it->second;
  }
  // weights * mask (either may be absent); undefined when the datum has neither.
  at::Tensor Mask() const;
};

// Per datum: how many tokens count (nonzero mask; every token of a datum without a mask).
// Counted on the device and read back with one synchronisation.
std::vector<int64_t> CountTokens(const std::vector<at::Tensor>& masks,
                                 const std::vector<int64_t>& lengths);

// The normaliser a Twinkle mean uses: the accumulation window's count when the caller gave
// one (it must cover this call), else this call's count.
absl::StatusOr<int64_t> WindowCount(const LossDef& def, absl::string_view what, int64_t window,
                                    int64_t in_call);

// Total = sum of the per-token terms; elementwise = the detached terms; the loss metric plus
// num_tokens:sum and num_sequences:sum.
LossResult SumTerms(const std::vector<at::Tensor>& terms, const std::string& loss_metric,
                    int64_t total_tokens);

using Prepared = std::vector<PreparedDatum>;

absl::StatusOr<LossResult> TinkerLoss(const LossDef& def, const LossSpec& spec,
                                      const Prepared& datums);
absl::StatusOr<LossResult> TwinkleTokenLoss(const LossDef& def, const LossSpec& spec,
                                            const Prepared& datums, const LossContext& context);
absl::StatusOr<LossResult> TwinklePreferenceLoss(const LossDef& def, const LossSpec& spec,
                                                 const Prepared& datums,
                                                 const LossContext& context);

}  // namespace twinkle::engine::loss_internal
