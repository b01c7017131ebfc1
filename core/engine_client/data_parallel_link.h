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
// An op is split datum by datum only when its loss is a sum over datums (the Tinker losses,
// or no loss); an op with another loss (Twinkle's mean and preference losses) goes whole to
// one rank, since its value depends on all of its datums together.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/engine_client/supervisor.h"
#include "core/engine_client/supervisor_engine_link.h"
#include "core/ipc/envelope.h"
#include "core/training/engine_link.h"

namespace twinkle {

// Whether an op with this loss may have its datums split over ranks (its loss, gradient and
// ":sum" metrics are sums over datums). "" (no loss: forward only) is.
bool LossSplitsOverDatums(const std::string& loss_name);

// A forward/forward_backward request split over ranks, and how to put the replies back.
struct ForwardSplit {
  // One request per rank; a rank with nothing to do has none (has_request false). With
  // backward, every rank has one (a rank without rows still joins the all-reduce).
  std::vector<ipc::Message> requests;
  std::vector<bool> has_request;
  std::vector<int64_t> tokens;  // per rank
  // Per rank, per op of its request: the request's op index, and per datum the op's datum index.
  struct RankOp {
    size_t op = 0;
    std::vector<size_t> datums;
  };
  std::vector<std::vector<RankOp>> placement;
  // Per original op: its datum count, and whether it was split over several ranks.
  std::vector<size_t> op_datums;
  std::vector<int64_t> op_tokens;
};

// Splits `request` (method forward or forward_backward) over `world_size` ranks: units (a
// datum of a splittable op, or a whole op otherwise) go in order to the rank with the
// fewest tokens so far.
absl::StatusOr<ForwardSplit> SplitForward(const ipc::Message& request, int32_t world_size);

// Merges the ranks' replies (index = rank; entries without a request are ignored) into the
// reply the unsplit request would have had. Per-op metrics: ":sum" keys add, ":max" and
// ":min" keys take the extreme, other keys (":mean") the token-weighted mean over ranks.
absl::StatusOr<ipc::Message> MergeForward(const ForwardSplit& split, std::vector<ipc::Message> replies);

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
