#pragma once
// The two segmented primitives the multi-LoRA op is built from (SGMV: segmented gather
// matrix-vector). Every LoRA step, forward and backward, is one of them applied to a list of
// per-segment tasks, so the CPU and CUDA backends only have to agree on these two:
//
//   SegmentedMatmul: out_s = alpha_s · in_s · w_sᵀ        in_s [n_s, k_s], w_s [p_s, k_s]
//     shrink  y_s      = x_s · A_sᵀ                      (w = A,   k = in,  p = r)
//     expand  delta_s  = scale_s · y_s · B_sᵀ            (w = B,   k = r,   p = out)
//     grad_y  gy_s     = scale_s · g_s · B_s             (w = B.t(): expand with roles swapped)
//     grad_x  gx_s     = gy_s · A_s                      (w = A.t(): shrink with roles swapped)
//   SegmentedOuter:  out_s = alpha_s · l_sᵀ · r_s         l_s [n_s, P_s], r_s [n_s, Q_s]
//     grad_A  = gy_sᵀ · x_s,   grad_B = scale_s · g_sᵀ · y_s   (reductions over the rows)
//
// Each call is one kernel launch on CUDA over all its tasks (a segment table), a loop of
// BLAS calls on CPU. Tasks write disjoint outputs, so their order never changes a result.

#include <ATen/core/Tensor.h>

#include <vector>

namespace twinkle::kernels {

// Row-major operands: `in` and `out` need unit stride along their last dim (any row
// stride), `w` may be any 2-D strided view, e.g. a transpose. `out` is overwritten.
struct MatmulTask {
  at::Tensor in;   // [n, k]
  at::Tensor w;    // [p, k]
  at::Tensor out;  // [n, p]
  double alpha = 1.0;
};

// `l` and `r` need unit stride along their last dim; `out` must be contiguous.
struct OuterTask {
  at::Tensor l;    // [n, P]
  at::Tensor r;    // [n, Q]
  at::Tensor out;  // [P, Q]
  double alpha = 1.0;
};

// Dispatch on the tasks' device (all tasks must share device and dtype, float or double).
void SegmentedMatmul(const std::vector<MatmulTask>& tasks);
void SegmentedOuter(const std::vector<OuterTask>& tasks);

// The backends. The CPU one is the twin every CUDA kernel is tested against.
void SegmentedMatmulCpu(const std::vector<MatmulTask>& tasks);
void SegmentedOuterCpu(const std::vector<OuterTask>& tasks);
#ifdef TWINKLE_WITH_CUDA
void SegmentedMatmulCuda(const std::vector<MatmulTask>& tasks);
void SegmentedOuterCuda(const std::vector<OuterTask>& tasks);
#endif

// The CPU backend's single steps on raw row-major memory: one BLAS call each, no ATen
// dispatch and no tensor views, so LoraDelta's CPU path costs a few BLAS calls per segment
// and nothing else per segment. T is float or double.
//   CpuMatmul: out[n, p] = alpha · in[n, k] · wᵀ, w [p, k] with strides (w_rs, w_cs), one
//              of them 1 (w may be a transpose); in/out rows ld_in/ld_out apart.
//   CpuOuter:  out[P, Q] = alpha · lᵀ · r, l [n, P], r [n, Q]; out contiguous (n = 0: zeros);
//              with `accumulate`, out += alpha · lᵀ · r instead (BLAS beta = 1).
// A segment's result depends only on its own operands (and their 64-byte alignment), never
// on the other segments, so fused and solo passes round alike.
template <typename T>
void CpuMatmul(int64_t n, int64_t p, int64_t k, double alpha, const T* in, int64_t ld_in,
               const T* w, int64_t w_rs, int64_t w_cs, T* out, int64_t ld_out);
template <typename T>
void CpuOuter(int64_t n, int64_t P, int64_t Q, double alpha, const T* l, int64_t ld_l, const T* r,
              int64_t ld_r, T* out, bool accumulate = false);

// Shape/stride/device checks shared by both backends; throw c10::Error on misuse.
void CheckTasks(const std::vector<MatmulTask>& tasks);
void CheckTasks(const std::vector<OuterTask>& tasks);

}  // namespace twinkle::kernels
