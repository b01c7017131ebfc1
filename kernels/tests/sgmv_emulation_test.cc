// Runs the CUDA SGMV kernel bodies (kernels/cuda/sgmv_kernels.cuh) on CPU threads, one
// std::thread per CUDA thread and a std::barrier per block for __syncthreads, and compares
// them with the CPU backend on every task list LoraDelta issues. Where no GPU is available
// (most of our machines) this still checks the tiling, bounds, strides, segment table and
// grid sizing; it cannot check what only hardware shows (memory model, launch config, speed).
// lora_ops_test.cc covers the real kernels where a GPU is present.

#include <ATen/ATen.h>

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <exception>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "kernels/cuda/sgmv_desc.h"
#include "kernels/cuda/sgmv_tables.h"
#include "kernels/sgmv.h"

// The CUDA built-ins the kernels use. Blocks run one at a time, so a function-local static
// array is exactly one block's shared memory. (Reserved names, but only in this test.)
struct EmuDim3 {
  unsigned x = 0, y = 0, z = 0;
};
thread_local EmuDim3 blockIdx, threadIdx;
thread_local int g_syncs = 0;  // __syncthreads calls of this thread: must match block-wide
std::barrier<>* g_block_barrier = nullptr;
#define __global__
#define __device__
#define __shared__ static
#define __syncthreads() (++g_syncs, g_block_barrier->arrive_and_wait())
#include "kernels/cuda/sgmv_kernels.cuh"

namespace twinkle::kernels {
namespace {

int g_failures = 0;

void Expect(bool ok, const std::string& what) {
  if (!ok) {
    ++g_failures;
    std::printf("FAIL %s\n", what.c_str());
  }
}

// Launches `kernel` over `blocks` blocks of kSgmvTile² threads: one std::thread per CUDA
// thread, reused for every block, and one barrier serving both __syncthreads and the end of
// each block (so blocks run one at a time). The per-thread __syncthreads counts must agree
// in every block, or the kernel relied on a divergent barrier (undefined on a GPU; here it
// would hang, and ctest's timeout would report it).
template <typename Kernel>
void Emulate(int64_t blocks, const Kernel& kernel, const std::string& what) {
  constexpr unsigned kThreads = cuda::kSgmvTile * cuda::kSgmvTile;
  Expect(blocks <= cuda::kMaxTiles, what + ": grid does not fit");
  std::barrier<> barrier(kThreads);
  g_block_barrier = &barrier;
  std::vector<std::vector<int>> syncs(blocks, std::vector<int>(kThreads));
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      threadIdx = {t % cuda::kSgmvTile, t / cuda::kSgmvTile, 0};
      for (int64_t b = 0; b < blocks; ++b) {
        blockIdx = {static_cast<unsigned>(b), 0, 0};
        g_syncs = 0;
        kernel();
        syncs[b][t] = g_syncs;
        barrier.arrive_and_wait();  // the block's end: shared memory is reused by the next
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int64_t b = 0; b < blocks; ++b) {
    for (int n : syncs[b]) {
      Expect(n == syncs[b][0], what + ": divergent __syncthreads in block " + std::to_string(b));
    }
  }
}

// The launchers (sgmv_kernels.cu) on the emulator: same tables, same block counts.
template <typename T>
void EmulateMatmul(const std::vector<MatmulTask>& tasks, const std::string& what) {
  const cuda::MatmulTable<T> table = cuda::BuildMatmulTable<T>(tasks);
  const int64_t count = static_cast<int64_t>(table.segs.size());
  Emulate(table.tiles, [&] { cuda::SegmentedMatmulKernel<T>(table.segs.data(), count); }, what);
}

template <typename T>
void EmulateOuter(const std::vector<OuterTask>& tasks, const std::string& what) {
  const cuda::OuterTable<T> table = cuda::BuildOuterTable<T>(tasks);
  const int64_t count = static_cast<int64_t>(table.segs.size());
  Emulate(table.tiles, [&] { cuda::SegmentedOuterKernel<T>(table.segs.data(), count); }, what);
}

void ExpectClose(const at::Tensor& got, const at::Tensor& want, double tol, const std::string& what) {
  // NaN in `got` means an element the kernel should have written and did not (or the reverse).
  const bool same_nan = at::equal(got.isnan(), want.isnan());
  const at::Tensor g = at::nan_to_num(got, 0), w = at::nan_to_num(want, 0);
  const double scale = w.numel() ? w.abs().max().item<double>() : 0.0;
  const double err = g.numel() ? (g - w).abs().max().item<double>() : 0.0;
  Expect(same_nan && err <= tol * (scale + 1e-30),
         what + ": max|err| " + std::to_string(err) + " scale " + std::to_string(scale) +
             (same_nan ? "" : " (written elements differ)"));
}

struct Seg {
  int64_t begin, end, rank;
};

// The five task lists of one LoraDelta forward + backward, on buffers pre-filled with NaN so
// that a missing or stray write shows. Built twice (CPU backend vs emulated kernels).
template <typename T>
void CheckLoraSteps(const std::string& name, int64_t n, int64_t in, int64_t out,
                    const std::vector<Seg>& segs) {
  const at::ScalarType dt = std::is_same_v<T, float> ? at::kFloat : at::kDouble;
  const double tol = dt == at::kFloat ? 2e-6 : 1e-13;
  const auto opts = at::TensorOptions().dtype(dt);
  const at::Tensor x = at::randn({n, in}, opts), g = at::randn({n, out}, opts);
  std::vector<at::Tensor> a, b;
  std::vector<int64_t> off;
  int64_t y_total = 0;
  for (const Seg& s : segs) {
    a.push_back(at::randn({s.rank, in}, opts));
    b.push_back(at::randn({out, s.rank}, opts));
    off.push_back(y_total);
    y_total += (s.end - s.begin) * s.rank + 3;  // odd gaps: blocks need no alignment here
  }
  struct Buffers {
    at::Tensor y, delta, gy, gx;
    std::vector<at::Tensor> ga, gb;
  };
  auto make = [&] {
    Buffers f;
    const double nan = std::nan("");
    f.y = at::full({y_total}, nan, opts);
    f.gy = at::full({y_total}, nan, opts);
    f.delta = at::full({n, out}, nan, opts);
    f.gx = at::full({n, in}, nan, opts);
    for (const Seg& s : segs) {
      f.ga.push_back(at::full({s.rank, in}, nan, opts));
      f.gb.push_back(at::full({out, s.rank}, nan, opts));
    }
    return f;
  };
  auto block = [&](const at::Tensor& flat, size_t s) {
    const int64_t rows = segs[s].end - segs[s].begin;
    return flat.narrow(0, off[s], rows * segs[s].rank).view({rows, segs[s].rank});
  };
  auto rows = [&](const at::Tensor& t, size_t s) {
    return t.narrow(0, segs[s].begin, segs[s].end - segs[s].begin);
  };
  Buffers ref = make(), emu = make();
  for (int step = 0; step < 5; ++step) {
    for (Buffers* f : {&ref, &emu}) {
      std::vector<MatmulTask> mm;
      std::vector<OuterTask> outer;
      for (size_t s = 0; s < segs.size(); ++s) {
        const double scale = 0.5 + static_cast<double>(s);
        if (step == 0) mm.push_back({rows(x, s), a[s], block(f->y, s), 1.0});
        if (step == 1) mm.push_back({block(ref.y, s), b[s], rows(f->delta, s), scale});
        if (step == 2) mm.push_back({rows(g, s), b[s].t(), block(f->gy, s), scale});
        if (step == 3) mm.push_back({block(ref.gy, s), a[s].t(), rows(f->gx, s), 1.0});
        if (step == 4) {
          outer.push_back({block(ref.gy, s), rows(x, s), f->ga[s], 1.0});
          outer.push_back({rows(g, s), block(ref.y, s), f->gb[s], scale});
        }
      }
      const std::string what = name + " step " + std::to_string(step);
      if (f == &ref) {
        SegmentedMatmulCpu(mm);
        SegmentedOuterCpu(outer);
      } else {
        EmulateMatmul<T>(mm, what);
        EmulateOuter<T>(outer, what);
      }
    }
  }
  ExpectClose(emu.y, ref.y, tol, name + " shrink");
  ExpectClose(emu.delta, ref.delta, tol, name + " expand");
  ExpectClose(emu.gy, ref.gy, tol, name + " grad_y (expand, transposed B)");
  ExpectClose(emu.gx, ref.gx, tol, name + " grad_x (shrink, transposed A)");
  for (size_t s = 0; s < segs.size(); ++s) {
    ExpectClose(emu.ga[s], ref.ga[s], tol, name + " grad_A[" + std::to_string(s) + "]");
    ExpectClose(emu.gb[s], ref.gb[s], tol, name + " grad_B[" + std::to_string(s) + "]");
  }
}

}  // namespace
}  // namespace twinkle::kernels

