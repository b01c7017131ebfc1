#include "kernels/lora_ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "kernels/sgmv.h"

namespace twinkle::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Everything about the segments that is not a tensor. It is passed to forward as a
// non-tensor argument (so autograd gives it no gradient slot) and kept in the context as
// IValue lists for backward.
struct Plan {
  std::vector<int64_t> begin, end;
  std::vector<int64_t> own;  // index into own_x of the segment's own input, or -1: x's rows
  std::vector<double> scale;
  int64_t out_features = 0;
  // CPU: the weights are not inputs of the node; backward accumulates their gradients into
  // .grad() itself (see LoraDelta). Then a/b hold them, and which of them want a gradient.
  bool direct = false;
  std::vector<at::Tensor> a, b;
  std::vector<int64_t> a_grad, b_grad;  // 0/1
};

// Offsets of each segment's [n_s, r_s] block in the flat shrink buffer: ranks differ per
// segment, so a padded [N, r_max] buffer would waste memory and hide shape errors. Blocks
// start 64-byte aligned, like a fresh allocation: CPU BLAS may round differently for
// differently aligned operands, and a tenant's numbers must not depend on which other
// segments precede it in a fused pass (tests/engine/test_fused.py checks bit-equality).
std::vector<int64_t> ShrinkOffsets(const Plan& plan, at::TensorList a, int64_t* total) {
  const int64_t align = 64 / static_cast<int64_t>(a[0].element_size());
  std::vector<int64_t> offsets(plan.begin.size());
  int64_t off = 0;
  for (size_t s = 0; s < offsets.size(); ++s) {
    offsets[s] = off;
    off += ((plan.end[s] - plan.begin[s]) * a[s].size(0) + align - 1) / align * align;
  }
  *total = off;
  return offsets;
}

at::Tensor Block(const at::Tensor& flat, int64_t offset, int64_t rows, int64_t cols) {
  return flat.narrow(0, offset, rows * cols).view({rows, cols});
}

// Gradients of one backward: x (undefined when not needed), per segment A and B, per own x.
// With `direct`, a/b stay empty: the CPU path accumulates into the weights' .grad() itself
// for the weights whose flag is set.
struct Grads {
  at::Tensor x;
  variable_list a, b, own;
  bool direct = false;
  std::vector<int64_t> a_grad, b_grad;  // 0/1
};

// grad += lᵀ · r · alpha for a weight whose gradient the CPU path accumulates itself, as
// AccumulateGrad would: the first gradient becomes .grad(), later ones are added to it.
template <typename T>
void AccumulateOuter(const at::Tensor& weight, int64_t n, int64_t P, int64_t Q, double alpha,
                     const T* l, int64_t ld_l, const T* r, int64_t ld_r) {
  at::Tensor& grad = const_cast<at::Tensor&>(weight).mutable_grad();
  if (!grad.defined()) {
    at::Tensor fresh = at::empty({P, Q}, weight.options().requires_grad(false));
    CpuOuter<T>(n, P, Q, alpha, l, ld_l, r, ld_r, fresh.mutable_data_ptr<T>());
    grad = std::move(fresh);
  } else if (grad.is_contiguous() && grad.scalar_type() == weight.scalar_type() &&
             grad.is_cpu()) {
    CpuOuter<T>(n, P, Q, alpha, l, ld_l, r, ld_r, grad.mutable_data_ptr<T>(), /*accumulate=*/true);
  } else {
    at::Tensor fresh = at::empty({P, Q}, weight.options().requires_grad(false));
    CpuOuter<T>(n, P, Q, alpha, l, ld_l, r, ld_r, fresh.mutable_data_ptr<T>());
    grad.add_(fresh);
  }
}

// Zeroes the rows of `t` [N, cols] (contiguous) that no segment covers.
template <typename T>
void ZeroGaps(T* data, int64_t n, int64_t cols, const Plan& plan) {
  int64_t row = 0;
  for (size_t s = 0; s <= plan.begin.size(); ++s) {
    const int64_t next = s < plan.begin.size() ? plan.begin[s] : n;
    if (next > row) std::memset(data + row * cols, 0, sizeof(T) * (next - row) * cols);
    if (s < plan.begin.size()) row = std::max(row, plan.end[s]);
  }
}

