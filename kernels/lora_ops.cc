#include "kernels/lora_ops.h"

#include <ATen/ATen.h>

namespace twinkle::kernels {

at::Tensor LoraDelta(const at::Tensor& x, int64_t out_features,
                     const std::vector<LoraSegment>& segments) {
  const int64_t n = x.size(0);
  // Concatenate per-segment results with zero blocks for rows no adapter owns; each row's
  // result depends only on its own segment's weights, so fusing never mixes tenants.
  std::vector<at::Tensor> pieces;
  pieces.reserve(2 * segments.size() + 1);
  int64_t row = 0;
  auto zeros = [&](int64_t rows) {
    pieces.push_back(at::zeros({rows, out_features}, x.options()));
  };
  for (const LoraSegment& s : segments) {
    if (s.row_begin > row) zeros(s.row_begin - row);
    const at::Tensor xs = s.x.defined() ? s.x : x.narrow(0, s.row_begin, s.row_end - s.row_begin);
    // Compute in the master weights' dtype (fp32), then return to the activations' dtype.
    const at::Tensor shrunk = at::matmul(xs.to(s.a.scalar_type()), s.a.t());
    pieces.push_back((at::matmul(shrunk, s.b.t()) * s.scale).to(x.scalar_type()));
    row = s.row_end;
  }
  if (row < n) zeros(n - row);
  return at::cat(pieces, 0);
}

}  // namespace twinkle::kernels