int main() {
  using twinkle::kernels::CheckLoraSteps;
  using twinkle::kernels::Seg;
  at::manual_seed(0);
  try {
    // Sizes straddle tile edges (16): in = 40, out = 37, ranks 1..33, rows 0..35, gaps, and
    // empty segments first, in between and last (the kernels' segment search must skip them).
    const std::vector<Seg> segs = {{0, 0, 4},    {2, 19, 16}, {19, 20, 1}, {20, 20, 5},
                                   {23, 58, 33}, {60, 64, 3}, {66, 66, 2}};
    CheckLoraSteps<float>("f32", 66, 40, 37, segs);
    CheckLoraSteps<double>("f64", 66, 40, 37, segs);
    // Reductions longer than one step (kDepth = 64): k = 130 and 70, 70 and 75 rows.
    CheckLoraSteps<float>("f32-deep", 150, 130, 70, {{0, 70, 8}, {75, 150, 20}});
    // One tile exactly.
    CheckLoraSteps<float>("f32-exact", 32, 16, 16, {{0, 16, 16}, {16, 32, 16}});
  } catch (const std::exception& e) {
    std::printf("FAILED: exception: %s\n", e.what());
    return 1;
  }
  if (twinkle::kernels::g_failures > 0) {
    std::printf("FAILED: %d check(s)\n", twinkle::kernels::g_failures);
    return 1;
  }
  std::printf("PASSED: CUDA kernel bodies (emulated on CPU threads) match the CPU backend\n");
  return 0;
}
