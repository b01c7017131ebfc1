// Helpers shared by the loss families: masks, token counts, window normalisers, results.
#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "core/engine/loss/loss_internal.h"

namespace twinkle::engine::loss_internal {

at::Tensor PreparedDatum::Mask() const {
  at::Tensor mask;
  if (const at::Tensor* w = Get("weights")) mask = *w;
  if (const at::Tensor* m = Get("mask")) mask = mask.defined() ? mask * *m : *m;
  return mask;
}

std::vector<int64_t> CountTokens(const std::vector<at::Tensor>& masks,
                                 const std::vector<int64_t>& lengths) {
  std::vector<int64_t> tokens = lengths;
  std::vector<at::Tensor> counts;
  for (const at::Tensor& mask : masks) {
    if (mask.defined()) counts.push_back((mask != 0).sum());
  }
  if (counts.empty()) return tokens;
  const at::Tensor counted = at::stack(counts).cpu();
  const int64_t* values = counted.data_ptr<int64_t>();
  for (size_t i = 0, c = 0; i < masks.size(); ++i) {
    if (masks[i].defined()) tokens[i] = values[c++];
  }
  return tokens;
}

absl::StatusOr<int64_t> WindowCount(const LossDef& def, absl::string_view what, int64_t window,
                                    int64_t in_call) {
  if (window == 0) return in_call;
  if (window < in_call) {
    return Bad(def, absl::StrCat("window_", what, " ", window, " is smaller than this call's ",
                                 in_call, " ", what));
  }
  return window;
}

LossResult SumTerms(const std::vector<at::Tensor>& terms, const std::string& loss_metric,
                    int64_t total_tokens) {
  LossResult result;
  result.total = at::zeros({}, terms[0].options());
  for (const at::Tensor& term : terms) {
    result.total = result.total + term.sum();
    result.elementwise.push_back(term.detach());
  }
  result.metrics[loss_metric] = result.total.item<double>();
  result.metrics["num_tokens:sum"] = static_cast<double>(total_tokens);
  result.metrics["num_sequences:sum"] = static_cast<double>(terms.size());
  return result;
}

}  // namespace twinkle::engine::loss_internal
