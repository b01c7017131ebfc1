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
  int64_t epoch = 0;       // the group's membership epoch (the supervisor counts it)
  // How long a rendezvous or a collective waits for the other ranks before failing.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
};

// The group is formed lazily, at the first collective, and re-formed after a member was
// replaced: a rank restarted alone (docs/device_pool.md, "A rank's crash") rejoins the
// survivors under a new epoch. Rank 0 serves the TCPStore for the process's lifetime; each
// epoch's rendezvous keys live under their own prefix of it, so the survivors and the new
// rank meet on fresh keys without a new port.
class ProcessGroup {
 public:
  // Checks the options and, on rank 0, starts serving the rendezvous store; nothing waits for
  // the other ranks here. `device` picks the backend: Gloo for cpu, NCCL for cuda
  // (Unimplemented in a build without CUDA).
  static absl::StatusOr<std::unique_ptr<ProcessGroup>> Create(const DistributedOptions& options,
                                                              c10::Device device);
  ~ProcessGroup();

  int32_t rank() const { return rank_; }
  int32_t world_size() const { return world_size_; }
  const std::string& backend() const { return backend_name_; }

  // Sums `tensor` (contiguous, on the group's device) over all ranks in place, forming the
  // group first if this epoch has none yet (blocks until every rank has joined, or the
  // timeout). Every rank must call it with the same shape and dtype, in the same order. A
  // peer that died or a timeout is an error; the group stays unusable until Rejoin.
  absl::Status AllReduceSum(at::Tensor& tensor);

  // Drops the current group; the next collective forms a new one under `epoch` (every
  // member, the replaced rank included, uses the same epoch). Cheap: nothing waits here.
  absl::Status Rejoin(int64_t epoch);
  int64_t epoch() const { return epoch_; }

 private:
  ProcessGroup() = default;
  absl::Status Connect();
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int32_t rank_ = 0;
  int32_t world_size_ = 1;
  std::string backend_name_;
  DistributedOptions options_;
  c10::Device device_ = c10::Device(c10::kCPU);
  int64_t epoch_ = 0;
};

}  // namespace twinkle::engine
