// CUDA backend of kernels/sgmv.h: turns a task list into a device-resident segment table and
// launches one kernel over all segments on the current stream of the tensors' device.
// Compiled by the host compiler (LibTorch headers stay out of nvcc); needs the toolkit's
// include dir only for <cuda_runtime_api.h>.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/cuda/sgmv_kernels.h"
#include "kernels/cuda/sgmv_tables.h"
#include "kernels/sgmv.h"

namespace twinkle::kernels {
namespace {

// Copies the descriptors to the device without stalling the stream: a pinned staging buffer
// and an asynchronous copy on the current stream, which orders it before the launch. ATen's
// host allocator keeps the pinned block alive until the copy has run.
template <typename Desc>
at::Tensor UploadTable(const std::vector<Desc>& descs, const at::Device& device) {
  static_assert(std::is_trivially_copyable_v<Desc>);
  const int64_t bytes = static_cast<int64_t>(descs.size() * sizeof(Desc));
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), descs.data(), bytes);
  // Device allocations are at least 256-byte aligned, so the table is aligned for Desc.
  return host.to(device, /*non_blocking=*/true);
}

void CheckTiles(int64_t tiles) {
  TORCH_CHECK(tiles <= cuda::kMaxTiles, "sgmv cuda: ", tiles, " output tiles exceed one launch's ",
              cuda::kMaxTiles);
}

template <typename T>
void LaunchMatmul(const std::vector<MatmulTask>& tasks) {
  const cuda::MatmulTable<T> table = cuda::BuildMatmulTable<T>(tasks);
  CheckTiles(table.tiles);
  if (table.tiles == 0) return;
  const at::Device device = tasks[0].out.device();
  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor segs = UploadTable(table.segs, device);
  C10_CUDA_CHECK(cuda::LaunchSegmentedMatmul<T>(
      reinterpret_cast<const cuda::MatmulSeg<T>*>(segs.const_data_ptr()),
      static_cast<int64_t>(table.segs.size()), table.tiles,
      c10::cuda::getCurrentCUDAStream(device.index()).stream()));
}

template <typename T>
void LaunchOuter(const std::vector<OuterTask>& tasks) {
  const cuda::OuterTable<T> table = cuda::BuildOuterTable<T>(tasks);
  CheckTiles(table.tiles);
  if (table.tiles == 0) return;
  const at::Device device = tasks[0].out.device();
  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor segs = UploadTable(table.segs, device);
  C10_CUDA_CHECK(cuda::LaunchSegmentedOuter<T>(
      reinterpret_cast<const cuda::OuterSeg<T>*>(segs.const_data_ptr()),
      static_cast<int64_t>(table.segs.size()), table.tiles,
      c10::cuda::getCurrentCUDAStream(device.index()).stream()));
}

}  // namespace

void SegmentedMatmulCuda(const std::vector<MatmulTask>& tasks) {
  CheckTasks(tasks);
  if (tasks.empty()) return;
  if (tasks[0].out.scalar_type() == at::kDouble) {
    LaunchMatmul<double>(tasks);
  } else {
    LaunchMatmul<float>(tasks);
  }
}

void SegmentedOuterCuda(const std::vector<OuterTask>& tasks) {
  CheckTasks(tasks);
  if (tasks.empty()) return;
  if (tasks[0].out.scalar_type() == at::kDouble) {
    LaunchOuter<double>(tasks);
  } else {
    LaunchOuter<float>(tasks);
  }
}

}  // namespace twinkle::kernels
