#pragma once
// The training ranks' process group (docs/device_pool.md): LibTorch's c10d, with
// ProcessGroupGloo for CPU workers and ProcessGroupNCCL for CUDA ones (TWINKLE_WITH_CUDA
// builds), rendezvous through a c10d TCPStore that rank 0 serves. Data parallelism needs
// one collective: the sum of the LoRA gradients of a fused step over the ranks that each
// ran a share of its rows (Trainer::Forward). No home-made collectives.
//
// c10d stays out of this header (pimpl), so only distributed.cc sees its headers.

#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace at {
class Tensor;
}

namespace twinkle::engine {

struct DistributedOptions {
  int32_t rank = 0;
  int32_t world_size = 1;  // 1: no process group
  std::string store_host = "127.0.0.1";
  int32_t store_port = 0;  // rank 0 serves the TCPStore on it; the others connect
  // How long a rendezvous or a collective waits for the other ranks before failing.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
};

class ProcessGroup {
 public:
  // Joins the group (blocks until every rank has joined, or the timeout). `device` picks the
  // backend: Gloo for cpu, NCCL for cuda (Unimplemented in a build without CUDA).
  static absl::StatusOr<std::unique_ptr<ProcessGroup>> Create(const DistributedOptions& options,
                                                              c10::Device device);
  ~ProcessGroup();

  int32_t rank() const { return rank_; }
  int32_t world_size() const { return world_size_; }
  const std::string& backend() const { return backend_name_; }

  // Sums `tensor` (contiguous, on the group's device) over all ranks in place. Every rank
  // must call it with the same shape and dtype, in the same order. A peer that died or a
  // timeout is an error; the group is unusable afterwards.
  absl::Status AllReduceSum(at::Tensor& tensor);

 private:
  ProcessGroup() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int32_t rank_ = 0;
  int32_t world_size_ = 1;
  std::string backend_name_;
};

}  // namespace twinkle::engine