// The CPU path: raw BLAS calls per segment (sgmv.h's CpuMatmul/CpuOuter) on pointers into the
// packed buffers, so a segment costs its BLAS calls and no ATen op or tensor view. x and y are
// contiguous; A and B are dense, either row-major or (inference only, see LoraDelta) stored
// transposed, and CpuMatmul takes their strides.
// Segments [first, last) of the forward; each writes only its own rows of y and delta.
template <typename T>
void ForwardSegmentsCpu(const at::Tensor& x, at::TensorList a, at::TensorList b,
                        at::TensorList own_x, const Plan& plan, const std::vector<int64_t>& y_off,
                        const at::Tensor& y, const at::Tensor& delta, int64_t first, int64_t last) {
  const int64_t in = x.size(1), out = plan.out_features;
  const T* xp = x.const_data_ptr<T>();
  T* yp = y.mutable_data_ptr<T>();
  T* dp = delta.mutable_data_ptr<T>();
  for (int64_t s = first; s < last; ++s) {
    const int64_t n = plan.end[s] - plan.begin[s], r = a[s].size(0);
    const T* xs = plan.own[s] >= 0 ? own_x[plan.own[s]].const_data_ptr<T>() : xp + plan.begin[s] * in;
    T* ys = yp + y_off[s];
    // y_s = x_s · A_sᵀ, then delta_s = scale_s · y_s · B_sᵀ.
    CpuMatmul<T>(n, r, in, 1.0, xs, in, a[s].const_data_ptr<T>(), a[s].stride(0), a[s].stride(1),
                 ys, r);
    CpuMatmul<T>(n, out, r, plan.scale[s], ys, r, b[s].const_data_ptr<T>(), b[s].stride(0),
                 b[s].stride(1), dp + plan.begin[s] * out, out);
  }
}

template <typename T>
void ForwardCpu(const at::Tensor& x, at::TensorList a, at::TensorList b, at::TensorList own_x,
                const Plan& plan, const std::vector<int64_t>& y_off, const at::Tensor& y,
                const at::Tensor& delta) {
  ZeroGaps(delta.mutable_data_ptr<T>(), x.size(0), plan.out_features, plan);
  ForwardSegmentsCpu<T>(x, a, b, own_x, plan, y_off, y, delta, 0,
                        static_cast<int64_t>(plan.begin.size()));
}

// Inference: segments of a few rows each (a generation step: one row per sequence, each
// with its own adapter) are split across the intra-op threads. Their weights are read from
// memory once per step, a separate stream per segment, which one thread alone cannot keep
// up with; the base GEMMs already use every thread. A segment's arithmetic is the same on
// any thread, so the results do not change.
template <typename T>
void ForwardCpuInference(const at::Tensor& x, at::TensorList a, at::TensorList b,
                         at::TensorList own_x, const Plan& plan, const std::vector<int64_t>& y_off,
                         const at::Tensor& y, const at::Tensor& delta) {
  const int64_t segments = static_cast<int64_t>(plan.begin.size());
  int64_t rows = 0, work = 0;
  for (int64_t s = 0; s < segments; ++s) {
    const int64_t n = plan.end[s] - plan.begin[s];
    rows = std::max(rows, n);
    work += n * a[s].size(0) * (x.size(1) + plan.out_features);
  }
  if (segments < 2 || rows > 4 || work < (int64_t{1} << 18)) {
    ForwardCpu<T>(x, a, b, own_x, plan, y_off, y, delta);
    return;
  }
  ZeroGaps(delta.mutable_data_ptr<T>(), x.size(0), plan.out_features, plan);
  const int64_t grain = std::max<int64_t>(1, segments * (int64_t{1} << 17) / work);
  at::parallel_for(0, segments, grain, [&](int64_t first, int64_t last) {
    ForwardSegmentsCpu<T>(x, a, b, own_x, plan, y_off, y, delta, first, last);
  });
}

