// Twinkle's DPO (twinkle-api.md §6). The datums of one op come interleaved
// [chosen_0, rejected_0, chosen_1, rejected_1, ...]. Per sequence π = Σ mask·lp (policy) and
// ρ = Σ mask·ref_logprobs (reference, per-token inputs summed the same way; unused when
// reference_free). Per pair, with Δ = π − ρ (Δ = π when reference_free),
// z = β·(Δ_chosen − Δ_rejected) and
//   sigmoid    −log σ(z); with label smoothing ε: (1 − ε)·(−log σ(z)) + ε·(−log σ(−z))
//   hinge      relu(1 − z)
//   ipo        (z − 1/(2β))²
//   kto_pair   1 − σ(β·Δ_chosen) + σ(β·Δ_rejected)
// loss = mean over pairs + sft_weight · CE(chosen), CE = Σ mask·(−lp) over the chosen sequences
// / their masked tokens.
//
// Accumulation window: when window_sequences is given, the pair mean divides by
// window_sequences / 2 instead of this call's pairs, and the SFT term (a mean over this call's
// chosen tokens) is scaled by this call's share of the window's pairs, so that a window's
// micro-batches add up to one batch's loss as in Twinkle, which scales each micro-batch's
// loss by its share of the batch. window_tokens is not used.
#include <ATen/ATen.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/engine/loss/loss_internal.h"

