// Tinker's losses (tinker-protocol.md §9, docs/losses.md): plain sums over every token of
// every datum; the caller sets the scale through its weights and advantages.
#include <ATen/ATen.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/engine/loss/loss_internal.h"

namespace twinkle::engine::loss_internal {
namespace {

// stable_reinforce: weights times stability_mask (the positions with a recorded sampler
// log-prob); either may be absent.
at::Tensor StableReinforceMask(const PreparedDatum& d) {
  at::Tensor mask = d.Mask();
  if (const at::Tensor* s = d.Get("stability_mask")) mask = mask.defined() ? mask * *s : *s;
  return mask;
}

}  // namespace

absl::StatusOr<LossResult> TinkerLoss(const LossDef& def, const LossSpec& spec,
                                      const Prepared& datums) {
  const size_t n = datums.size();
  std::vector<at::Tensor> terms(n), masks(n);
  std::vector<int64_t> lengths(n);
  // stable_reinforce diagnostics, per datum (masked, unnormalised): k3 estimate of
  // KL(p_theta || q) and the count of truncated importance weights.
  std::vector<at::Tensor> kl_sums, truncated_sums;
  for (size_t i = 0; i < n; ++i) {
    const PreparedDatum& d = datums[i];
    const at::Tensor& lp = d.lp;
    const at::Tensor* q = d.Get("logprobs");
    const at::Tensor* adv = d.Get("advantages");
    at::Tensor term;
    switch (def.kind) {
      case Kind::kCe:
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
        term = -(lp * *adv - 0.5 * ConfigValue(spec, def, "beta") * at::square(lp - *q));
        break;
      case Kind::kGspo: {
        // s = exp(mean over M of (sg(lp) - q)), M = sequence_ratio_mask != 0 (every token
        // without one; an empty M gives s = 1). Each token's ratio carries s's value and the
        // gradient of its own log-prob: s_t = exp(log s + lp - sg(lp)).
        const at::Tensor lp_d = lp.detach();
        at::Tensor log_ratio;
        if (const at::Tensor* srm = d.Get("sequence_ratio_mask")) {
          const at::Tensor in = (*srm != 0).to(lp.scalar_type());
          log_ratio = ((lp_d - *q) * in).sum() / in.sum().clamp_min(1.0);
        } else {
          log_ratio = lp.size(0) > 0 ? (lp_d - *q).mean() : at::zeros({}, lp.options());
        }
        const at::Tensor ratio = at::exp(log_ratio + (lp - lp_d));
        const at::Tensor clipped = at::clamp(ratio, ConfigValue(spec, def, "clip_low_threshold"),
                                             ConfigValue(spec, def, "clip_high_threshold"));
        term = -at::minimum(ratio * *adv, clipped * *adv);
        break;
      }
      case Kind::kStableReinforce: {
        // w = min(exp(lp - q), C), a constant weight on the REINFORCE term (truncated
        // importance sampling), plus kl_coeff times the k3 estimate of KL(p_theta || q):
        //   -sg(w) * A * lp + kl_coeff * (exp(q - lp) - (q - lp) - 1)
        const double cap = ConfigValue(spec, def, "clip_high_threshold");
        const at::Tensor lp_d = lp.detach();
        const at::Tensor ratio = at::exp(lp_d - *q);
        const at::Tensor diff = *q - lp;
        const at::Tensor k3 = at::exp(diff) - diff - 1.0;
        term = -(at::clamp_max(ratio, cap) * *adv * lp);
        const double kl = ConfigValue(spec, def, "kl_coeff");
        if (kl > 0) term = term + kl * k3;
        const at::Tensor m = StableReinforceMask(d);
        const at::Tensor counted = m.defined() ? (m != 0).to(lp.scalar_type()) : at::ones_like(lp_d);
        kl_sums.push_back((k3.detach() * counted).sum());
        truncated_sums.push_back(((ratio > cap).to(lp.scalar_type()) * counted).sum());
        break;
      }
      default:
        return absl::InternalError(absl::StrCat("loss '", def.name, "' is not a Tinker loss"));
    }
    // Tinker weights are real-valued and multiply each token's term.
    masks[i] = def.kind == Kind::kStableReinforce ? StableReinforceMask(d) : d.Mask();
    terms[i] = masks[i].defined() ? term * masks[i] : term;
    lengths[i] = lp.size(0);
    // Soft targets [T, K]: a position counts when any of its K weights is nonzero.
    if (masks[i].defined() && masks[i].dim() == 2) masks[i] = masks[i].abs().sum(1);
  }
  // Tokens that count: nonzero weight (all tokens of a datum without weights).
  int64_t total_tokens = 0;
  for (int64_t t : CountTokens(masks, lengths)) total_tokens += t;
  LossResult result = SumTerms(terms, "loss:sum", total_tokens);
  if (def.kind == Kind::kStableReinforce) {
    const double count = static_cast<double>(std::max<int64_t>(total_tokens, 1));
    result.metrics["kl_sampler:mean"] = at::stack(kl_sums).sum().item<double>() / count;
    result.metrics["truncated_fraction:mean"] = at::stack(truncated_sums).sum().item<double>() / count;
  }
  return result;
}

}  // namespace twinkle::engine::loss_internal
