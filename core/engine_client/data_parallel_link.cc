#include "core/engine_client/data_parallel_link.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/common/log.h"
#include "core/ipc/messages.h"
#include "core/ipc/training_messages.h"

namespace twinkle {
namespace {

bool IsBroadcast(const std::string& method) {
  for (const char* m : {ipc::kMethodCreateAdapter, ipc::kMethodRemoveAdapter, ipc::kMethodOptimStep,
                        ipc::kMethodZeroGrad, ipc::kMethodSetOptimizer, ipc::kMethodClipGradNorm,
                        ipc::kMethodSetAdapterState}) {
    if (method == m) return true;
  }
  return false;
}

}  // namespace

DataParallelLink::DataParallelLink(Supervisor& supervisor, int32_t world_size)
    : SupervisorModelLink(supervisor),
      world_size_(std::max(1, world_size)),
      rank_tokens_(new std::atomic<int64_t>[static_cast<size_t>(std::max(1, world_size))]) {
  for (int32_t r = 0; r < world_size_; ++r) rank_tokens_[r] = 0;
}

std::vector<int64_t> DataParallelLink::rank_tokens() const {
  std::vector<int64_t> out;
  for (int32_t r = 0; r < world_size_; ++r) out.push_back(rank_tokens_[r].load());
  return out;
}

std::vector<absl::StatusOr<ipc::Message>> DataParallelLink::CallRanks(std::vector<ipc::Message> requests,
                                                                      const std::vector<bool>& send) {
  const size_t n = requests.size();
  std::vector<absl::StatusOr<ipc::Message>> results(n, absl::StatusOr<ipc::Message>(ipc::Message{}));
  absl::Mutex mu;
  size_t pending = 0;
  for (size_t r = 0; r < n; ++r) pending += send[r] ? 1 : 0;
  for (size_t r = 0; r < n; ++r) {
    if (!send[r]) continue;
    supervisor_.Call(static_cast<int32_t>(r), std::move(requests[r]),
                     [&, r](absl::StatusOr<ipc::Message> reply) {
                       absl::MutexLock lock(&mu);
                       results[r] = std::move(reply);
                       --pending;
                     });
  }
  absl::MutexLock lock(&mu);
  mu.Await(absl::Condition(+[](size_t* p) { return *p == 0; }, &pending));
  return results;
}

absl::StatusOr<ipc::Message> DataParallelLink::Call(ipc::Message request) {
  const std::string& method = request.envelope.method;
  if (world_size_ == 1) return supervisor_.CallAndWait(0, std::move(request));
  if (method == ipc::kMethodForward || method == ipc::kMethodForwardBackward) {
    absl::StatusOr<ForwardSplit> split = SplitForward(request, world_size_);
    if (!split.ok()) return split.status();
    std::vector<absl::StatusOr<ipc::Message>> replies =
        CallRanks(std::move(split->requests), split->has_request);
    std::vector<ipc::Message> ok;
    for (size_t r = 0; r < replies.size(); ++r) {
      // The engine makes every rank fail a data-parallel step together; report rank 0's
      // error first, then the others' (a rank that went down: UNAVAILABLE).
      if (!replies[r].ok()) return replies[r].status();
      ok.push_back(*std::move(replies[r]));
    }
    std::string line = absl::StrCat(method, " over ", world_size_, " ranks: tokens");
    for (int32_t r = 0; r < world_size_; ++r) {
      const int64_t t = split->tokens[static_cast<size_t>(r)];
      rank_tokens_[r] += t;
      absl::StrAppend(&line, " rank", r, "=", t, " (total ", rank_tokens_[r].load(), ")");
    }
    Log(LogLevel::kDebug, "data-parallel", line);
    return MergeForward(*split, std::move(ok));
  }
  if (IsBroadcast(method)) {
    std::vector<ipc::Message> copies(static_cast<size_t>(world_size_), request);
    std::vector<absl::StatusOr<ipc::Message>> replies =
        CallRanks(std::move(copies), std::vector<bool>(static_cast<size_t>(world_size_), true));
    for (absl::StatusOr<ipc::Message>& reply : replies) {
      if (!reply.ok()) return reply.status();
    }
    return *std::move(replies[0]);
  }
  return supervisor_.CallAndWait(0, std::move(request));
}

}  // namespace twinkle
