#pragma once
// Launchers of the CUDA SGMV kernels behind kernels/sgmv.h, with a torch-free interface: the
// .cu file is compiled by nvcc without LibTorch's headers (faster, and no nvcc/torch header
// clashes); sgmv_cuda.cc builds the segment tables from tensors and calls these.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/sgmv_desc.h"

namespace twinkle::kernels::cuda {

// `segs` points to `count` descriptors in device memory whose tile ranges (tile_begin) are
// consecutive from 0 and cover `tiles` tiles in all (sgmv_tables.h fills them). Enqueued on
// `stream`; returns the launch error (cudaErrorInvalidConfiguration past kMaxTiles).
template <typename T>
cudaError_t LaunchSegmentedMatmul(const MatmulSeg<T>* segs, int64_t count, int64_t tiles,
                                  cudaStream_t stream);
template <typename T>
cudaError_t LaunchSegmentedOuter(const OuterSeg<T>* segs, int64_t count, int64_t tiles,
                                 cudaStream_t stream);

}  // namespace twinkle::kernels::cuda
