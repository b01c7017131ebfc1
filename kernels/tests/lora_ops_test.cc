// kernels::LoraDelta against (a) a plain ATen composition differentiated by autograd, on CPU,
// and (b) its CPU twin, with the CUDA kernels, where a GPU is present (else: SKIP, or a
// failure with --require-cuda).
// A tiny harness instead of GoogleTest, so the standalone kernels/ build (a GPU machine with
// only PyTorch) needs nothing else. Exit status 0 = pass.

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>

#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "kernels/lora_ops.h"

namespace twinkle::kernels {
namespace {

int g_failures = 0;

#define EXPECT(cond, ...)                                                \
  do {                                                                   \
    if (!(cond)) {                                                       \
      ++g_failures;                                                      \
      std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);       \
      std::printf(__VA_ARGS__);                                          \
      std::printf("\n");                                                 \
    }                                                                    \
  } while (0)

// |got - want| ≤ tol · (|want| + max|want|): relative per element, with a floor at the
// tensor's scale so that entries that cancel to ~0 do not demand impossible precision.
void ExpectClose(const std::string& what, const at::Tensor& got, const at::Tensor& want,
                 double tol) {
  EXPECT(got.defined() == want.defined(), "%s: defined %d vs %d", what.c_str(), got.defined(),
         want.defined());
  if (!got.defined() || !want.defined()) return;
  EXPECT(got.sizes() == want.sizes(), "%s: shapes differ", what.c_str());
  if (got.sizes() != want.sizes()) return;
  const at::Tensor g = got.to(at::kCPU, at::kDouble), w = want.to(at::kCPU, at::kDouble);
  const double scale = w.numel() ? w.abs().max().item<double>() : 0.0;
  const at::Tensor err = (g - w).abs();
  const bool ok = (err <= tol * (w.abs() + scale)).all().item<bool>() && !g.isnan().any().item<bool>();
  const double max_err = err.numel() ? err.max().item<double>() : 0.0;
  EXPECT(ok, "%s: max |err| %.3g, scale %.3g, tol %.1g", what.c_str(), max_err, scale, tol);
}

struct AdapterSpec {
  int64_t rank;
  double scale;
};
struct SegmentSpec {
  int64_t begin, end;
  int adapter;     // index into Case::adapters; two segments may share one
  bool own_input;  // the segment reads its own dropout-applied x, as training does
};
struct Case {
  std::string name;
  int64_t n, in, out;
  std::vector<AdapterSpec> adapters;
  std::vector<SegmentSpec> segments;
};

// Fixed random data for a case: the leaves' initial values, dropout masks and the probe the
// loss is dotted with (so every gradient entry is exercised, not just sums).
struct Data {
  at::Tensor x, probe;
  std::vector<at::Tensor> a, b, masks;
};

Data MakeData(const Case& c) {
  Data d;
  d.x = at::randn({c.n, c.in}, at::kDouble);
  d.probe = at::randn({c.n, c.out}, at::kDouble);
  for (const AdapterSpec& s : c.adapters) {
    d.a.push_back(at::randn({s.rank, c.in}, at::kDouble) / 4);
    d.b.push_back(at::randn({c.out, s.rank}, at::kDouble) / 4);  // non-zero, unlike PEFT init
  }
  for (const SegmentSpec& s : c.segments) {
    d.masks.push_back((at::rand({s.end - s.begin, c.in}, at::kDouble) > 0.1).to(at::kDouble) / 0.9);
  }
  return d;
}

struct Result {
  at::Tensor delta, grad_x;
  std::vector<at::Tensor> grad_a, grad_b;
};

// The reference: per segment scale · (x_s·Aᵀ)·Bᵀ in the weights' dtype, zeros elsewhere.
at::Tensor Reference(const at::Tensor& x, int64_t out, const std::vector<LoraSegment>& segs) {
  std::vector<at::Tensor> pieces;
  int64_t row = 0;
  for (const LoraSegment& s : segs) {
    if (s.row_begin > row) pieces.push_back(at::zeros({s.row_begin - row, out}, x.options()));
    const at::Tensor xs = s.x.defined() ? s.x : x.narrow(0, s.row_begin, s.row_end - s.row_begin);
    const at::Tensor y = at::matmul(xs.to(s.a.scalar_type()), s.a.t());
    pieces.push_back((at::matmul(y, s.b.t()) * s.scale).to(x.scalar_type()));
    row = s.row_end;
  }
  if (row < x.size(0)) pieces.push_back(at::zeros({x.size(0) - row, out}, x.options()));
  return at::cat(pieces, 0);
}

// Runs the op (or the reference) on fresh leaves in the given dtypes and device, then
// backpropagates <delta, probe>. Results come back on CPU.
Result Run(const Case& c, const Data& d, at::ScalarType x_dtype, at::ScalarType w_dtype,
           at::Device device, bool reference, bool x_requires_grad = true) {
  // copy=true: a same-dtype .to() would return the shared Data tensor itself.
  auto leaf = [&](const at::Tensor& t, at::ScalarType dt, bool grad) {
    return t.to(device, dt, /*non_blocking=*/false, /*copy=*/true).requires_grad_(grad);
  };
  const at::Tensor x = leaf(d.x, x_dtype, x_requires_grad);
  std::vector<at::Tensor> a, b;
  for (size_t i = 0; i < d.a.size(); ++i) {
    a.push_back(leaf(d.a[i], w_dtype, true));
    b.push_back(leaf(d.b[i], w_dtype, true));
  }
  std::vector<LoraSegment> segs;
  for (size_t i = 0; i < c.segments.size(); ++i) {
    const SegmentSpec& s = c.segments[i];
    LoraSegment seg{s.begin, s.end, a[s.adapter], b[s.adapter], c.adapters[s.adapter].scale, {}};
    if (s.own_input) {
      seg.x = x.narrow(0, s.begin, s.end - s.begin) * d.masks[i].to(device, x_dtype);
    }
    segs.push_back(seg);
  }
  Result r;
  r.delta = reference ? Reference(x, c.out, segs) : LoraDelta(x, c.out, segs);
  (r.delta.to(at::kDouble) * d.probe.to(device)).sum().backward();
  r.delta = r.delta.detach().cpu();
  if (x_requires_grad) r.grad_x = x.grad().cpu();
  for (size_t i = 0; i < a.size(); ++i) {
    r.grad_a.push_back(a[i].grad().cpu());
    r.grad_b.push_back(b[i].grad().cpu());
  }
  return r;
}

void ExpectSame(const std::string& what, const Result& got, const Result& want, double tol) {
  ExpectClose(what + " delta", got.delta, want.delta, tol);
  ExpectClose(what + " grad_x", got.grad_x, want.grad_x, tol);
  for (size_t i = 0; i < want.grad_a.size(); ++i) {
    ExpectClose(what + " grad_a[" + std::to_string(i) + "]", got.grad_a[i], want.grad_a[i], tol);
    ExpectClose(what + " grad_b[" + std::to_string(i) + "]", got.grad_b[i], want.grad_b[i], tol);
  }
}

std::vector<Case> Cases() {
  // Gaps before, between and after segments; ranks 1..33, ranks above a segment's row count,
  // an empty segment, two segments sharing an adapter, sizes that are not tile multiples.
  Case small{"small", 50, 24, 20, {{4, 2.0}, {8, 0.5}, {1, 16.0}, {16, 0.25}, {2, 1.0}}, {}};
  small.segments = {{3, 10, 0, false}, {10, 18, 1, true}, {18, 18, 4, false},
                    {25, 40, 2, false}, {40, 43, 0, true}, {45, 50, 3, false}};
  Case tiles{"tiles", 301, 200, 130, {{16, 2.0}, {8, 1.0}, {1, 4.0}, {33, 0.5}}, {}};
  tiles.segments = {{0, 17, 0, false}, {17, 150, 1, true}, {160, 161, 2, false},
                    {170, 290, 3, false}, {291, 301, 0, true}, {301, 301, 2, false}};
  return {small, tiles};
}

void TestCpuAgainstReference() {
  for (const Case& c : Cases()) {
    const Data d = MakeData(c);
    const at::Device cpu(at::kCPU);
    for (at::ScalarType dt : {at::kFloat, at::kDouble}) {
      const double tol = dt == at::kFloat ? 1e-5 : 1e-12;
      const std::string what = c.name + (dt == at::kFloat ? " f32" : " f64");
      ExpectSame(what, Run(c, d, dt, dt, cpu, false), Run(c, d, dt, dt, cpu, true), tol);
      // Frozen input (first layer): only the weights get gradients.
      ExpectSame(what + " frozen-x", Run(c, d, dt, dt, cpu, false, false),
                 Run(c, d, dt, dt, cpu, true, false), tol);
    }
    // Half-precision activations with fp32 weights: the delta is rounded to bf16 at the end,
    // so one bf16 ulp is the tolerance.
    ExpectSame(c.name + " bf16-x", Run(c, d, at::kBFloat16, at::kFloat, cpu, false),
               Run(c, d, at::kBFloat16, at::kFloat, cpu, true), 1e-2);
    // Without grad mode (forward requests) the op must not build a graph.
    const c10::NoGradGuard no_grad;
    const at::Tensor x = d.x.to(at::kFloat);
    const std::vector<LoraSegment> segs = {
        {1, 4, d.a[0].to(at::kFloat), d.b[0].to(at::kFloat), 3.0, {}}};
    const at::Tensor got = LoraDelta(x, c.out, segs);
    EXPECT(!got.requires_grad() && got.grad_fn() == nullptr, "%s: graph built under no_grad",
           c.name.c_str());
    ExpectClose(c.name + " no-grad", got, Reference(x, c.out, segs), 1e-5);
  }
  std::printf("cpu vs ATen reference: done\n");
}

// A generation step's LoRA: one-row segments, each on its own adapter, large enough that
// the inference path (NoGrad, CPU) splits them across threads; weights given as they are
// and stored transposed (Adapter::InferenceWeights' layout). Must equal, bit for bit, the
// same op with autograd recording (one thread, plain weights), and the ATen reference.
void TestInferenceOneRowSegments() {
  const int64_t in = 512, out = 1536, rank = 16, rows = 24;
  const at::Tensor x = at::randn({rows, in});
  std::vector<LoraSegment> plain, transposed;
  for (int64_t i = 0; i < rows; ++i) {
    if (i % 7 == 3) continue;  // a row without an adapter
    const at::Tensor a = at::randn({rank, in}) / 8, b = at::randn({out, rank}) / 8;
    plain.push_back({i, i + 1, a, b, 0.5 + i, {}});
    const bool t = i % 2 == 0;
    transposed.push_back({i, i + 1, t ? a.t().contiguous().t() : a, t ? b.t().contiguous().t() : b, 0.5 + i, {}});
  }
  at::Tensor recorded;
  {
    std::vector<LoraSegment> leaves = plain;
    for (LoraSegment& s : leaves) {
      s.a = s.a.clone().requires_grad_(true);
      s.b = s.b.clone().requires_grad_(true);
    }
    recorded = LoraDelta(x, out, leaves).detach();
  }
  const c10::NoGradGuard no_grad;
  const at::Tensor plain_delta = LoraDelta(x, out, plain);
  const at::Tensor transposed_delta = LoraDelta(x, out, transposed);
  EXPECT(at::equal(plain_delta, recorded), "inference one-row segments differ from the recorded op");
  EXPECT(at::equal(transposed_delta, recorded), "transposed weights differ from plain ones");
  ExpectClose("inference one-row segments", transposed_delta, Reference(x, out, plain), 1e-5);
  std::printf("inference one-row segments (%d threads): done\n", at::get_num_threads());
}

// Without a GPU the CUDA half is skipped (and passes) unless `require` is set, as
// run_gpu_check.sh does: there a skip would hide a broken setup.
void SkipCuda(const char* reason, bool require) {
  std::printf("SKIP cuda: %s\n", reason);
  if (require) {
    ++g_failures;
    std::printf("FAIL --require-cuda was given\n");
  }
}

void TestCudaAgainstCpu(bool require) {
#ifndef TWINKLE_WITH_CUDA
  SkipCuda("twinkle_kernels was built without TWINKLE_WITH_CUDA", require);
  return;
#else
  if (!at::hasCUDA()) {
    SkipCuda("built with CUDA, but at::hasCUDA() is false (no GPU or driver)", require);
    return;
  }
  const at::Device gpu(at::kCUDA, 0), cpu(at::kCPU);
  for (const Case& c : Cases()) {
    const Data d = MakeData(c);
    for (at::ScalarType dt : {at::kFloat, at::kDouble}) {
      const double tol = dt == at::kFloat ? 1e-5 : 1e-12;
      const std::string what = "cuda " + c.name + (dt == at::kFloat ? " f32" : " f64");
      ExpectSame(what, Run(c, d, dt, dt, gpu, false), Run(c, d, dt, dt, cpu, false), tol);
      ExpectSame(what + " frozen-x", Run(c, d, dt, dt, gpu, false, false),
                 Run(c, d, dt, dt, cpu, false, false), tol);
    }
    ExpectSame("cuda " + c.name + " bf16-x", Run(c, d, at::kBFloat16, at::kFloat, gpu, false),
               Run(c, d, at::kBFloat16, at::kFloat, cpu, false), 1e-2);
  }
  std::printf("cuda vs cpu twin: done\n");
#endif
}

}  // namespace
}  // namespace twinkle::kernels

int main(int argc, char** argv) {
  const bool require_cuda = argc > 1 && std::string(argv[1]) == "--require-cuda";
  at::manual_seed(0);
  try {
    twinkle::kernels::TestCpuAgainstReference();
    twinkle::kernels::TestInferenceOneRowSegments();
    twinkle::kernels::TestCudaAgainstCpu(require_cuda);
  } catch (const std::exception& e) {
    std::printf("FAILED: exception: %s\n", e.what());
    return 1;
  }
  if (twinkle::kernels::g_failures > 0) {
    std::printf("FAILED: %d check(s)\n", twinkle::kernels::g_failures);
    return 1;
  }
  std::printf("PASSED\n");
  return 0;
}
