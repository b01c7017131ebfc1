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
  c10::intrusive_ptr<c10d::TCPStore> server;  // rank 0: the rendezvous store, for good
  c10::intrusive_ptr<c10d::Backend> backend;  // this epoch's group; null until formed
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
  if (options.epoch < 0) return absl::InvalidArgumentError(absl::StrCat("bad group epoch ", options.epoch));
  std::unique_ptr<ProcessGroup> group(new ProcessGroup());
  group->rank_ = options.rank;
  group->world_size_ = options.world_size;
  group->options_ = options;
  group->device_ = device;
  group->epoch_ = options.epoch;
  group->impl_ = std::make_unique<Impl>();
  if (device.is_cpu()) {
    group->backend_name_ = "gloo";
  } else if (device.is_cuda()) {
#if defined(TWINKLE_WITH_CUDA) && defined(USE_C10D_NCCL)
    group->backend_name_ = "nccl";
#else
    return absl::UnimplementedError(
        "data parallelism over cuda devices needs an engine built with TWINKLE_WITH_CUDA=1 (NCCL)");
#endif
  } else {
    return absl::UnimplementedError(absl::StrCat("no process group backend for device ", device.str()));
  }
  if (options.rank == 0) {
    try {
      c10d::TCPStoreOptions store_options;
      store_options.port = static_cast<uint16_t>(options.store_port);
      store_options.isServer = true;
      store_options.waitWorkers = false;  // the ranks meet at the first collective
      store_options.timeout = options.timeout;
      group->impl_->server = c10::make_intrusive<c10d::TCPStore>(options.store_host, store_options);
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("rank 0 of ", options.world_size, ": cannot serve the rendezvous at ",
                                                 options.store_host, ":", options.store_port, ": ", e.what()));
    }
  }
  return group;
}

absl::Status ProcessGroup::Connect() {
  if (impl_->backend) return absl::OkStatus();
  try {
    c10::intrusive_ptr<c10d::TCPStore> tcp = impl_->server;
    if (!tcp) {
      c10d::TCPStoreOptions store_options;
      store_options.port = static_cast<uint16_t>(options_.store_port);
      store_options.isServer = false;
      store_options.timeout = options_.timeout;
      tcp = c10::make_intrusive<c10d::TCPStore>(options_.store_host, store_options);
    }
    // One prefix per backend and epoch: a group formed after a rank was replaced never reads
    // an earlier epoch's keys.
    auto store = c10::make_intrusive<c10d::PrefixStore>(absl::StrCat("twinkle/", backend_name_, "/", epoch_), tcp);
    if (device_.is_cpu()) {
      auto gloo = c10d::ProcessGroupGloo::Options::create(options_.timeout);
      gloo->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(options_.store_host));
      impl_->backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank_, world_size_, gloo);
    } else {
#if defined(TWINKLE_WITH_CUDA) && defined(USE_C10D_NCCL)
      auto nccl = c10d::ProcessGroupNCCL::Options::create();
      nccl->timeout = options_.timeout;
      impl_->backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank_, world_size_, nccl);
#endif
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("rank ", rank_, " of ", world_size_, ": cannot form the process group (epoch ",
                                               epoch_, ") at ", options_.store_host, ":", options_.store_port, ": ",
                                               e.what()));
  }
  return absl::OkStatus();
}

absl::Status ProcessGroup::Rejoin(int64_t epoch) {
  if (epoch < epoch_) {
    return absl::InvalidArgumentError(absl::StrCat("group epoch ", epoch, " is older than this rank's ", epoch_));
  }
  impl_->backend.reset();
  epoch_ = epoch;
  return absl::OkStatus();
}

absl::Status ProcessGroup::AllReduceSum(at::Tensor& tensor) {
  if (absl::Status s = Connect(); !s.ok()) return s;
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
