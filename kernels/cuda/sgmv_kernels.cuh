#pragma once
// Tiled SGMV kernels: correctness first. Each block computes one kSgmvTile² output tile of
// one segment through shared-memory tiles; accumulation is in T (fp32 for the LoRA weights)
// and in a fixed order, so results are deterministic run to run (no atomics, no split-K).
//
// Included by sgmv_kernels.cu (nvcc) and by kernels/tests/sgmv_emulation_test.cc, which runs
// these bodies on CPU threads to check the tiling and indexing where no GPU is available;
// keep them to CUDA features that test emulates (blockIdx, threadIdx, __shared__,
// __syncthreads, __device__ helpers).

#include "kernels/cuda/sgmv_desc.h"

// nvcc unrolls the fixed-length tile loops; a host compiler (the emulation test) would only
// warn about the pragma.
#ifdef __CUDACC__
#define TWINKLE_SGMV_UNROLL _Pragma("unroll")
#else
#define TWINKLE_SGMV_UNROLL
#endif

namespace twinkle::kernels::cuda {

// The segment owning flat tile `tile`: the last one whose tile_begin ≤ tile. A segment with
// no tiles shares its tile_begin with the next, so it is never chosen. Uniform per block.
template <typename Desc>
__device__ int64_t FindSegment(const Desc* segs, int64_t count, int64_t tile) {
  int64_t lo = 0, hi = count - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (segs[mid].tile_begin <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Depth of the reduction step: each thread loads kDepth / kSgmvTile elements of each operand
// per step. A deeper step means fewer latency-bound round trips for the long reductions
// (shrink and grad_y reduce over in/out = 4096 into only r = 16 columns, so few blocks run).
inline constexpr int kDepth = 4 * kSgmvTile;

// grid = (total tiles), block = (kSgmvTile, kSgmvTile).
// Thread (tx, ty) owns out[row0 + ty, col0 + tx] of its block's tile.
template <typename T>
__global__ void SegmentedMatmulKernel(const MatmulSeg<T>* __restrict__ segs, int64_t count) {
  constexpr int kTile = kSgmvTile;
  const int64_t tile = blockIdx.x;
  const MatmulSeg<T> s = segs[FindSegment(segs, count, tile)];
  const int64_t local = tile - s.tile_begin;
  const int64_t row0 = local / s.col_tiles * kTile;
  const int64_t col0 = local % s.col_tiles * kTile;

  __shared__ T in_tile[kTile][kDepth + 1];  // [row][k]
  __shared__ T w_tile[kTile][kDepth + 1];   // [col][k]; +1 avoids bank conflicts on [tx][j]
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t row = row0 + ty, col = col0 + tx;
  // Load w so that neighbouring threads read neighbouring addresses: along k when w is
  // row-major (shrink, expand), along p when it is a transposed view (the backward).
  const bool w_k_dense = s.w_sk == 1 || s.w_sp != 1;
  T acc = T(0);
  for (int64_t k0 = 0; k0 < s.k; k0 += kDepth) {
    TWINKLE_SGMV_UNROLL
    for (int kk = 0; kk < kDepth; kk += kTile) {
      const int64_t k_in = k0 + kk + tx;
      in_tile[ty][kk + tx] = (row < s.rows && k_in < s.k) ? s.in[row * s.ld_in + k_in] : T(0);
      const int64_t wc = col0 + (w_k_dense ? ty : tx);
      const int64_t wk = k0 + kk + (w_k_dense ? tx : ty);
      const T wv = (wc < s.p && wk < s.k) ? s.w[wc * s.w_sp + wk * s.w_sk] : T(0);
      if (w_k_dense) {
        w_tile[ty][kk + tx] = wv;
      } else {
        w_tile[tx][kk + ty] = wv;
      }
    }
    __syncthreads();
    TWINKLE_SGMV_UNROLL
    for (int j = 0; j < kDepth; ++j) acc += in_tile[ty][j] * w_tile[tx][j];
    __syncthreads();
  }
  if (row < s.rows && col < s.p) s.out[row * s.ld_out + col] = s.alpha * acc;
}

// grid = (total tiles), block = (kSgmvTile, kSgmvTile).
// Thread (tx, ty) owns out[p0 + ty, q0 + tx] and reduces over all of the segment's rows.
// A segment with no rows still has tiles and writes zeros, which is its gradient.
template <typename T>
__global__ void SegmentedOuterKernel(const OuterSeg<T>* __restrict__ segs, int64_t count) {
  constexpr int kTile = kSgmvTile;
  const int64_t tile = blockIdx.x;
  const OuterSeg<T> s = segs[FindSegment(segs, count, tile)];
  const int64_t local = tile - s.tile_begin;
  const int64_t p0 = local / s.col_tiles * kTile;
  const int64_t q0 = local % s.col_tiles * kTile;

  __shared__ T l_tile[kDepth][kTile + 1];  // [i][p]
  __shared__ T r_tile[kDepth][kTile + 1];  // [i][q]
  const int tx = threadIdx.x, ty = threadIdx.y;
  T acc = T(0);
  for (int64_t i0 = 0; i0 < s.rows; i0 += kDepth) {
    TWINKLE_SGMV_UNROLL
    for (int ii = 0; ii < kDepth; ii += kTile) {
      const int64_t i = i0 + ii + ty;
      l_tile[ii + ty][tx] = (i < s.rows && p0 + tx < s.p) ? s.l[i * s.ld_l + p0 + tx] : T(0);
      r_tile[ii + ty][tx] = (i < s.rows && q0 + tx < s.q) ? s.r[i * s.ld_r + q0 + tx] : T(0);
    }
    __syncthreads();
    TWINKLE_SGMV_UNROLL
    for (int j = 0; j < kDepth; ++j) acc += l_tile[j][ty] * r_tile[j][tx];
    __syncthreads();
  }
  const int64_t p = p0 + ty, q = q0 + tx;
  if (p < s.p && q < s.q) s.out[p * s.q + q] = s.alpha * acc;
}

}  // namespace twinkle::kernels::cuda
