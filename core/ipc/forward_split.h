#pragma once
// One fused forward / forward_backward request cut into parts, and the parts' replies put
// back together as the reply the whole request would have had. Two users, one mechanism:
//   - data parallelism (core/engine_client/data_parallel_link.h): parts = ranks, run at the
//     same time, datums spread by tokens (SplitForward);
//   - memory (engine.activation_memory_mib): parts = passes one engine runs one after the
//     other, each within the activation-memory budget, gradients accumulating across them
//     (SplitForwardIntoPasses; docs/architecture.md, "Training memory").
// A part is a unit list: a datum of an op whose loss is a sum over datums (its loss,
// gradient and ":sum" metrics add up over parts), or a whole op otherwise (Twinkle's mean
// and preference losses, whose value depends on all of the op's datums together).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/common/activation_memory.h"
#include "core/ipc/envelope.h"

namespace twinkle {

// Whether an op with this loss may have its datums split over parts (its loss, gradient and
// ":sum" metrics are sums over datums). "" (no loss: forward only) is.
bool LossSplitsOverDatums(const std::string& loss_name);

// A forward/forward_backward request split into parts, and how to put the replies back.
struct ForwardSplit {
  // One request per part; a part with nothing to do has none (has_request false). Ranks
  // with backward all have one (a rank without rows still joins the all-reduce).
  std::vector<ipc::Message> requests;
  std::vector<bool> has_request;
  std::vector<int64_t> tokens;  // per part
  // Per part, per op of its request: the request's op index, and per datum the op's datum index.
  struct PartOp {
    size_t op = 0;
    std::vector<size_t> datums;
  };
  std::vector<std::vector<PartOp>> placement;
  // Per original op: its datum count and tokens.
  std::vector<size_t> op_datums;
  std::vector<int64_t> op_tokens;
};

// An op_ranks entry: the op's units are spread over every rank.
inline constexpr int32_t kSpreadOverRanks = -1;

// Splits `request` (method forward or forward_backward) over `world_size` ranks. op_ranks
// gives, per op, the rank it runs on whole (its adapter's home rank: adapter sharding) or
// kSpreadOverRanks (batch splitting); empty = every op spread. Pinned ops are placed first;
// then the spread ops' units go in order to the rank with the fewest tokens so far. With
// world_size > 1 every rank's request names the adapters the spread ops train
// (allreduce_adapters), and every rank gets a request when that list is not empty (a rank
// without rows still joins the all-reduce).
absl::StatusOr<ForwardSplit> SplitForward(const ipc::Message& request, int32_t world_size,
                                          const std::vector<int32_t>& op_ranks = {});

// Splits `request` into sequential passes, each estimated (EstimateActivationBytes with
// `cost`) within `max_bytes`: units in request order fill a pass until the next would take
// it over. A unit estimated above max_bytes alone gets a pass of its own (admission refuses
// such requests before they reach an engine). The parts carry no allreduce_adapters and no
// max_pass_bytes: each is one plain pass.
absl::StatusOr<ForwardSplit> SplitForwardIntoPasses(const ipc::Message& request, const ActivationCost& cost,
                                                    int64_t max_bytes);

// Merges the parts' replies (index = part; entries without a request are ignored) into the
// reply the unsplit request would have had. Per-op metrics: ":sum" keys add, ":max" and
// ":min" keys take the extreme, other keys (":mean") the token-weighted mean over parts.
absl::StatusOr<ipc::Message> MergeForward(const ForwardSplit& split, std::vector<ipc::Message> replies);

}  // namespace twinkle
