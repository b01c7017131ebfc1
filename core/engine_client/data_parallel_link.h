#pragma once
// Data parallelism over the training ranks, from the coordinator's side (docs/device_pool.md).
// The training coordinator sees one engine; this link spreads each call over the ranks of
// the supervisor's data-parallel group:
//   - forward / forward_backward: the fused batch's datums are split over the ranks by
//     tokens, each rank runs its share, and the replies are merged back into the request's
//     order. forward_backward names every adapter the step trains (allreduce_adapters), and
//     the ranks sum those adapters' gradients with one c10d all-reduce, so every rank holds
//     the gradient of the whole batch;
//   - calls that change adapter state (create/remove, optim_step, zero_grad, set_optimizer,
//     clip_grad_norm, set_adapter_state) go to every rank, so all hold identical replicas;
//   - everything else (get_adapter_state, sampling, export) goes to rank 0.
// The split and merge themselves are core/ipc/forward_split.h (shared with the engine's
// passes under an activation-memory budget).

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/engine_client/supervisor.h"
#include "core/engine_client/supervisor_engine_link.h"
#include "core/ipc/envelope.h"
#include "core/ipc/forward_split.h"
#include "core/training/engine_link.h"

namespace twinkle {

class DataParallelLink final : public SupervisorModelLink {
 public:
  // Ranks 0 .. world_size-1 of `supervisor` (which runs them as one data-parallel group).
  DataParallelLink(Supervisor& supervisor, int32_t world_size);

  absl::StatusOr<ipc::Message> Call(ipc::Message request) override;
  // The group restarts as a whole, so rank 0's generation is the group's.
  uint64_t generation() const override { return supervisor_.engine_generation(0); }

  int32_t world_size() const { return world_size_; }
  // Tokens each rank has run in forward and forward_backward calls through this link.
  std::vector<int64_t> rank_tokens() const;

 private:
  // Sends one request per rank that has one, waits for all; index = rank.
  std::vector<absl::StatusOr<ipc::Message>> CallRanks(std::vector<ipc::Message> requests,
                                                      const std::vector<bool>& send);

  const int32_t world_size_;
  std::unique_ptr<std::atomic<int64_t>[]> rank_tokens_;
};

}  // namespace twinkle
