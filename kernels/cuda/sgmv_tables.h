#pragma once
// Segment tables from task lists: the one place tensor shapes and strides become kernel
// descriptors. Used by the CUDA backend (sgmv_cuda.cc) and by the host emulation test, so
// the test covers this translation too. The tasks must have passed CheckTasks.

#include <ATen/core/Tensor.h>

#include <vector>

#include "kernels/cuda/sgmv_desc.h"
#include "kernels/sgmv.h"

namespace twinkle::kernels::cuda {

// `tiles` is the launch's block count: the sum of the segments' output tiles.
template <typename T>
struct MatmulTable {
  std::vector<MatmulSeg<T>> segs;
  int64_t tiles = 0;
};

template <typename T>
struct OuterTable {
  std::vector<OuterSeg<T>> segs;
  int64_t tiles = 0;
};

template <typename T>
MatmulTable<T> BuildMatmulTable(const std::vector<MatmulTask>& tasks) {
  MatmulTable<T> table;
  table.segs.reserve(tasks.size());
  for (const MatmulTask& t : tasks) {
    MatmulSeg<T> d{};
    d.in = t.in.const_data_ptr<T>();
    d.w = t.w.const_data_ptr<T>();
    d.out = t.out.mutable_data_ptr<T>();
    d.rows = t.in.size(0);
    d.k = t.in.size(1);
    d.p = t.out.size(1);
    d.ld_in = t.in.stride(0);
    d.ld_out = t.out.stride(0);
    d.w_sp = t.w.stride(0);
    d.w_sk = t.w.stride(1);
    d.alpha = static_cast<T>(t.alpha);
    // A segment with no rows has no tiles: it writes nothing, as on the CPU.
    d.tile_begin = table.tiles;
    d.col_tiles = SgmvTiles(d.p);
    table.tiles += SgmvTiles(d.rows) * d.col_tiles;
    table.segs.push_back(d);
  }
  return table;
}

template <typename T>
OuterTable<T> BuildOuterTable(const std::vector<OuterTask>& tasks) {
  OuterTable<T> table;
  table.segs.reserve(tasks.size());
  for (const OuterTask& t : tasks) {
    OuterSeg<T> d{};
    d.l = t.l.const_data_ptr<T>();
    d.r = t.r.const_data_ptr<T>();
    d.out = t.out.mutable_data_ptr<T>();
    d.rows = t.l.size(0);
    d.p = t.out.size(0);
    d.q = t.out.size(1);
    d.ld_l = t.l.stride(0);
    d.ld_r = t.r.stride(0);
    d.alpha = static_cast<T>(t.alpha);
    // Tiles cover out [p, q] whatever the row count: no rows means a zero gradient to write.
    d.tile_begin = table.tiles;
    d.col_tiles = SgmvTiles(d.q);
    table.tiles += SgmvTiles(d.p) * d.col_tiles;
    table.segs.push_back(d);
  }
  return table;
}

}  // namespace twinkle::kernels::cuda