template <typename T>
void BackwardCpu(const at::Tensor& x, at::TensorList a, at::TensorList b, at::TensorList own_x,
                 const at::Tensor& y, const Plan& plan, const std::vector<int64_t>& y_off,
                 const at::Tensor& g, const at::Tensor& gy, Grads& grads) {
  TORCH_INTERNAL_ASSERT(grads.direct, "LoraDelta: the CPU backward accumulates weight gradients itself");
  const int64_t in = x.size(1), out = plan.out_features;
  const T* xp = x.const_data_ptr<T>();
  const T* yp = y.const_data_ptr<T>();
  const T* gp = g.const_data_ptr<T>();
  T* gyp = gy.mutable_data_ptr<T>();
  T* gxp = grads.x.defined() ? grads.x.mutable_data_ptr<T>() : nullptr;
  if (gxp != nullptr) ZeroGaps(gxp, x.size(0), in, plan);
  for (size_t s = 0; s < plan.begin.size(); ++s) {
    const int64_t n = plan.end[s] - plan.begin[s], r = a[s].size(0);
    const int64_t own = plan.own[s];
    const T* xs = own >= 0 ? own_x[own].const_data_ptr<T>() : xp + plan.begin[s] * in;
    const T* gs = gp + plan.begin[s] * out;
    const T* ys = yp + y_off[s];
    T* gys = gyp + y_off[s];
    const T* as = a[s].const_data_ptr<T>();
    // grad_y_s = scale_s · g_s · B_s (B_s [out, r] seen as the transpose of a [r, out]).
    CpuMatmul<T>(n, r, out, plan.scale[s], gs, out, b[s].const_data_ptr<T>(), 1, r, gys, r);
    // grad_B_s = scale_s · g_sᵀ · y_s and grad_A_s = grad_y_sᵀ · x_s.
    // The CPU path always runs in direct mode: straight into the weights' .grad().
    if (grads.b_grad[s]) AccumulateOuter<T>(b[s], n, out, r, plan.scale[s], gs, out, ys, r);
    if (grads.a_grad[s]) AccumulateOuter<T>(a[s], n, r, in, 1.0, gys, r, xs, in);
    // grad_x_s = grad_y_s · A_s, into x's rows or the segment's own input's gradient.
    T* gx = nullptr;
    if (own >= 0) {
      // x's rows of this segment reach the LoRA only through its own input: 0 for x.
      if (gxp != nullptr) std::memset(gxp + plan.begin[s] * in, 0, sizeof(T) * n * in);
      if (grads.own[own].defined()) gx = grads.own[own].mutable_data_ptr<T>();
    } else if (gxp != nullptr) {
      gx = gxp + plan.begin[s] * in;
    }
    if (gx != nullptr) CpuMatmul<T>(n, in, r, 1.0, gys, r, as, 1, in, gx, in);
  }
}

// The device path: the same steps as task lists for the segmented kernels (one launch each).
void ForwardTasks(const at::Tensor& x, at::TensorList a, at::TensorList b, at::TensorList own_x,
                  const Plan& plan, const std::vector<int64_t>& y_off, const at::Tensor& y,
                  const at::Tensor& delta) {
  std::vector<MatmulTask> shrink, expand;
  for (size_t s = 0; s < plan.begin.size(); ++s) {
    const int64_t n = plan.end[s] - plan.begin[s];
    const at::Tensor xs = plan.own[s] >= 0 ? own_x[plan.own[s]] : x.narrow(0, plan.begin[s], n);
    const at::Tensor ys = Block(y, y_off[s], n, a[s].size(0));
    shrink.push_back({xs, a[s], ys, 1.0});
    expand.push_back({ys, b[s], delta.narrow(0, plan.begin[s], n), plan.scale[s]});
  }
  SegmentedMatmul(shrink);  // y_s = x_s · A_sᵀ
  SegmentedMatmul(expand);  // delta_s = scale_s · y_s · B_sᵀ
}

