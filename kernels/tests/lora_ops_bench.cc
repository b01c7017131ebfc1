// LoraDelta timing, CPU vs CUDA, for the shape run_gpu_check.sh reports: 8 segments × 128
// rows, in = out = 4096, r = 16, fp32. Rows: our op on CPU, our op on CUDA (SGMV kernels),
// and for context the plain ATen composition on CUDA (one cuBLAS call per segment and step).
// Prints a table, then one line `BENCH {json}` for scripts.

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "kernels/lora_ops.h"

namespace twinkle::kernels {
namespace {

constexpr int64_t kSegments = 8, kRows = 128, kIn = 4096, kOut = 4096, kRank = 16;

struct Problem {
  at::Tensor x, probe;
  std::vector<at::Tensor> a, b;
};

Problem Make(at::Device device) {
  Problem p;
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  p.x = at::randn({kSegments * kRows, kIn}, opts).requires_grad_(true);
  p.probe = at::randn({kSegments * kRows, kOut}, opts);
  for (int64_t s = 0; s < kSegments; ++s) {
    p.a.push_back((at::randn({kRank, kIn}, opts) / 64).requires_grad_(true));
    p.b.push_back((at::randn({kOut, kRank}, opts) / 4).requires_grad_(true));
  }
  return p;
}

std::vector<LoraSegment> Segments(const Problem& p) {
  std::vector<LoraSegment> segs;
  for (int64_t s = 0; s < kSegments; ++s) {
    segs.push_back({s * kRows, (s + 1) * kRows, p.a[s], p.b[s], 2.0, {}});
  }
  return segs;
}

at::Tensor AtenDelta(const at::Tensor& x, const std::vector<LoraSegment>& segs) {
  std::vector<at::Tensor> pieces;
  for (const LoraSegment& s : segs) {
    const at::Tensor xs = x.narrow(0, s.row_begin, s.row_end - s.row_begin);
    pieces.push_back(at::matmul(at::matmul(xs, s.a.t()), s.b.t()) * s.scale);
  }
  return at::cat(pieces, 0);
}

void Sync(const at::Device& device) {
  if (device.is_cuda()) at::detail::getCUDAHooks().deviceSynchronize(device.index());
}

// Median wall time in ms of `iters` runs after `warmup` runs, synchronising the device.
double TimeMs(const at::Device& device, int warmup, int iters, const std::function<void()>& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  Sync(device);
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    Sync(device);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                     .count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

struct Row {
  std::string name;
  double fwd_ms = -1, fwd_bwd_ms = -1;
};

Row Measure(const std::string& name, const at::Device& device, bool aten, int warmup, int iters) {
  Problem p = Make(device);
  const std::vector<LoraSegment> segs = Segments(p);
  auto delta = [&] { return aten ? AtenDelta(p.x, segs) : LoraDelta(p.x, kOut, segs); };
  Row r{name};
  {
    const c10::NoGradGuard no_grad;
    r.fwd_ms = TimeMs(device, warmup, iters, [&] { delta(); });
  }
  r.fwd_bwd_ms = TimeMs(device, warmup, iters, [&] {
    (delta() * p.probe).sum().backward();
    // Gradients accumulate; resetting them keeps every iteration the same work.
    p.x.mutable_grad().reset();
    for (int64_t s = 0; s < kSegments; ++s) {
      p.a[s].mutable_grad().reset();
      p.b[s].mutable_grad().reset();
    }
  });
  return r;
}

std::string Json(double v) { return v < 0 ? "null" : std::to_string(v); }

}  // namespace
}  // namespace twinkle::kernels

int main() {
  using namespace twinkle::kernels;
  at::manual_seed(0);
  std::vector<Row> rows;
  rows.push_back(Measure("cpu sgmv (ours)", at::Device(at::kCPU), false, 2, 10));
  std::string cuda_note = "ok";
#ifdef TWINKLE_WITH_CUDA
  const bool has_cuda = at::hasCUDA();
  if (!has_cuda) cuda_note = "skipped: at::hasCUDA() is false";
#else
  const bool has_cuda = false;
  cuda_note = "skipped: built without TWINKLE_WITH_CUDA";
#endif
  double max_diff = -1;
  if (has_cuda) {
    const at::Device gpu(at::kCUDA, 0);
    rows.push_back(Measure("cuda sgmv (ours)", gpu, false, 5, 50));
    rows.push_back(Measure("cuda aten per-segment", gpu, true, 5, 50));
    // Sanity: the timed op agrees with its CPU twin on the benchmark shape.
    const c10::NoGradGuard no_grad;
    Problem p = Make(at::Device(at::kCPU));
    std::vector<LoraSegment> cpu = Segments(p), gpu_segs = cpu;
    for (LoraSegment& s : gpu_segs) {
      s.a = s.a.to(gpu);
      s.b = s.b.to(gpu);
    }
    const at::Tensor want = LoraDelta(p.x, kOut, cpu);
    const at::Tensor got = LoraDelta(p.x.to(gpu), kOut, gpu_segs).cpu();
    max_diff = (got - want).abs().max().item<double>();
  }
  std::printf("LoraDelta fp32: %lld segments x %lld rows, in=%lld out=%lld r=%lld (median ms)\n",
              static_cast<long long>(kSegments), static_cast<long long>(kRows),
              static_cast<long long>(kIn), static_cast<long long>(kOut),
              static_cast<long long>(kRank));
  std::printf("%-24s %12s %14s\n", "backend", "forward", "fwd+backward");
  for (const Row& r : rows) std::printf("%-24s %12.3f %14.3f\n", r.name.c_str(), r.fwd_ms, r.fwd_bwd_ms);
  if (max_diff >= 0) std::printf("cuda vs cpu max |delta diff|: %.3g\n", max_diff);
  std::printf("cuda: %s\n", cuda_note.c_str());
  const Row none{};
  const Row& cpu = rows[0];
  const Row& cuda = rows.size() > 1 ? rows[1] : none;
  const Row& aten = rows.size() > 2 ? rows[2] : none;
  std::printf(
      "BENCH {\"segments\":%lld,\"rows_per_segment\":%lld,\"in\":%lld,\"out\":%lld,\"rank\":%lld,"
      "\"cpu_fwd_ms\":%s,\"cpu_fwd_bwd_ms\":%s,\"cuda_fwd_ms\":%s,\"cuda_fwd_bwd_ms\":%s,"
      "\"cuda_aten_fwd_ms\":%s,\"cuda_aten_fwd_bwd_ms\":%s,\"cuda_max_abs_diff\":%s,"
      "\"cuda\":\"%s\"}\n",
      static_cast<long long>(kSegments), static_cast<long long>(kRows),
      static_cast<long long>(kIn), static_cast<long long>(kOut), static_cast<long long>(kRank),
      Json(cpu.fwd_ms).c_str(), Json(cpu.fwd_bwd_ms).c_str(), Json(cuda.fwd_ms).c_str(),
      Json(cuda.fwd_bwd_ms).c_str(), Json(aten.fwd_ms).c_str(), Json(aten.fwd_bwd_ms).c_str(),
      Json(max_diff).c_str(), cuda_note.c_str());
  return 0;
}
