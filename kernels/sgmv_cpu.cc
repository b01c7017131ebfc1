// CPU backend of the segmented primitives (one BLAS call per segment) and the dispatch.

#include "kernels/sgmv.h"

#include <ATen/ATen.h>

namespace twinkle::kernels {
namespace {

// Device and dtype every task must share: those of the first task's output.
void CheckCommon(const at::Tensor& first_out, const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.defined() && t.dim() == 2, "sgmv: ", what, " must be a defined 2-D tensor");
  TORCH_CHECK(t.device() == first_out.device(), "sgmv: ", what, " is on ", t.device(),
              " but the outputs are on ", first_out.device());
  TORCH_CHECK(t.scalar_type() == first_out.scalar_type(), "sgmv: ", what, " is ",
              t.scalar_type(), " but the outputs are ", first_out.scalar_type());
}

// The CUDA kernels address rows as base + i * row_stride + j, so the last dim must be dense.
void CheckRowMajor(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, "sgmv: ", what,
              " needs unit stride along its last dim");
}

}  // namespace

void CheckTasks(const std::vector<MatmulTask>& tasks) {
  if (tasks.empty()) return;
  const at::Tensor& first = tasks[0].out;
  TORCH_CHECK(first.defined(), "sgmv: output undefined");
  TORCH_CHECK(first.scalar_type() == at::kFloat || first.scalar_type() == at::kDouble,
              "sgmv: only float32/float64 are supported, got ", first.scalar_type());
  for (const MatmulTask& t : tasks) {
    CheckCommon(first, t.in, "matmul input");
    CheckCommon(first, t.w, "matmul weight");
    CheckCommon(first, t.out, "matmul output");
    TORCH_CHECK(t.in.size(0) == t.out.size(0) && t.in.size(1) == t.w.size(1) &&
                    t.w.size(0) == t.out.size(1),
                "sgmv: matmul shapes do not chain: in ", t.in.sizes(), ", w ", t.w.sizes(),
                ", out ", t.out.sizes());
    CheckRowMajor(t.in, "matmul input");
    CheckRowMajor(t.out, "matmul output");
  }
}

void CheckTasks(const std::vector<OuterTask>& tasks) {
  if (tasks.empty()) return;
  const at::Tensor& first = tasks[0].out;
  TORCH_CHECK(first.defined(), "sgmv: output undefined");
  TORCH_CHECK(first.scalar_type() == at::kFloat || first.scalar_type() == at::kDouble,
              "sgmv: only float32/float64 are supported, got ", first.scalar_type());
  for (const OuterTask& t : tasks) {
    CheckCommon(first, t.l, "outer left");
    CheckCommon(first, t.r, "outer right");
    CheckCommon(first, t.out, "outer output");
    TORCH_CHECK(t.l.size(0) == t.r.size(0) && t.out.size(0) == t.l.size(1) &&
                    t.out.size(1) == t.r.size(1),
                "sgmv: outer shapes do not chain: l ", t.l.sizes(), ", r ", t.r.sizes(), ", out ",
                t.out.sizes());
    CheckRowMajor(t.l, "outer left");
    CheckRowMajor(t.r, "outer right");
    TORCH_CHECK(t.out.is_contiguous(), "sgmv: outer output must be contiguous");
  }
}

void SegmentedMatmulCpu(const std::vector<MatmulTask>& tasks) {
  CheckTasks(tasks);
  for (const MatmulTask& t : tasks) {
    at::Tensor out = t.out;  // a handle to the same view: mm_out wants a mutable reference
    at::mm_out(out, t.in, t.w.t());
    if (t.alpha != 1.0) out.mul_(t.alpha);
  }
}

void SegmentedOuterCpu(const std::vector<OuterTask>& tasks) {
  CheckTasks(tasks);
  for (const OuterTask& t : tasks) {
    // An empty segment (n = 0) gives a zero gradient: mm over an empty inner dim is zeros.
    at::Tensor out = t.out;
    at::mm_out(out, t.l.t(), t.r);
    if (t.alpha != 1.0) out.mul_(t.alpha);
  }
}

void SegmentedMatmul(const std::vector<MatmulTask>& tasks) {
  if (tasks.empty()) return;
  if (tasks[0].out.is_cuda()) {
#ifdef TWINKLE_WITH_CUDA
    SegmentedMatmulCuda(tasks);
    return;
#else
    TORCH_CHECK(false, "sgmv: CUDA tensors, but twinkle_kernels was built without CUDA");
#endif
  }
  SegmentedMatmulCpu(tasks);
}

void SegmentedOuter(const std::vector<OuterTask>& tasks) {
  if (tasks.empty()) return;
  if (tasks[0].out.is_cuda()) {
#ifdef TWINKLE_WITH_CUDA
    SegmentedOuterCuda(tasks);
    return;
#else
    TORCH_CHECK(false, "sgmv: CUDA tensors, but twinkle_kernels was built without CUDA");
#endif
  }
  SegmentedOuterCpu(tasks);
}

}  // namespace twinkle::kernels