void BackwardTasks(const at::Tensor& x, at::TensorList a, at::TensorList b, at::TensorList own_x,
                   const at::Tensor& y, const Plan& plan, const std::vector<int64_t>& y_off,
                   const at::Tensor& g, const at::Tensor& gy, Grads& grads) {
  std::vector<MatmulTask> to_gy, to_gx;
  std::vector<OuterTask> to_weights;
  for (size_t s = 0; s < plan.begin.size(); ++s) {
    const int64_t n = plan.end[s] - plan.begin[s], r = a[s].size(0);
    const at::Tensor gs = g.narrow(0, plan.begin[s], n);
    const at::Tensor ys = Block(y, y_off[s], n, r);
    const at::Tensor gys = Block(gy, y_off[s], n, r);
    const int64_t own = plan.own[s];
    const at::Tensor xs = own >= 0 ? own_x[own] : x.narrow(0, plan.begin[s], n);
    // grad_y_s = scale_s · g_s · B_s: the expand kernel with B's roles transposed.
    to_gy.push_back({gs, b[s].t(), gys, plan.scale[s]});
    // grad_B_s = scale_s · g_sᵀ · y_s and grad_A_s = grad_y_sᵀ · x_s: row reductions.
    if (grads.b[s].defined()) to_weights.push_back({gs, ys, grads.b[s], plan.scale[s]});
    if (grads.a[s].defined()) to_weights.push_back({gys, xs, grads.a[s], 1.0});
    // grad_x_s = grad_y_s · A_s: the shrink kernel with A's roles transposed, written into
    // x's rows or into the segment's own input's gradient.
    at::Tensor gx_dest;
    if (own >= 0 && grads.own[own].defined()) {
      gx_dest = grads.own[own];
    } else if (own < 0 && grads.x.defined()) {
      gx_dest = grads.x.narrow(0, plan.begin[s], n);
    }
    if (gx_dest.defined()) to_gx.push_back({gys, a[s].t(), gx_dest, 1.0});
  }
  SegmentedMatmul(to_gy);
  SegmentedOuter(to_weights);
  SegmentedMatmul(to_gx);
}

