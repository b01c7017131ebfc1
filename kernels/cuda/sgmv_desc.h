#pragma once
// Segment-table descriptors shared by the CUDA SGMV kernels (sgmv_kernels.cuh), the code that
// fills them from tensors (sgmv_tables.h) and the host emulation test. Plain C++, no CUDA or
// LibTorch headers, so each of those can include it.

#include <cstdint>

namespace twinkle::kernels::cuda {

// Each descriptor also records where its tiles start in the launch's flat list of output
// tiles (kSgmvTile × kSgmvTile each, one block per tile), so a block finds its segment by
// binary search and no block is spent on a bounding box of unequal segments: grad_A
// [r, in] and grad_B [out, r] differ by 256× in shape at r = 16.

// out[i, c] = alpha · Σ_k in[i, k] · w[c, k], for i < rows, c < p; w[c, k] = w[c·w_sp + k·w_sk].
template <typename T>
struct MatmulSeg {
  const T* in;
  const T* w;
  T* out;
  int64_t rows, k, p;
  int64_t ld_in, ld_out;  // row strides of in and out (their last dim is dense)
  int64_t w_sp, w_sk;     // element strides of w along p and k (a transpose swaps them)
  int64_t tile_begin;     // first tile of this segment; its tiles are row-major over out
  int64_t col_tiles;      // tiles along p
  T alpha;
};

// out[a, b] = alpha · Σ_i l[i, a] · r[i, b], for a < p, b < q; out is dense [p, q].
template <typename T>
struct OuterSeg {
  const T* l;
  const T* r;
  T* out;
  int64_t rows, p, q;
  int64_t ld_l, ld_r;  // row strides of l and r (their last dim is dense)
  int64_t tile_begin;  // as in MatmulSeg; tiles are row-major over out [p, q]
  int64_t col_tiles;   // tiles along q
  T alpha;
};

// Blocks are kSgmvTile × kSgmvTile threads, one output element each.
inline constexpr int kSgmvTile = 16;
// One block per tile on grid.x, which CUDA caps at 2^31 - 1.
inline constexpr int64_t kMaxTiles = 0x7fffffff;

inline int64_t SgmvTiles(int64_t n) { return (n + kSgmvTile - 1) / kSgmvTile; }

}  // namespace twinkle::kernels::cuda
