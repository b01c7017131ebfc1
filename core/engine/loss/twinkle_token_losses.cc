// Twinkle's per-token losses (twinkle-api.md §6): cross_entropy and the GRPO family. Masks are
// 0/1 (mask · weights). Each normaliser may span the adapter's gradient-accumulation window
// (LossContext), so that the gradients of several micro-batches add up to the gradient of one
// big batch; without a window it counts this call only.
//   cross_entropy   mean: Σ mask·(−lp) / tokens; sum: Σ mask·(−lp)
//   grpo, gspo      mean over sequences of each sequence's masked token mean
//   cispo, bnpo     Σ over all masked tokens / tokens
//   dr_grpo         Σ over all masked tokens / (sequences · max_completion_length)
#include <ATen/ATen.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/engine/loss/loss_internal.h"

namespace twinkle::engine::loss_internal {
namespace {

// GRPO family: each token's loss before masking and normalisation. With Δ = clamp(lp − old,
// −20, 20) and r = exp(Δ) (per sequence for GSPO):
//   grpo, gspo, bnpo, dr_grpo   −min(r·A, clamp(r, 1 − ε, 1 + ε_high)·A)
//   cispo                       −sg(min(r, 1 + ε))·A·lp
// plus β·(exp(ref − lp) − (ref − lp) − 1) when β > 0 and ref_logprobs are given.
at::Tensor GrpoTerm(const LossDef& def, const LossSpec& spec, const PreparedDatum& d,
                    const at::Tensor& mask) {
  const at::Tensor& lp = d.lp;
  const at::Tensor* q = d.Get("logprobs");
  // Missing old log-probs: on-policy, ratio 1 whose gradient is still d exp(lp - lp').
  const at::Tensor old = q ? *q : lp.detach();
  at::Tensor log_ratio = at::clamp(lp - old, -20.0, 20.0);
  if (def.kind == Kind::kTwinkleGspo) {
    // One importance weight per sequence: the masked mean of the clamped log-ratio (the log of
    // the geometric mean of the token ratios), shared by all of its tokens; its gradient
    // reaches every masked token of the sequence.
    const at::Tensor m = mask.defined() ? mask : at::ones_like(log_ratio);
    log_ratio = (log_ratio * m).sum() / m.sum().clamp_min(1.0);
  }
  const at::Tensor ratio = at::exp(log_ratio);
  const at::Tensor& adv = *d.Get("advantages");
  const double eps = ConfigValue(spec, def, "epsilon");
  at::Tensor term;
  if (def.kind == Kind::kTwinkleCispo) {
    // The clipped ratio is a constant weight on the REINFORCE term (no lower bound).
    term = -(at::clamp_max(ratio, 1.0 + eps).detach() * adv * lp);
  } else {
    const double eps_high =
        spec.config.count("epsilon_high") ? ConfigValue(spec, def, "epsilon_high") : eps;
    const at::Tensor clipped = at::clamp(ratio, 1.0 - eps, 1.0 + eps_high);
    term = -at::minimum(ratio * adv, clipped * adv);
  }
  const double beta = ConfigValue(spec, def, "beta");
  if (const at::Tensor* ref = d.Get("ref_logprobs"); ref != nullptr && beta > 0) {
    const at::Tensor diff = *ref - lp;  // k3 estimator of KL(pi || ref)
    term = term + beta * (at::exp(diff) - diff - 1.0);
  }
  return term;
}

}  // namespace

absl::StatusOr<LossResult> TwinkleTokenLoss(const LossDef& def, const LossSpec& spec,
                                            const Prepared& datums, const LossContext& context) {
  const size_t n = datums.size();
  std::vector<at::Tensor> terms(n), masks(n);
  std::vector<int64_t> lengths(n);
  for (size_t i = 0; i < n; ++i) {
    const PreparedDatum& d = datums[i];
    masks[i] = d.Mask();
    at::Tensor term = def.kind == Kind::kTwinkleCe ? -d.lp : GrpoTerm(def, spec, d, masks[i]);
    terms[i] = masks[i].defined() ? term * masks[i] : term;
    lengths[i] = d.lp.size(0);
  }
  const std::vector<int64_t> tokens = CountTokens(masks, lengths);
  int64_t total_tokens = 0;
  for (int64_t t : tokens) total_tokens += t;
  const int64_t seqs = static_cast<int64_t>(n);

  auto divide_all = [&](double denom) {
    for (at::Tensor& term : terms) term = term / denom;
  };
  std::string metric = "loss:mean";
  switch (def.kind) {
    case Kind::kTwinkleCe:
      if (StringConfigValue(spec, def, "reduction") == "sum") {
        metric = "loss:sum";
        break;
      }
      [[fallthrough]];
    case Kind::kTwinkleCispo:  // Twinkle: no max(, 1) here, so 0 tokens gives 0/0 = NaN there
    case Kind::kTwinkleBnpo: {
      absl::StatusOr<int64_t> denom =
          WindowCount(def, "tokens", context.window_tokens, total_tokens);
      if (!denom.ok()) return denom.status();
      divide_all(static_cast<double>(std::max<int64_t>(*denom, 1)));
      break;
    }
    case Kind::kTwinkleGrpo:
    case Kind::kTwinkleGspo: {
      absl::StatusOr<int64_t> num_seqs =
          WindowCount(def, "sequences", context.window_sequences, seqs);
      if (!num_seqs.ok()) return num_seqs.status();
      for (size_t i = 0; i < n; ++i) {
        terms[i] = terms[i] / (static_cast<double>(std::max<int64_t>(tokens[i], 1)) *
                               static_cast<double>(*num_seqs));
      }
      break;
    }
    case Kind::kTwinkleDrGrpo: {
      absl::StatusOr<int64_t> num_seqs =
          WindowCount(def, "sequences", context.window_sequences, seqs);
      if (!num_seqs.ok()) return num_seqs.status();
      divide_all(static_cast<double>(*num_seqs) * ConfigValue(spec, def, "max_completion_length"));
      break;
    }
    default:
      return absl::InternalError(
          absl::StrCat("loss '", def.name, "' is not a Twinkle per-token loss"));
  }
  return SumTerms(terms, metric, total_tokens);
}

}  // namespace twinkle::engine::loss_internal