// The multi-LoRA node. Inputs (in autograd's order): x [N, in], A_0..A_{S-1}, B_0..B_{S-1}
// (empty lists in direct mode), the segments' own (dropout-applied) inputs, the anchor (a list
// of none or one: in direct mode while some weight wants a gradient, a scalar leaf that makes
// autograd record the node even when nothing else it reads requires grad; it never gets a
// gradient), then the plan. All tensors are already in the compute dtype and row-major, so
// the kernels see dense rows.
class SgmvLora : public torch::autograd::Function<SgmvLora> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, at::TensorList a_in,
                            at::TensorList b_in, at::TensorList own_x, at::TensorList anchor,
                            const Plan& plan) {
    const at::TensorList a = plan.direct ? at::TensorList(plan.a) : a_in;
    const at::TensorList b = plan.direct ? at::TensorList(plan.b) : b_in;
    int64_t y_total = 0;
    const std::vector<int64_t> y_off = ShrinkOffsets(plan, a, &y_total);
    const at::Tensor y = at::empty({y_total}, x.options());
    at::Tensor delta;
    if (x.is_cpu()) {
      delta = at::empty({x.size(0), plan.out_features}, x.options());
      if (x.scalar_type() == at::kFloat) ForwardCpu<float>(x, a, b, own_x, plan, y_off, y, delta);
      else ForwardCpu<double>(x, a, b, own_x, plan, y_off, y, delta);
    } else {
      delta = at::zeros({x.size(0), plan.out_features}, x.options());
      ForwardTasks(x, a, b, own_x, plan, y_off, y, delta);
    }

    // y is kept rather than recomputed: it is only N × r, and grad_B needs it. The weights
    // are saved in both modes, so autograd checks that nothing changed them in between.
    variable_list saved{x};
    saved.insert(saved.end(), a.begin(), a.end());
    saved.insert(saved.end(), b.begin(), b.end());
    saved.insert(saved.end(), own_x.begin(), own_x.end());
    saved.push_back(y);
    ctx->save_for_backward(saved);
    ctx->saved_data["begin"] = plan.begin;
    ctx->saved_data["end"] = plan.end;
    ctx->saved_data["own"] = plan.own;
    ctx->saved_data["scale"] = plan.scale;
    ctx->saved_data["direct"] = plan.direct;
    ctx->saved_data["anchored"] = !anchor.empty();
    if (plan.direct) {
      ctx->saved_data["a_grad"] = plan.a_grad;
      ctx->saved_data["b_grad"] = plan.b_grad;
    }
    return delta;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // The steps below are plain kernels, not autograd ops: the node is differentiable once.
    const c10::NoGradGuard no_grad;
    Plan plan;
    plan.begin = ctx->saved_data["begin"].toIntVector();
    plan.end = ctx->saved_data["end"].toIntVector();
    plan.own = ctx->saved_data["own"].toIntVector();
    plan.scale = ctx->saved_data["scale"].toDoubleVector();
    plan.out_features = grads[0].size(1);
    const bool direct = ctx->saved_data["direct"].toBool();
    const size_t num_segments = plan.begin.size();
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::TensorList a(saved.data() + 1, num_segments);
    const at::TensorList b(saved.data() + 1 + num_segments, num_segments);
    const size_t num_own = saved.size() - 2 - 2 * num_segments;
    const at::TensorList own_x(saved.data() + 1 + 2 * num_segments, num_own);
    const at::Tensor& y = saved.back();
    // Indices of the inputs in autograd's order, for needs_input_grad.
    const size_t num_weights = direct ? 0 : num_segments;
    const size_t a_in = 1, b_in = 1 + num_weights, own_in = 1 + 2 * num_weights;

    // Materialised by autograd when undefined; any layout may arrive, the kernels need rows.
    const at::Tensor g = grads[0].contiguous();
    int64_t y_total = 0;
    const std::vector<int64_t> y_off = ShrinkOffsets(plan, a, &y_total);
    const at::Tensor gy = at::empty({y_total}, y.options());

    Grads out;
    out.direct = direct;
    out.a.resize(num_weights);
    out.b.resize(num_weights);
    out.own.resize(num_own);
    if (direct) {
      out.a_grad = ctx->saved_data["a_grad"].toIntVector();
      out.b_grad = ctx->saved_data["b_grad"].toIntVector();
    }
    for (size_t s = 0; s < num_weights; ++s) {
      if (ctx->needs_input_grad(b_in + s)) out.b[s] = at::empty(b[s].sizes(), b[s].options());
      if (ctx->needs_input_grad(a_in + s)) out.a[s] = at::empty(a[s].sizes(), a[s].options());
    }
    for (size_t s = 0; s < num_segments; ++s) {
      const int64_t own = plan.own[s];
      if (own >= 0 && ctx->needs_input_grad(own_in + own)) {
        out.own[own] = at::empty(own_x[own].sizes(), own_x[own].options());
      }
    }
    if (x.is_cpu()) {
      // Rows no segment reads get 0; BackwardCpu writes the others.
      if (ctx->needs_input_grad(0)) out.x = at::empty_like(x, at::MemoryFormat::Contiguous);
      if (x.scalar_type() == at::kFloat) BackwardCpu<float>(x, a, b, own_x, y, plan, y_off, g, gy, out);
      else BackwardCpu<double>(x, a, b, own_x, y, plan, y_off, g, gy, out);
    } else {
      if (ctx->needs_input_grad(0)) out.x = at::zeros_like(x);  // rows no segment reads: 0
      BackwardTasks(x, a, b, own_x, y, plan, y_off, g, gy, out);
    }

    variable_list result{out.x};
    result.insert(result.end(), out.a.begin(), out.a.end());
    result.insert(result.end(), out.b.begin(), out.b.end());
    result.insert(result.end(), out.own.begin(), out.own.end());
    if (direct && ctx->saved_data["anchored"].toBool()) result.emplace_back();  // never a gradient
    result.emplace_back();  // the plan
    return result;
  }
};

// The direct mode's anchor: one scalar leaf per thread, shared by every node (so autograd
// runs its gradient accumulator once per backward, with nothing to accumulate).
const at::Tensor& Anchor() {
  thread_local const at::Tensor anchor = at::zeros({}, at::kFloat).requires_grad_(true);
  return anchor;
}

// Dense row-major, or dense stored transposed (a [p, k] view of a contiguous [k, p]): the
// two layouts ForwardCpu reads in place.
bool DenseEitherWay(const at::Tensor& t) {
  return t.is_contiguous() || (t.dim() == 2 && t.stride(0) == 1 && t.stride(1) == t.size(0));
}

}  // namespace