namespace twinkle::engine::loss_internal {

absl::StatusOr<LossResult> TwinklePreferenceLoss(const LossDef& def, const LossSpec& spec,
                                                 const Prepared& datums,
                                                 const LossContext& context) {
  const size_t n = datums.size();
  if (n % 2 != 0) {
    return Bad(def, absl::StrCat("needs an even number of datums (chosen, rejected), got ", n));
  }
  auto get = [&](const std::string& key) { return ConfigValue(spec, def, key); };
  const bool reference_free = get("reference_free") != 0;
  const double beta = get("beta");
  const double smoothing = get("label_smoothing");
  const double sft_weight = get("sft_weight");
  const std::string type = StringConfigValue(spec, def, "loss_type");
  if (context.window_sequences % 2 != 0) {
    return Bad(
        def, absl::StrCat("window_sequences must be even (pairs), got ", context.window_sequences));
  }
  absl::StatusOr<int64_t> window_seqs =
      WindowCount(def, "sequences", context.window_sequences, static_cast<int64_t>(n));
  if (!window_seqs.ok()) return window_seqs.status();
  const int64_t pairs = static_cast<int64_t>(n / 2);
  const double window_pairs = static_cast<double>(*window_seqs / 2);

  std::vector<at::Tensor> masks(n), seq_lp(n), seq_ref;
  std::vector<int64_t> lengths(n);
  for (size_t i = 0; i < n; ++i) {
    const PreparedDatum& d = datums[i];
    const at::Tensor* ref = d.Get("ref_logprobs");
    if (!reference_free && ref == nullptr) {
      return Bad(def, absl::StrCat("datum ", i,
                                   ": missing input 'ref_logprobs' (required unless "
                                   "reference_free)"));
    }
    masks[i] = d.Mask();
    lengths[i] = d.lp.size(0);
    seq_lp[i] = (masks[i].defined() ? d.lp * masks[i] : d.lp).sum();
    if (!reference_free) seq_ref.push_back((masks[i].defined() ? *ref * masks[i] : *ref).sum());
  }
  const std::vector<int64_t> tokens = CountTokens(masks, lengths);

  const at::Tensor pi = at::stack(seq_lp);
  at::Tensor delta_chosen = pi.slice(0, 0, n, 2), delta_rejected = pi.slice(0, 1, n, 2);
  if (!reference_free) {
    const at::Tensor rho = at::stack(seq_ref);
    delta_chosen = delta_chosen - rho.slice(0, 0, n, 2);
    delta_rejected = delta_rejected - rho.slice(0, 1, n, 2);
  }
  const at::Tensor z = beta * (delta_chosen - delta_rejected);
  at::Tensor losses;  // [pairs]
  if (type == "sigmoid") {
    losses = -at::log_sigmoid(z);
    if (smoothing > 0) losses = (1 - smoothing) * losses + smoothing * -at::log_sigmoid(-z);
  } else if (type == "hinge") {
    losses = at::relu(1 - z);
  } else if (type == "ipo") {
    losses = at::square(z - 1 / (2 * beta));
  } else if (type == "kto_pair") {
    losses = 1 - at::sigmoid(beta * delta_chosen) + at::sigmoid(beta * delta_rejected);
  } else {
    return absl::InternalError(absl::StrCat("loss '", def.name, "': loss_type '", type, "'"));
  }
  at::Tensor total = losses.sum() / window_pairs;

  // SFT on the chosen sequences: each chosen token's share of total, graph-connected.
  std::vector<at::Tensor> sft_terms(n);
  at::Tensor sft_mean;  // metric: the unweighted CE of this call's chosen tokens
  if (sft_weight > 0) {
    int64_t chosen_tokens = 0;
    for (size_t i = 0; i < n; i += 2) chosen_tokens += tokens[i];
    const double denom = static_cast<double>(std::max<int64_t>(chosen_tokens, 1));
    const double scale = sft_weight * static_cast<double>(pairs) / window_pairs / denom;
    sft_mean = at::zeros({}, pi.options());
    for (size_t i = 0; i < n; i += 2) {
      const at::Tensor nll = masks[i].defined() ? -datums[i].lp * masks[i] : -datums[i].lp;
      sft_terms[i] = nll * scale;
      total = total + sft_terms[i].sum();
      sft_mean = sft_mean + nll.detach().sum() / denom;
    }
  }

  // Elementwise: a pair's loss is a function of whole sequences, not of single tokens. Its
  // share of total (loss / pairs) is spread evenly over the pair's counted tokens (chosen and
  // rejected alike; over all of the pair's tokens if none is counted), so that the elements
  // of all datums sum to total; the SFT term adds its own per-token share on chosen tokens.
  // A pair with no tokens at all has nowhere to put its share.
  const at::Tensor shares = losses.detach() / window_pairs;
  LossResult result;
  for (size_t i = 0; i < n; ++i) {
    const size_t c = i - i % 2;  // the pair's chosen datum
    const int64_t counted = tokens[c] + tokens[c + 1];
    const int64_t length = lengths[c] + lengths[c + 1];
    const at::Tensor share = shares.select(0, static_cast<int64_t>(i / 2));
    const at::Tensor lp = datums[i].lp.detach();
    at::Tensor e = at::zeros_like(lp);
    if (counted > 0) {
      const at::Tensor on = masks[i].defined() ? masks[i] : at::ones_like(lp);  // 0/1
      e = on * (share / static_cast<double>(counted));
    } else if (length > 0) {
      e = e + share / static_cast<double>(length);
    }
    if (sft_terms[i].defined()) e = e + sft_terms[i].detach();
    result.elementwise.push_back(e);
  }
  result.total = total;

  // Every metric with one device synchronisation.
  std::vector<at::Tensor> values = {total.detach(), z.detach().mean(),
                                    (z.detach() > 0).to(z.scalar_type()).mean()};
  if (sft_mean.defined()) values.push_back(sft_mean);
  const at::Tensor read = at::stack(values).to(at::kDouble).cpu();
  const double* v = read.data_ptr<double>();
  result.metrics["loss:mean"] = v[0];
  result.metrics["reward_margin:mean"] = v[1];    // z = chosen reward − rejected reward
  result.metrics["reward_accuracy:mean"] = v[2];  // pairs with z > 0
  if (sft_mean.defined()) result.metrics["sft_loss:mean"] = v[3];
  int64_t total_tokens = 0;
  for (int64_t t : tokens) total_tokens += t;
  result.metrics["num_tokens:sum"] = static_cast<double>(total_tokens);
  result.metrics["num_sequences:sum"] = static_cast<double>(n);
  return result;
}

}  // namespace twinkle::engine::loss_internal
