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

namespace {

// Nonzero entries of a 1-D host tensor, by a plain loop.
template <typename T>
int64_t CountNonzero(const at::Tensor& t) {
  const T* p = t.const_data_ptr<T>();
  int64_t count = 0;
  for (int64_t i = 0, n = t.size(0), stride = t.stride(0); i < n; ++i) count += p[i * stride] != T(0);
  return count;
}

}  // namespace

std::vector<int64_t> CountTokens(const std::vector<at::Tensor>& masks,
                                 const std::vector<int64_t>& lengths) {
  std::vector<int64_t> tokens = lengths;
  std::vector<at::Tensor> counts;
  std::vector<size_t> counted_on_device;
  for (size_t i = 0; i < masks.size(); ++i) {
    const at::Tensor& mask = masks[i];
    if (!mask.defined()) continue;
    // On the host a loop is cheaper than two ATen ops and the read-back.
    if (mask.is_cpu() && mask.dim() == 1 && mask.scalar_type() == at::kFloat) {
      tokens[i] = CountNonzero<float>(mask);
    } else if (mask.is_cpu() && mask.dim() == 1 && mask.scalar_type() == at::kDouble) {
      tokens[i] = CountNonzero<double>(mask);
    } else {
      counts.push_back((mask != 0).sum());
      counted_on_device.push_back(i);
    }
  }
  if (counts.empty()) return tokens;
  const at::Tensor counted = at::stack(counts).cpu();
  const int64_t* values = counted.data_ptr<int64_t>();
  for (size_t c = 0; c < counted_on_device.size(); ++c) tokens[counted_on_device[c]] = values[c];
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
  // 0 + s is s exactly, so starting from the first sum gives what a zero start would.
  for (const at::Tensor& term : terms) {
    result.total = result.total.defined() ? result.total + term.sum() : term.sum();
    result.elementwise.push_back(term.detach());
  }
  result.metrics[loss_metric] = result.total.item<double>();
  result.metrics["num_tokens:sum"] = static_cast<double>(total_tokens);
  result.metrics["num_sequences:sum"] = static_cast<double>(terms.size());
  return result;
}

}  // namespace twinkle::engine::loss_internal
