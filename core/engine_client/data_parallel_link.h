#pragma once
// Data parallelism over the training ranks, from the coordinator's side (docs/device_pool.md).
// The training coordinator sees one engine; this link places its calls on the ranks of the
// supervisor's data-parallel group:
//   - every adapter has a home rank, which alone holds its weights, gradients and optimizer
//     state: create_adapter picks the ready rank with the fewest adapters, and every call
//     naming the adapter (optim_step, get/set_adapter_state, ...) goes there;
//   - forward / forward_backward, per fused step, per adapter: rows of an adapter within
//     `rank_token_budget` tokens run on its home rank (adapter sharding: each rank runs a
//     fused step over its own adapters, at the same time, no collective); an adapter above it
//     has its rows split over every rank (batch splitting), which hold a transient copy of
//     it for the step, and its gradients are summed over the ranks into the home rank's
//     (one c10d all-reduce), equal to the one-rank step;
//   - adapters move between ranks, with their exact state (weights, gradients, optimizer
//     state, micro-batch count), to even out the ranks' recent tokens;
//   - a rank that restarted alone dropped only the adapters it was home to (Dropped);
//   - calls naming no adapter go to rank 0.
// One caller at a time (the training coordinator's scheduler thread): a move and a call for
// the same adapter never overlap.
// The split and merge themselves are core/ipc/forward_split.h (shared with the engine's
// passes under an activation-memory budget).

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/engine_client/supervisor.h"
#include "core/engine_client/supervisor_engine_link.h"
#include "core/ipc/envelope.h"
#include "core/ipc/forward_split.h"
#include "core/ipc/training_messages.h"
#include "core/training/engine_link.h"

namespace twinkle {

struct DataParallelOptions {
  // engine.rank_token_budget: an adapter whose rows in one fused forward_backward are above
  // this many tokens has them split over every rank; at or below, they run on its home rank.
  // 0: every trained adapter's rows are split (no sharding).
  int64_t rank_token_budget = 4096;
  // engine.rebalance: move adapters from the busiest rank to the idlest (at most one move
  // per step, an adapter at most once every kMoveCooldownSteps steps).
  bool rebalance = true;
};

class DataParallelLink final : public SupervisorModelLink {
 public:
  // A moved adapter stays on its new rank at least this many forward_backward steps.
  static constexpr int64_t kMoveCooldownSteps = 16;

  // Ranks 0 .. world_size-1 of `supervisor` (which runs them as one data-parallel group).
  DataParallelLink(Supervisor& supervisor, int32_t world_size, DataParallelOptions options = {});

  absl::StatusOr<ipc::Message> Call(ipc::Message request) override;
  // Changes whenever any rank reloads the model (the sum of the ranks' generations).
  uint64_t generation() const override;
  bool Dropped(const std::string& adapter_key) override;

  int32_t world_size() const { return world_size_; }
  // Tokens each rank has run in forward and forward_backward calls through this link.
  std::vector<int64_t> rank_tokens() const;
  // The adapter's home rank; -1 when the link does not know it.
  int32_t home_rank(const std::string& adapter_key) const;
  // Moves the adapter's whole state to rank `to` (create there, set its state, remove from
  // the old home). On failure the adapter stays where it was.
  absl::Status MoveAdapter(const std::string& adapter_key, int32_t to);
  int64_t moves() const;

 private:
  struct Home {
    int32_t rank = 0;
    uint64_t generation = 0;  // of the home rank's process that holds it (created or moved there)
    double load = 0;          // its tokens, halved every forward_backward step
    int64_t moved_at_step = -kMoveCooldownSteps;
  };
  // Sends one request per rank that has one, waits for all; index = rank. With
  // `served_generations`: each replying rank's process generation (Supervisor::Call).
  std::vector<absl::StatusOr<ipc::Message>> CallRanks(std::vector<ipc::Message> requests,
                                                      const std::vector<bool>& send,
                                                      std::vector<uint64_t>* served_generations = nullptr);
  absl::StatusOr<ipc::Message> CreateAdapter(ipc::Message request);
  absl::StatusOr<ipc::Message> RunStep(ipc::Message request);
  // An adapter's state as get_adapter_state returned it (frames in `message`).
  struct AdapterState {
    ipc::Message message;
    ipc::AdapterStateReply body;
  };
  absl::StatusOr<AdapterState> ReadState(const std::string& key, int32_t rank);
  // Creates `key` on the ranks `on` and sets `set` (which refers to `from`'s frames) there;
  // `served_generations`: per rank, the process generation that now holds it.
  absl::Status Install(const std::string& key, const AdapterState& from, const ipc::SetAdapterStateRequest& set,
                       const std::vector<bool>& on, std::vector<uint64_t>* served_generations = nullptr);
  void RemoveFrom(const std::string& key, const std::vector<bool>& on);
  std::vector<bool> OnlyRank(int32_t rank) const;
  std::vector<bool> AllRanksBut(int32_t rank) const;
  // Copies `key`'s state from its home to every other rank (the step's transient copies).
  absl::Status CopyToOtherRanks(const std::string& key, int32_t home);
  void RemoveCopies(const std::vector<std::pair<std::string, int32_t>>& copies);
  void Rebalance(const std::vector<bool>& ready);
  std::vector<bool> ReadyRanks() const;
  int32_t RankOf(const std::string& adapter_key) const;  // home, or 0 when unknown

  const int32_t world_size_;
  const DataParallelOptions options_;
  std::unique_ptr<std::atomic<int64_t>[]> rank_tokens_;
  mutable absl::Mutex mu_;
  std::map<std::string, Home> homes_ ABSL_GUARDED_BY(mu_);
  int64_t steps_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t moves_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace twinkle
