// CPU backend of the segmented primitives (one BLAS call, or one small loop nest, per segment)
// and the dispatch.

#include "kernels/sgmv.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <type_traits>
#include <vector>

// The Fortran BLAS that LibTorch itself calls for float/double matmuls on CPU (MKL in the
// x86 wheels, which export it). Weak: a LibTorch without it falls back to ATen's mm below.
extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
            const float* beta, float* c, const int* ldc) __attribute__((weak));
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const double* alpha, const double* a, const int* lda, const double* b,
            const int* ldb, const double* beta, double* c, const int* ldc) __attribute__((weak));
}

namespace twinkle::kernels {
namespace {

// Column-major C[m, n] = alpha · op(A) · op(B) + beta · C through BLAS; false when BLAS is
// missing or a size does not fit its int arguments (the caller then uses ATen).
template <typename T>
bool Blas(char ta, char tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
          const T* b, int64_t ldb, T* c, int64_t ldc, T beta = 0) {
  auto* fn = [] {
    if constexpr (std::is_same_v<T, float>) return sgemm_;
    else return dgemm_;
  }();
  if (fn == nullptr) return false;
  for (int64_t v : {m, n, k, lda, ldb, ldc}) {
    if (v > INT_MAX) return false;
  }
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  const int ldai = static_cast<int>(lda), ldbi = static_cast<int>(ldb), ldci = static_cast<int>(ldc);
  fn(&ta, &tb, &mi, &ni, &ki, &alpha, a, &ldai, b, &ldbi, &beta, c, &ldci);
  return true;
}

// Small problems (a LoRA segment of a few dozen rows at rank 8 is ~10^4 multiply-adds) are
// dominated by BLAS's fixed cost per call (argument checks, threading, packing: 3-10 µs),
// so below kSmallWork multiply-adds they run as plain loops instead. Every output element
// is then a sum in a fixed order (over k, first to last, then scaled by alpha), computed
// without fused multiply-adds in every clone below, so the result does not depend on the
// machine's vector width, and never on other segments.
constexpr int64_t kSmallWork = int64_t{1} << 16;

// An AVX2 clone next to the baseline one, picked at load time (x86-64 with GCC/Clang). AVX2
// brings no FMA, and the file is built with -ffp-contract=off, so both round alike.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TWINKLE_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define TWINKLE_CLONES
#endif

// The loops: out[i, j] = alpha · Σ_kk in(i, kk) · m[kk, j] (+ out[i, j] when accumulating),
// with in(i, kk) = in[i · in_rs + kk · in_cs] and m row-major [k, p] (row stride ldm). A
// tile of R rows × NV vectors of columns keeps its sums in registers while kk runs (GCC
// vector types: 32 bytes, two SSE registers in the baseline clone, one AVX register in the
// AVX2 one); a remainder of fewer columns than a vector runs one column at a time. Each sum
// only ever adds its own products in kk order: nothing is reassociated.
template <typename T, int R, int NV>
inline __attribute__((always_inline)) void SmallTile(int64_t i, int64_t j, int64_t k, T alpha,
                                                     const T* __restrict in, int64_t in_rs,
                                                     int64_t in_cs, const T* __restrict m,
                                                     int64_t ldm, T* __restrict out,
                                                     int64_t ld_out, bool accumulate) {
  typedef T V __attribute__((vector_size(32)));
  // Unaligned access to a vector's worth of T: plain loads/stores, no staging on the stack.
  typedef T VU __attribute__((vector_size(32), aligned(alignof(T)), may_alias));
  constexpr int kLanes = 32 / static_cast<int>(sizeof(T));
  V acc[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) acc[r][v] = V{};
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    V row[NV];
    for (int v = 0; v < NV; ++v) row[v] = *reinterpret_cast<const VU*>(m + kk * ldm + j + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const T a = in[(i + r) * in_rs + kk * in_cs];
      for (int v = 0; v < NV; ++v) acc[r][v] += a * row[v];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) {
      VU* o = reinterpret_cast<VU*>(out + (i + r) * ld_out + j + v * kLanes);
      const V value = alpha == T(1) ? acc[r][v] : alpha * acc[r][v];
      *o = accumulate ? *o + value : value;
    }
  }
}

// One column j of R rows.
template <typename T, int R>
inline __attribute__((always_inline)) void SmallColumn(int64_t i, int64_t j, int64_t k, T alpha,
                                                       const T* __restrict in, int64_t in_rs,
                                                       int64_t in_cs, const T* __restrict m,
                                                       int64_t ldm, T* __restrict out,
                                                       int64_t ld_out, bool accumulate) {
  T acc[R] = {};
  for (int64_t kk = 0; kk < k; ++kk) {
    const T b = m[kk * ldm + j];
    for (int r = 0; r < R; ++r) acc[r] += in[(i + r) * in_rs + kk * in_cs] * b;
  }
  for (int r = 0; r < R; ++r) {
    T* o = out + (i + r) * ld_out + j;
    const T value = alpha == T(1) ? acc[r] : alpha * acc[r];
    *o = accumulate ? *o + value : value;
  }
}

template <typename T, int R>
inline __attribute__((always_inline)) void SmallRows(int64_t i, int64_t p, int64_t k, T alpha,
                                                     const T* in, int64_t in_rs, int64_t in_cs,
                                                     const T* m, int64_t ldm, T* out,
                                                     int64_t ld_out, bool accumulate) {
  constexpr int kLanes = 32 / static_cast<int>(sizeof(T));
  int64_t j = 0;
  if constexpr (R == 1) {
    // A single row (a generation step's segment) has few sums in flight per tile; wider
    // tiles keep more of them going. Every column still sums its own products in kk order,
    // so the results are those of the narrower tiles.
    for (; j + 4 * kLanes <= p; j += 4 * kLanes) {
      SmallTile<T, 1, 4>(i, j, k, alpha, in, in_rs, in_cs, m, ldm, out, ld_out, accumulate);
    }
  }
  for (; j + 2 * kLanes <= p; j += 2 * kLanes) {
    SmallTile<T, R, 2>(i, j, k, alpha, in, in_rs, in_cs, m, ldm, out, ld_out, accumulate);
  }
  for (; j + kLanes <= p; j += kLanes) {
    SmallTile<T, R, 1>(i, j, k, alpha, in, in_rs, in_cs, m, ldm, out, ld_out, accumulate);
  }
  for (; j < p; ++j) {
    SmallColumn<T, R>(i, j, k, alpha, in, in_rs, in_cs, m, ldm, out, ld_out, accumulate);
  }
}

#define TWINKLE_SMALL_KERNEL(T, NAME)                                                           \
  TWINKLE_CLONES void NAME(int64_t n, int64_t p, int64_t k, T alpha, const T* in, int64_t in_rs, \
                           int64_t in_cs, const T* m, int64_t ldm, T* out, int64_t ld_out,       \
                           bool accumulate) {                                                    \
    int64_t i = 0;                                                                               \
    for (; i + 4 <= n; i += 4) {                                                                 \
      SmallRows<T, 4>(i, p, k, alpha, in, in_rs, in_cs, m, ldm, out, ld_out, accumulate);        \
    }                                                                                            \
    for (; i < n; ++i) {                                                                         \
      SmallRows<T, 1>(i, p, k, alpha, in, in_rs, in_cs, m, ldm, out, ld_out, accumulate);        \
    }                                                                                            \
  }
TWINKLE_SMALL_KERNEL(float, SmallKernelF)
TWINKLE_SMALL_KERNEL(double, SmallKernelD)
#undef TWINKLE_SMALL_KERNEL

template <typename T>
void SmallKernel(int64_t n, int64_t p, int64_t k, T alpha, const T* in, int64_t in_rs,
                 int64_t in_cs, const T* m, int64_t ldm, T* out, int64_t ld_out, bool accumulate) {
  if constexpr (std::is_same_v<T, float>) {
    SmallKernelF(n, p, k, alpha, in, in_rs, in_cs, m, ldm, out, ld_out, accumulate);
  } else {
    SmallKernelD(n, p, k, alpha, in, in_rs, in_cs, m, ldm, out, ld_out, accumulate);
  }
}

template <typename T>
constexpr at::ScalarType kScalar = std::is_same_v<T, float> ? at::kFloat : at::kDouble;

// A [rows, cols] view of raw memory with the given strides, for the ATen fallback.
template <typename T>
at::Tensor View(const T* data, int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
  return at::from_blob(const_cast<T*>(data), {rows, cols}, {rs, cs},
                       at::TensorOptions().dtype(kScalar<T>));
}

// The task API's tensors as raw operands.
template <typename T>
void MatmulTaskCpu(const MatmulTask& t) {
  at::Tensor w = t.w;
  if (w.size(0) > 1 && w.size(1) > 1 && w.stride(0) != 1 && w.stride(1) != 1) w = w.contiguous();
  CpuMatmul<T>(t.in.size(0), t.w.size(0), t.w.size(1), t.alpha, t.in.const_data_ptr<T>(),
               t.in.stride(0), w.const_data_ptr<T>(), w.stride(0), w.stride(1),
               t.out.mutable_data_ptr<T>(), t.out.stride(0));
}

template <typename T>
void OuterTaskCpu(const OuterTask& t) {
  CpuOuter<T>(t.l.size(0), t.l.size(1), t.r.size(1), t.alpha, t.l.const_data_ptr<T>(),
              t.l.stride(0), t.r.const_data_ptr<T>(), t.r.stride(0), t.out.mutable_data_ptr<T>());
}

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

template <typename T>
void CpuMatmul(int64_t n, int64_t p, int64_t k, double alpha, const T* in, int64_t ld_in,
               const T* w, int64_t w_rs, int64_t w_cs, T* out, int64_t ld_out) {
  if (n == 0 || p == 0) return;
  if (k == 0) {  // an empty inner dimension: zeros
    for (int64_t i = 0; i < n; ++i) std::memset(out + i * ld_out, 0, sizeof(T) * p);
    return;
  }
  // Row-major out[n, p] is column-major outᵀ [p, n] = op(w) · inᵀ, and row-major in [n, k]
  // is column-major inᵀ [k, n] as it lies. w row-major [p, k] (w_cs = 1) is column-major
  // [k, p]: transpose it; w with w_rs = 1 (a transposed [k, p]) is column-major [p, k].
  // Strides of extent-1 dims never step, so normalise them; anything BLAS cannot take
  // (overlapping or broadcast rows) goes to ATen.
  if (k == 1) w_cs = 1;
  if (p == 1 && w_cs != 1) w_rs = 1;
  if (n * k * p <= kSmallWork && (n == 1 || ld_out >= p)) {
    // The loops want w as m = wᵀ [k, p] with unit stride along p: as it lies when w is a
    // transposed [k, p] (w_rs = 1), else transposed into a small scratch buffer.
    if (w_rs == 1) {
      SmallKernel<T>(n, p, k, static_cast<T>(alpha), in, ld_in, 1, w, w_cs, out, ld_out, false);
    } else {
      thread_local std::vector<T> wt;
      wt.resize(static_cast<size_t>(k * p));
      for (int64_t j = 0; j < p; ++j) {
        for (int64_t kk = 0; kk < k; ++kk) wt[kk * p + j] = w[j * w_rs + kk * w_cs];
      }
      SmallKernel<T>(n, p, k, static_cast<T>(alpha), in, ld_in, 1, wt.data(), p, out, ld_out, false);
    }
    return;
  }
  const bool w_rows = w_cs == 1 && (w_rs >= k || p == 1);
  const bool w_cols = !w_rows && w_rs == 1 && w_cs >= p;
  const bool rows_ok = n == 1 || (ld_in >= k && ld_out >= p);
  if (rows_ok && (w_rows || w_cols)) {
    const int64_t ldw = w_rows ? std::max<int64_t>(w_rs, k) : std::max<int64_t>(w_cs, p);
    if (Blas<T>(w_rows ? 'T' : 'N', 'N', p, n, k, static_cast<T>(alpha), w, ldw, in,
                std::max<int64_t>(ld_in, k), out, std::max<int64_t>(ld_out, p))) {
      return;
    }
  }
  at::Tensor o = View(out, n, p, ld_out, 1);
  at::mm_out(o, View(in, n, k, ld_in, 1), View(w, p, k, w_rs, w_cs).t());
  if (alpha != 1.0) o.mul_(alpha);
}

template <typename T>
void CpuOuter(int64_t n, int64_t P, int64_t Q, double alpha, const T* l, int64_t ld_l, const T* r,
              int64_t ld_r, T* out, bool accumulate) {
  if (P == 0 || Q == 0) return;
  if (n == 0) {  // an empty segment: a zero gradient
    if (!accumulate) std::memset(out, 0, sizeof(T) * P * Q);
    return;
  }
  if (n * P * Q <= kSmallWork) {
    // Row a of out is l[:, a]ᵀ · r: the kernel with l's column a as its input row.
    SmallKernel<T>(P, Q, n, static_cast<T>(alpha), l, 1, ld_l, r, ld_r, out, Q, accumulate);
    return;
  }
  // Row-major out[P, Q] is column-major outᵀ [Q, P] = rᵀ · l: r row-major [n, Q] is
  // column-major [Q, n] (no transpose), l row-major [n, P] is column-major [P, n] (transpose).
  if ((n == 1 || (ld_l >= P && ld_r >= Q)) &&
      Blas<T>('N', 'T', Q, P, n, static_cast<T>(alpha), r, std::max<int64_t>(ld_r, Q), l,
              std::max<int64_t>(ld_l, P), out, Q, static_cast<T>(accumulate ? 1 : 0))) {
    return;
  }
  at::Tensor o = View(out, P, Q, Q, 1);
  at::Tensor prod = at::mm(View(l, n, P, ld_l, 1).t(), View(r, n, Q, ld_r, 1));
  if (alpha != 1.0) prod.mul_(alpha);
  if (accumulate) o.add_(prod);
  else o.copy_(prod);
}

template void CpuMatmul<float>(int64_t, int64_t, int64_t, double, const float*, int64_t,
                               const float*, int64_t, int64_t, float*, int64_t);
template void CpuMatmul<double>(int64_t, int64_t, int64_t, double, const double*, int64_t,
                                const double*, int64_t, int64_t, double*, int64_t);
template void CpuOuter<float>(int64_t, int64_t, int64_t, double, const float*, int64_t,
                              const float*, int64_t, float*, bool);
template void CpuOuter<double>(int64_t, int64_t, int64_t, double, const double*, int64_t,
                               const double*, int64_t, double*, bool);

void SegmentedMatmulCpu(const std::vector<MatmulTask>& tasks) {
  CheckTasks(tasks);
  for (const MatmulTask& t : tasks) {
    if (t.out.scalar_type() == at::kFloat) MatmulTaskCpu<float>(t);
    else MatmulTaskCpu<double>(t);
  }
}

void SegmentedOuterCpu(const std::vector<OuterTask>& tasks) {
  CheckTasks(tasks);
  for (const OuterTask& t : tasks) {
    if (t.out.scalar_type() == at::kFloat) OuterTaskCpu<float>(t);
    else OuterTaskCpu<double>(t);
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
