#pragma once
// Multi-LoRA ops over a packed batch whose rows belong to different adapters (SGMV style):
// rows are grouped in contiguous segments, each with its own (A, B, scale); rows outside any
// segment get no LoRA term. For segment s:
//   delta[rows_s] = scale_s * (x[rows_s] · A_sᵀ) · B_sᵀ      (shrink to rank r, then expand)
// Forward and backward are written out by hand as SGMV shrink/expand steps (kernels/sgmv.h)
// inside one autograd node: on CPU each step is one call per segment on raw memory (BLAS,
// or plain vectorised loops for small segments, where BLAS's fixed cost dominates), on CUDA
// (TWINKLE_WITH_CUDA) one kernel launch over all segments; kernels/tests holds the two
// backends against each other and against a plain ATen composition. On CPU the node adds
// the weights' gradients into their .grad() itself (what autograd's AccumulateGrad would do)
// instead of returning them, which saves autograd two nodes per segment and linear.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace twinkle::kernels {

struct LoraSegment {
  int64_t row_begin = 0;
  int64_t row_end = 0;  // exclusive
  at::Tensor a;         // [r, in]  (fp32 master weight, may require grad)
  at::Tensor b;         // [out, r]
  double scale = 1.0;   // lora_alpha / r (or / sqrt(r) with rsLoRA)
  at::Tensor x;         // optional: the segment's input after LoRA dropout; undefined = x rows
};

// Returns delta [N, out] in x's dtype (rows without a segment are zero). Segments must be
// sorted, non-overlapping and inside [0, N); ranks may differ. The arithmetic runs in the
// weights' dtype (float32 or float64; every segment's A and B must share it). Runs on x's
// device; differentiable once w.r.t. x, every segment's x, A and B.
at::Tensor LoraDelta(const at::Tensor& x, int64_t out_features,
                     const std::vector<LoraSegment>& segments);

}  // namespace twinkle::kernels
