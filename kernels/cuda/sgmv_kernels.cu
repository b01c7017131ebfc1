// Launchers and instantiations of the SGMV kernels (sgmv_kernels.cuh) for float and double.

#include "kernels/cuda/sgmv_kernels.h"

#include "kernels/cuda/sgmv_kernels.cuh"

namespace twinkle::kernels::cuda {

template <typename T>
cudaError_t LaunchSegmentedMatmul(const MatmulSeg<T>* segs, int64_t count, int64_t tiles,
                                  cudaStream_t stream) {
  if (tiles == 0) return cudaSuccess;  // every segment empty: nothing to write
  if (tiles > kMaxTiles) return cudaErrorInvalidConfiguration;
  SegmentedMatmulKernel<T><<<static_cast<unsigned>(tiles), dim3(kSgmvTile, kSgmvTile), 0,
                             stream>>>(segs, count);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchSegmentedOuter(const OuterSeg<T>* segs, int64_t count, int64_t tiles,
                                 cudaStream_t stream) {
  if (tiles == 0) return cudaSuccess;
  if (tiles > kMaxTiles) return cudaErrorInvalidConfiguration;
  SegmentedOuterKernel<T><<<static_cast<unsigned>(tiles), dim3(kSgmvTile, kSgmvTile), 0,
                            stream>>>(segs, count);
  return cudaGetLastError();
}

template cudaError_t LaunchSegmentedMatmul<float>(const MatmulSeg<float>*, int64_t, int64_t,
                                                  cudaStream_t);
template cudaError_t LaunchSegmentedMatmul<double>(const MatmulSeg<double>*, int64_t, int64_t,
                                                   cudaStream_t);
template cudaError_t LaunchSegmentedOuter<float>(const OuterSeg<float>*, int64_t, int64_t,
                                                 cudaStream_t);
template cudaError_t LaunchSegmentedOuter<double>(const OuterSeg<double>*, int64_t, int64_t,
                                                  cudaStream_t);

}  // namespace twinkle::kernels::cuda
