// Tinker's losses (tinker-protocol.md §9): plain sums over every token of every datum; the
// caller sets the scale through its weights and advantages.
#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "core/engine/loss/loss_internal.h"

namespace twinkle::engine::loss_internal {

absl::StatusOr<LossResult> TinkerLoss(const LossDef& def, const LossSpec& spec,
                                      const Prepared& datums) {
  const size_t n = datums.size();
  std::vector<at::Tensor> terms(n), masks(n);
  std::vector<int64_t> lengths(n);
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
      default:
        return absl::InternalError(absl::StrCat("loss '", def.name, "' is not a Tinker loss"));
    }
    // Tinker weights are real-valued and multiply each token's term.
    masks[i] = d.Mask();
    terms[i] = masks[i].defined() ? term * masks[i] : term;
    lengths[i] = lp.size(0);
  }
  // Tokens that count: nonzero weight (all tokens of a datum without weights).
  int64_t total_tokens = 0;
  for (int64_t t : CountTokens(masks, lengths)) total_tokens += t;
  return SumTerms(terms, "loss:sum", total_tokens);
}

}  // namespace twinkle::engine::loss_internal
