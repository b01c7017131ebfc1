#include "core/engine/distributed.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#if defined(TWINKLE_WITH_CUDA) && defined(USE_C10D_NCCL)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "absl/strings/str_cat.h"

namespace twinkle::engine {

struct ProcessGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
};

ProcessGroup::~ProcessGroup() = default;

absl::StatusOr<std::unique_ptr<ProcessGroup>> ProcessGroup::Create(const DistributedOptions& options,
                                                                   c10::Device device) {
  if (options.world_size < 2) {
    return absl::InvalidArgumentError("a process group needs a world size of 2 or more");
  }
  if (options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", options.rank, " is outside the world of ", options.world_size));
  }
  if (options.store_port <= 0 || options.store_port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("bad rendezvous port ", options.store_port));
  }
  std::unique_ptr<ProcessGroup> group(new ProcessGroup());
  group->rank_ = options.rank;
  group->world_size_ = options.world_size;
  group->impl_ = std::make_unique<Impl>();
  try {
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<uint16_t>(options.store_port);
    store_options.isServer = options.rank == 0;
    store_options.numWorkers = options.world_size;
    store_options.waitWorkers = true;
    store_options.timeout = options.timeout;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(options.store_host, store_options);
    // One prefix per backend, so a later second group (another device kind) never reads
    // this one's keys.
    group->impl_->store = c10::make_intrusive<c10d::PrefixStore>(
        device.is_cuda() ? "twinkle/nccl" : "twinkle/gloo", tcp);
    if (device.is_cpu()) {
      auto gloo = c10d::ProcessGroupGloo::Options::create(options.timeout);
      gloo->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(options.store_host));
      group->impl_->backend = c10::make_intrusive<c10d::ProcessGroupGloo>(
          group->impl_->store, options.rank, options.world_size, gloo);
      group->backend_name_ = "gloo";
    } else if (device.is_cuda()) {
#if defined(TWINKLE_WITH_CUDA) && defined(USE_C10D_NCCL)
      auto nccl = c10d::ProcessGroupNCCL::Options::create();
      nccl->timeout = options.timeout;
      group->impl_->backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(
          group->impl_->store, options.rank, options.world_size, nccl);
      group->backend_name_ = "nccl";
#else
      return absl::UnimplementedError(
          "data parallelism over cuda devices needs an engine built with TWINKLE_WITH_CUDA=1 (NCCL)");
#endif
    } else {
      return absl::UnimplementedError(absl::StrCat("no process group backend for device ", device.str()));
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("rank ", options.rank, " of ", options.world_size,
                                               ": cannot join the process group at ", options.store_host,
                                               ":", options.store_port, ": ", e.what()));
  }
  return group;
}

absl::Status ProcessGroup::AllReduceSum(at::Tensor& tensor) {
  try {
    std::vector<at::Tensor> tensors{tensor};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    impl_->backend->allreduce(tensors, opts)->wait();
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("all-reduce over ", world_size_, " ranks (", backend_name_,
                                               ") failed: ", e.what()));
  }
  return absl::OkStatus();
}

}  // namespace twinkle::engine