at::Tensor LoraDelta(const at::Tensor& x, int64_t out_features,
                     const std::vector<LoraSegment>& segments) {
  TORCH_CHECK(x.dim() == 2, "LoraDelta: x must be [N, in], got ", x.sizes());
  const int64_t n = x.size(0), in = x.size(1);
  if (segments.empty()) return at::zeros({n, out_features}, x.options());

  const at::ScalarType compute = segments[0].a.scalar_type();
  // Inference on CPU (no autograd anywhere): the forward kernels straight away, no node, and
  // weights read in either dense layout (Adapter::InferenceWeights hands out transposed
  // ones, which the small-segment loops read without a per-call transpose).
  const bool inference = x.is_cpu() && !c10::GradMode::is_enabled();
  Plan plan;
  plan.out_features = out_features;
  std::vector<at::Tensor> a, b, own_x;
  int64_t prev_end = 0;
  for (const LoraSegment& s : segments) {
    TORCH_CHECK(s.row_begin >= prev_end && s.row_begin <= s.row_end && s.row_end <= n,
                "LoraDelta: segments must be sorted, disjoint and inside [0, ", n, "); got [",
                s.row_begin, ", ", s.row_end, ")");
    prev_end = s.row_end;
    TORCH_CHECK(s.a.dim() == 2 && s.a.size(1) == in && s.b.dim() == 2 &&
                    s.b.size(0) == out_features && s.b.size(1) == s.a.size(0),
                "LoraDelta: want A [r, ", in, "] and B [", out_features, ", r], got A ",
                s.a.sizes(), " and B ", s.b.sizes());
    TORCH_CHECK(s.a.scalar_type() == compute && s.b.scalar_type() == compute,
                "LoraDelta: every A and B must share one dtype (", compute, ")");
    TORCH_CHECK(s.a.device() == x.device() && s.b.device() == x.device(),
                "LoraDelta: weights on ", s.a.device(), "/", s.b.device(), ", x on ", x.device());
    plan.begin.push_back(s.row_begin);
    plan.end.push_back(s.row_end);
    plan.scale.push_back(s.scale);
    // Dense rows for the CPU path's BLAS calls (the leaves already are: no copy).
    a.push_back(inference && DenseEitherWay(s.a) ? s.a : s.a.contiguous());
    b.push_back(inference && DenseEitherWay(s.b) ? s.b : s.b.contiguous());
    if (s.x.defined()) {
      TORCH_CHECK(s.x.dim() == 2 && s.x.size(0) == s.row_end - s.row_begin && s.x.size(1) == in,
                  "LoraDelta: a segment's own x must be [", s.row_end - s.row_begin, ", ", in,
                  "], got ", s.x.sizes());
      plan.own.push_back(static_cast<int64_t>(own_x.size()));
      own_x.push_back(s.x.to(compute).contiguous());
    } else {
      plan.own.push_back(-1);
    }
  }
  if (inference) {
    const at::Tensor xc = x.to(compute).contiguous();
    int64_t y_total = 0;
    const std::vector<int64_t> y_off = ShrinkOffsets(plan, a, &y_total);
    const at::Tensor y = at::empty({y_total}, xc.options());
    const at::Tensor delta = at::empty({n, out_features}, xc.options());
    if (compute == at::kFloat) ForwardCpuInference<float>(xc, a, b, own_x, plan, y_off, y, delta);
    else ForwardCpuInference<double>(xc, a, b, own_x, plan, y_off, y, delta);
    return delta.to(x.scalar_type());
  }
  // On CPU the node accumulates the weights' gradients into .grad() itself instead of
  // handing them to autograd: one AccumulateGrad node per weight per linear is most of the
  // autograd engine's per-adapter work on a small model. The result is the same (the first
  // gradient becomes .grad(), later ones add to it). Elsewhere the weights are inputs.
  const bool direct = x.is_cpu();
  bool track = false;
  if (direct) {
    plan.direct = true;
    const bool grad_mode = c10::GradMode::is_enabled();
    for (size_t s = 0; s < a.size(); ++s) {
      plan.a_grad.push_back(grad_mode && a[s].requires_grad() ? 1 : 0);
      plan.b_grad.push_back(grad_mode && b[s].requires_grad() ? 1 : 0);
      track = track || plan.a_grad.back() != 0 || plan.b_grad.back() != 0;
    }
    plan.a = std::move(a);
    plan.b = std::move(b);
    a.clear();
    b.clear();
  }
  // The casts stay outside the node, so autograd casts the gradients back for us.
  const at::TensorList anchor = track ? at::TensorList(Anchor()) : at::TensorList();
  const at::Tensor delta = SgmvLora::apply(x.to(compute).contiguous(), at::TensorList(a),
                                           at::TensorList(b), at::TensorList(own_x), anchor, plan);
  return delta.to(x.scalar_type());
}

}  // namespace twinkle::kernels
