#include "core/engine_client/data_parallel_link.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "core/common/log.h"
#include "core/ipc/messages.h"
#include "core/ipc/training_messages.h"

namespace twinkle {
namespace {

constexpr char kLog[] = "data-parallel";

// Methods whose body names one adapter (adapter_id) and that go to its home rank.
bool NamesAdapter(const std::string& method) {
  for (const char* m : {ipc::kMethodRemoveAdapter, ipc::kMethodOptimStep, ipc::kMethodZeroGrad,
                        ipc::kMethodSetOptimizer, ipc::kMethodClipGradNorm, ipc::kMethodGetAdapterState,
                        ipc::kMethodSetAdapterState}) {
    if (method == m) return true;
  }
  return false;
}

int64_t Tokens(const ipc::TrainOpMsg& op) {
  int64_t tokens = 0;
  for (const ipc::DatumMsg& d : op.datums) {
    int64_t n = 1;
    for (int64_t dim : d.input_tokens.shape) n *= dim;
    tokens += n;
  }
  return tokens;
}

// The adapter an op runs with ("" = base model rows, which every rank can run).
const std::string& OpAdapter(const ipc::TrainOpMsg& op) {
  static const std::string kNone;
  return op.disable_adapter ? kNone : op.adapter_id;
}

}  // namespace

DataParallelLink::DataParallelLink(Supervisor& supervisor, int32_t world_size, DataParallelOptions options)
    : SupervisorModelLink(supervisor),
      world_size_(std::max(1, world_size)),
      options_(options),
      rank_tokens_(new std::atomic<int64_t>[static_cast<size_t>(std::max(1, world_size))]) {
  for (int32_t r = 0; r < world_size_; ++r) rank_tokens_[r] = 0;
}

std::vector<int64_t> DataParallelLink::rank_tokens() const {
  std::vector<int64_t> out;
  for (int32_t r = 0; r < world_size_; ++r) out.push_back(rank_tokens_[r].load());
  return out;
}

uint64_t DataParallelLink::generation() const {
  uint64_t sum = 0;
  for (int32_t r = 0; r < world_size_; ++r) sum += supervisor_.engine_generation(r);
  return sum;
}

bool DataParallelLink::Dropped(const std::string& adapter_key) {
  absl::MutexLock lock(&mu_);
  auto it = homes_.find(adapter_key);
  if (it == homes_.end()) return true;
  if (supervisor_.engine_generation(it->second.rank) == it->second.generation) return false;
  homes_.erase(it);
  return true;
}

int32_t DataParallelLink::home_rank(const std::string& adapter_key) const {
  absl::MutexLock lock(&mu_);
  auto it = homes_.find(adapter_key);
  return it == homes_.end() ? -1 : it->second.rank;
}

int32_t DataParallelLink::RankOf(const std::string& adapter_key) const {
  const int32_t rank = home_rank(adapter_key);
  return rank < 0 ? 0 : rank;
}

int64_t DataParallelLink::moves() const {
  absl::MutexLock lock(&mu_);
  return moves_;
}

std::vector<bool> DataParallelLink::ReadyRanks() const {
  std::vector<bool> ready(static_cast<size_t>(world_size_), false);
  for (const WorkerSnapshot& w : supervisor_.Snapshot()) {
    if (w.rank >= 0 && w.rank < world_size_) ready[static_cast<size_t>(w.rank)] = w.ready;
  }
  return ready;
}

std::vector<absl::StatusOr<ipc::Message>> DataParallelLink::CallRanks(std::vector<ipc::Message> requests,
                                                                      const std::vector<bool>& send,
                                                                      std::vector<uint64_t>* served_generations) {
  const size_t n = requests.size();
  if (served_generations != nullptr) served_generations->assign(n, 0);
  std::vector<absl::StatusOr<ipc::Message>> results(n, absl::StatusOr<ipc::Message>(ipc::Message{}));
  absl::Mutex mu;
  size_t pending = 0;
  for (size_t r = 0; r < n; ++r) pending += send[r] ? 1 : 0;
  for (size_t r = 0; r < n; ++r) {
    if (!send[r]) continue;
    supervisor_.Call(
        static_cast<int32_t>(r), std::move(requests[r]),
        [&, r](absl::StatusOr<ipc::Message> reply) {
          absl::MutexLock lock(&mu);
          results[r] = std::move(reply);
          --pending;
        },
        served_generations != nullptr ? &(*served_generations)[r] : nullptr);
  }
  absl::MutexLock lock(&mu);
  mu.Await(absl::Condition(+[](size_t* p) { return *p == 0; }, &pending));
  return results;
}

absl::StatusOr<ipc::Message> DataParallelLink::Call(ipc::Message request) {
  const std::string method = request.envelope.method;
  if (world_size_ == 1) return supervisor_.CallAndWait(0, std::move(request));
  if (method == ipc::kMethodForward || method == ipc::kMethodForwardBackward) return RunStep(std::move(request));
  if (method == ipc::kMethodCreateAdapter) return CreateAdapter(std::move(request));
  if (!NamesAdapter(method)) return supervisor_.CallAndWait(0, std::move(request));
  absl::StatusOr<ipc::AdapterRequest> named = ipc::Unpack<ipc::AdapterRequest>(request.envelope.body, method);
  if (!named.ok()) return named.status();
  absl::StatusOr<ipc::Message> reply = supervisor_.CallAndWait(RankOf(named->adapter_id), std::move(request));
  if (method == ipc::kMethodRemoveAdapter && (reply.ok() || absl::IsNotFound(reply.status()))) {
    absl::MutexLock lock(&mu_);
    homes_.erase(named->adapter_id);
  }
  return reply;
}

absl::StatusOr<ipc::Message> DataParallelLink::CreateAdapter(ipc::Message request) {
  absl::StatusOr<ipc::CreateAdapterRequest> create =
      ipc::Unpack<ipc::CreateAdapterRequest>(request.envelope.body, ipc::kMethodCreateAdapter);
  if (!create.ok()) return create.status();
  // The home: the ready rank with the fewest adapters (the lowest such rank on a tie).
  const std::vector<bool> ready = ReadyRanks();
  int32_t home = 0;
  {
    absl::MutexLock lock(&mu_);
    std::vector<int64_t> count(static_cast<size_t>(world_size_), 0);
    for (const auto& [key, h] : homes_) {
      if (key != create->adapter_id) ++count[static_cast<size_t>(h.rank)];
    }
    int64_t best = -1;
    for (int32_t r = 0; r < world_size_; ++r) {
      if (!ready[static_cast<size_t>(r)]) continue;
      if (best < 0 || count[static_cast<size_t>(r)] < best) {
        best = count[static_cast<size_t>(r)];
        home = r;
      }
    }
  }
  uint64_t generation = 0;  // of the process that created it (a restart right after drops it)
  absl::StatusOr<ipc::Message> reply = supervisor_.CallAndWait(home, std::move(request), &generation);
  if (reply.ok()) {
    absl::MutexLock lock(&mu_);
    homes_[create->adapter_id] = Home{home, generation, 0, -kMoveCooldownSteps};
    Log(LogLevel::kDebug, kLog, absl::StrCat("adapter ", create->adapter_id, ": home rank ", home));
  }
  return reply;
}

absl::StatusOr<DataParallelLink::AdapterState> DataParallelLink::ReadState(const std::string& key, int32_t rank) {
  absl::StatusOr<ipc::Message> message =
      supervisor_.CallAndWait(rank, ipc::MakeRequest(ipc::kMethodGetAdapterState, ipc::Pack(ipc::AdapterRequest{key})));
  if (!message.ok()) return message.status();
  absl::StatusOr<ipc::AdapterStateReply> body =
      ipc::Unpack<ipc::AdapterStateReply>(message->envelope.body, "get_adapter_state reply");
  if (!body.ok()) return body.status();
  return AdapterState{*std::move(message), *std::move(body)};
}

absl::Status DataParallelLink::Install(const std::string& key, const AdapterState& from,
                                       const ipc::SetAdapterStateRequest& set, const std::vector<bool>& on,
                                       std::vector<uint64_t>* served_generations) {
  ipc::CreateAdapterRequest config = from.body.config;
  config.adapter_id = key;
  std::vector<ipc::Message> creates, sets;
  for (int32_t r = 0; r < world_size_; ++r) {
    creates.push_back(ipc::MakeRequest(ipc::kMethodCreateAdapter, ipc::Pack(config)));
    sets.push_back(ipc::MakeRequest(ipc::kMethodSetAdapterState, ipc::Pack(set), from.message.buffers));
  }
  for (auto* calls : {&creates, &sets}) {
    // The generations that count are those that took the state (a create and its set on
    // two processes of a rank cannot both succeed: the new one has no adapter to set).
    for (absl::StatusOr<ipc::Message>& reply :
         CallRanks(std::move(*calls), on, calls == &sets ? served_generations : nullptr)) {
      if (!reply.ok()) return reply.status();
    }
  }
  return absl::OkStatus();
}

void DataParallelLink::RemoveFrom(const std::string& key, const std::vector<bool>& on) {
  std::vector<ipc::Message> removes;
  for (int32_t r = 0; r < world_size_; ++r) {
    removes.push_back(ipc::MakeRequest(ipc::kMethodRemoveAdapter, ipc::Pack(ipc::AdapterRequest{key})));
  }
  (void)CallRanks(std::move(removes), on);  // a rank that went down took its copy with it
}

std::vector<bool> DataParallelLink::OnlyRank(int32_t rank) const {
  std::vector<bool> on(static_cast<size_t>(world_size_), false);
  on[static_cast<size_t>(rank)] = true;
  return on;
}

std::vector<bool> DataParallelLink::AllRanksBut(int32_t rank) const {
  std::vector<bool> on(static_cast<size_t>(world_size_), true);
  on[static_cast<size_t>(rank)] = false;
  return on;
}

absl::Status DataParallelLink::MoveAdapter(const std::string& key, int32_t to) {
  if (to < 0 || to >= world_size_) return absl::InvalidArgumentError(absl::StrCat("no rank ", to));
  const int32_t from = home_rank(key);
  if (from < 0) return absl::NotFoundError(absl::StrCat("no adapter '", key, "' on the data-parallel group"));
  if (from == to) return absl::OkStatus();
  absl::StatusOr<AdapterState> state = ReadState(key, from);
  if (!state.ok()) return state.status();
  std::vector<uint64_t> installed_in;  // per rank: the generation of the process that took it
  if (absl::Status s = Install(key, *state, ipc::RestoreRequestOf(state->body, key), OnlyRank(to), &installed_in);
      !s.ok()) {
    RemoveFrom(key, OnlyRank(to));
    return s;
  }
  RemoveFrom(key, OnlyRank(from));
  absl::MutexLock lock(&mu_);
  auto it = homes_.find(key);
  if (it != homes_.end()) {
    it->second.rank = to;
    it->second.generation = installed_in[static_cast<size_t>(to)];
    it->second.moved_at_step = steps_;
  }
  ++moves_;
  Log(LogLevel::kInfo, kLog, absl::StrCat("moved adapter ", key, " from rank ", from, " to rank ", to));
  return absl::OkStatus();
}

void DataParallelLink::Rebalance(const std::vector<bool>& ready) {
  if (!options_.rebalance || std::find(ready.begin(), ready.end(), false) != ready.end()) return;
  std::string candidate;
  int32_t to = 0;
  {
    absl::MutexLock lock(&mu_);
    std::vector<double> load(static_cast<size_t>(world_size_), 0);
    double total = 0;
    for (const auto& [key, h] : homes_) {
      load[static_cast<size_t>(h.rank)] += h.load;
      total += h.load;
    }
    const auto hi = static_cast<int32_t>(std::max_element(load.begin(), load.end()) - load.begin());
    to = static_cast<int32_t>(std::min_element(load.begin(), load.end()) - load.begin());
    const double gap = load[static_cast<size_t>(hi)] - load[static_cast<size_t>(to)];
    // Only a clear imbalance (the gap above half the mean load) is worth a move.
    if (total <= 0 || gap <= 0.5 * total / world_size_) return;
    // The adapter whose move narrows the gap most: its load closest to half the gap (a load
    // of the whole gap or more would only swap the ranks' roles).
    double best = 0;
    for (const auto& [key, h] : homes_) {
      if (h.rank != hi || h.load <= 0 || h.load >= gap || steps_ - h.moved_at_step < kMoveCooldownSteps) continue;
      const double narrowed = std::min(h.load, gap - h.load);
      if (narrowed > best) {
        best = narrowed;
        candidate = key;
      }
    }
  }
  if (candidate.empty()) return;
  if (absl::Status s = MoveAdapter(candidate, to); !s.ok()) {
    Log(LogLevel::kWarning, kLog, absl::StrCat("moving adapter ", candidate, " to rank ", to, " failed (it stays): ",
                                               s.message()));
  }
}

absl::Status DataParallelLink::CopyToOtherRanks(const std::string& key, int32_t home) {
  absl::StatusOr<AdapterState> state = ReadState(key, home);
  if (!state.ok()) return state.status();
  // The copies' gradients start empty: the step's all-reduce sums only what it adds, and the
  // home rank alone keeps the accumulated gradient.
  ipc::SetAdapterStateRequest set = ipc::RestoreRequestOf(state->body, key);
  set.grads = std::map<std::string, ipc::TensorDesc>{};
  return Install(key, *state, set, AllRanksBut(home));
}

void DataParallelLink::RemoveCopies(const std::vector<std::pair<std::string, int32_t>>& copies) {
  for (const auto& [key, home] : copies) RemoveFrom(key, AllRanksBut(home));
}

absl::StatusOr<ipc::Message> DataParallelLink::RunStep(ipc::Message request) {
  const std::string method = request.envelope.method;
  const bool backward = method == ipc::kMethodForwardBackward;
  absl::StatusOr<ipc::ForwardRequest> req = ipc::Unpack<ipc::ForwardRequest>(request.envelope.body, method);
  if (!req.ok()) return req.status();
  const std::vector<bool> ready = ReadyRanks();
  const bool all_ready = std::find(ready.begin(), ready.end(), false) == ready.end();
  if (backward) Rebalance(ready);

  // Per trained adapter: its tokens in this step, and whether its rows may be split (every
  // op of it has a loss that sums over datums, and it has two datums or more).
  struct Trained {
    int64_t tokens = 0;
    size_t datums = 0;
    bool splittable = true;
  };
  std::map<std::string, Trained> trained;
  for (const ipc::TrainOpMsg& op : req->ops) {
    if (!backward || OpAdapter(op).empty() || op.loss.name.empty()) continue;
    Trained& t = trained[op.adapter_id];
    t.tokens += Tokens(op);
    t.datums += op.datums.size();
    t.splittable = t.splittable && LossSplitsOverDatums(op.loss.name);
  }
  // Batch splitting only with every rank up (a split step needs them all); otherwise each
  // adapter's rows stay home and the engine runs them in passes if they exceed its memory.
  std::set<std::string> spread;
  std::vector<std::pair<std::string, int32_t>> copies;
  for (const auto& [key, t] : trained) {
    if (all_ready && t.splittable && t.datums > 1 && t.tokens > options_.rank_token_budget) spread.insert(key);
  }
  std::vector<int32_t> op_ranks;
  for (const ipc::TrainOpMsg& op : req->ops) {
    const std::string& key = OpAdapter(op);
    op_ranks.push_back(key.empty() || spread.count(key) ? kSpreadOverRanks : RankOf(key));
  }
  for (const std::string& key : spread) {
    const int32_t home = RankOf(key);
    copies.emplace_back(key, home);
    if (absl::Status s = CopyToOtherRanks(key, home); !s.ok()) {
      RemoveCopies(copies);
      return absl::Status(s.code(), absl::StrCat("copying adapter '", key, "' to the other ranks for a split step: ",
                                                 s.message()));
    }
  }
  absl::StatusOr<ForwardSplit> split = SplitForward(request, world_size_, op_ranks);
  if (!split.ok()) {
    RemoveCopies(copies);
    return split.status();
  }
  std::vector<absl::StatusOr<ipc::Message>> replies = CallRanks(std::move(split->requests), split->has_request);
  RemoveCopies(copies);
  std::vector<ipc::Message> ok;
  for (size_t r = 0; r < replies.size(); ++r) {
    // A split step fails on every rank together; report the lowest rank's error (a rank
    // that went down: UNAVAILABLE).
    if (!split->has_request[r]) {
      ok.emplace_back();
      continue;
    }
    if (!replies[r].ok()) return replies[r].status();
    ok.push_back(*std::move(replies[r]));
  }
  std::string line = absl::StrCat(method, " over ", world_size_, " ranks (", spread.size(), " of ", trained.size(),
                                   " trained adapters split): tokens");
  for (int32_t r = 0; r < world_size_; ++r) {
    const int64_t t = split->tokens[static_cast<size_t>(r)];
    rank_tokens_[r] += t;
    absl::StrAppend(&line, " rank", r, "=", t, " (total ", rank_tokens_[r].load(), ")");
  }
  Log(LogLevel::kDebug, kLog, line);
  if (backward) {
    absl::MutexLock lock(&mu_);
    ++steps_;
    for (auto& [key, h] : homes_) h.load /= 2;
    for (const auto& [key, t] : trained) {
      auto it = homes_.find(key);
      if (it != homes_.end()) it->second.load += static_cast<double>(t.tokens);
    }
  }
  return MergeForward(*split, std::move(ok));
}

}  // namespace twinkle
