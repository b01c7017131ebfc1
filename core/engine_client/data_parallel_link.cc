#include "core/engine_client/data_parallel_link.h"

#include <algorithm>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/common/log.h"
#include "core/ipc/messages.h"
#include "core/ipc/training_messages.h"

namespace twinkle {
namespace {

// Tinker's losses: sums over the datums' tokens, with ":sum" metrics.
constexpr const char* kSumLosses[] = {"", "cross_entropy", "importance_sampling", "ppo", "cispo", "dro"};

// Copies frame `desc.frame` of `from` into `to`, pointing `desc` at the copy.
absl::Status MoveFrame(ipc::TensorDesc& desc, const std::vector<std::string>& from,
                       std::vector<std::string>& to) {
  if (desc.dtype.empty()) return absl::OkStatus();  // an absent optional tensor
  if (desc.frame >= from.size()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor frame ", desc.frame, " of ", from.size(), " is missing"));
  }
  to.push_back(from[desc.frame]);
  desc.frame = static_cast<uint32_t>(to.size() - 1);
  return absl::OkStatus();
}

int64_t Numel(const ipc::TensorDesc& desc) {
  int64_t n = 1;
  for (int64_t d : desc.shape) n *= d;
  return n;
}

bool IsBroadcast(const std::string& method) {
  for (const char* m : {ipc::kMethodCreateAdapter, ipc::kMethodRemoveAdapter, ipc::kMethodOptimStep,
                        ipc::kMethodZeroGrad, ipc::kMethodSetOptimizer, ipc::kMethodClipGradNorm,
                        ipc::kMethodSetAdapterState}) {
    if (method == m) return true;
  }
  return false;
}

}  // namespace

bool LossSplitsOverDatums(const std::string& loss_name) {
  return std::find(std::begin(kSumLosses), std::end(kSumLosses), loss_name) != std::end(kSumLosses);
}

absl::StatusOr<ForwardSplit> SplitForward(const ipc::Message& request, int32_t world_size) {
  const std::string& method = request.envelope.method;
  const bool backward = method == ipc::kMethodForwardBackward;
  if (!backward && method != ipc::kMethodForward) {
    return absl::InvalidArgumentError(absl::StrCat("SplitForward: not a forward call: ", method));
  }
  if (world_size < 1) return absl::InvalidArgumentError("SplitForward: world_size must be >= 1");
  absl::StatusOr<ipc::ForwardRequest> req = ipc::Unpack<ipc::ForwardRequest>(request.envelope.body, method);
  if (!req.ok()) return req.status();

  ForwardSplit split;
  const size_t world = static_cast<size_t>(world_size);
  split.tokens.assign(world, 0);
  split.placement.resize(world);
  std::vector<ipc::ForwardRequest> parts(world);
  std::vector<std::vector<std::string>> buffers(world);
  for (ipc::ForwardRequest& p : parts) p.return_logits = req->return_logits;

  // Every adapter the step trains, in op order: the all-reduce's layout on every rank.
  std::vector<std::string> trained;
  for (const ipc::TrainOpMsg& op : req->ops) {
    if (backward && !op.adapter_id.empty() && !op.disable_adapter && !op.loss.name.empty() &&
        std::find(trained.begin(), trained.end(), op.adapter_id) == trained.end()) {
      trained.push_back(op.adapter_id);
    }
  }

  auto least_loaded = [&split] {
    return static_cast<size_t>(std::min_element(split.tokens.begin(), split.tokens.end()) - split.tokens.begin());
  };
  // Puts datum d of op o on rank r (as the next datum of r's copy of op o).
  auto place = [&](size_t r, size_t o, size_t d) -> absl::Status {
    std::vector<ForwardSplit::RankOp>& ops = split.placement[r];
    if (ops.empty() || ops.back().op != o) {
      ops.push_back({o, {}});
      ipc::TrainOpMsg copy = req->ops[o];
      copy.datums.clear();
      parts[r].ops.push_back(std::move(copy));
    }
    ops.back().datums.push_back(d);
    ipc::DatumMsg datum = req->ops[o].datums[d];
    if (absl::Status s = MoveFrame(datum.input_tokens, request.buffers, buffers[r]); !s.ok()) return s;
    if (absl::Status s = MoveFrame(datum.target_tokens, request.buffers, buffers[r]); !s.ok()) return s;
    for (auto& [name, desc] : datum.inputs) {
      if (absl::Status s = MoveFrame(desc, request.buffers, buffers[r]); !s.ok()) return s;
    }
    split.tokens[r] += Numel(req->ops[o].datums[d].input_tokens);
    parts[r].ops.back().datums.push_back(std::move(datum));
    return absl::OkStatus();
  };

  for (size_t o = 0; o < req->ops.size(); ++o) {
    const ipc::TrainOpMsg& op = req->ops[o];
    split.op_datums.push_back(op.datums.size());
    int64_t tokens = 0;
    for (const ipc::DatumMsg& d : op.datums) tokens += Numel(d.input_tokens);
    split.op_tokens.push_back(tokens);
    if (LossSplitsOverDatums(op.loss.name)) {
      for (size_t d = 0; d < op.datums.size(); ++d) {
        if (absl::Status s = place(least_loaded(), o, d); !s.ok()) return s;
      }
    } else {
      const size_t r = least_loaded();
      for (size_t d = 0; d < op.datums.size(); ++d) {
        if (absl::Status s = place(r, o, d); !s.ok()) return s;
      }
    }
  }
  for (size_t r = 0; r < world; ++r) {
    const bool has = !parts[r].ops.empty() || (backward && !trained.empty());
    split.has_request.push_back(has);
    parts[r].allreduce_adapters = world > 1 ? trained : std::vector<std::string>{};
    ipc::Message m = ipc::MakeRequest(method, ipc::Pack(parts[r]), std::move(buffers[r]));
    split.requests.push_back(std::move(m));
  }
  return split;
}

absl::StatusOr<ipc::Message> MergeForward(const ForwardSplit& split, std::vector<ipc::Message> replies) {
  const size_t ops = split.op_datums.size();
  ipc::ForwardReply merged;
  merged.ops.resize(ops);
  for (size_t o = 0; o < ops; ++o) {
    merged.ops[o].logprobs.resize(split.op_datums[o]);
  }
  std::vector<std::vector<ipc::TensorDesc>> elementwise(ops), logits(ops);
  for (size_t o = 0; o < ops; ++o) {
    elementwise[o].resize(split.op_datums[o]);
    logits[o].resize(split.op_datums[o]);
  }
  // Per op: the ranks' metrics with their token counts, merged once all are in.
  std::vector<std::vector<std::pair<int64_t, std::map<std::string, double>>>> metrics(ops);
  std::vector<bool> has_elementwise(ops, false), has_logits(ops, false);
  ipc::Message out;
  for (size_t r = 0; r < replies.size() && r < split.placement.size(); ++r) {
    if (!split.has_request[r]) continue;
    absl::StatusOr<ipc::ForwardReply> reply =
        ipc::Unpack<ipc::ForwardReply>(replies[r].envelope.body, "forward reply");
    if (!reply.ok()) return reply.status();
    const std::vector<ForwardSplit::RankOp>& placed = split.placement[r];
    if (reply->ops.size() != placed.size()) {
      return absl::InternalError(absl::StrCat("rank ", r, " answered ", reply->ops.size(), " ops for ", placed.size()));
    }
    for (size_t j = 0; j < placed.size(); ++j) {
      const size_t o = placed[j].op;
      ipc::OpResultMsg& got = reply->ops[j];
      const std::vector<size_t>& datums = placed[j].datums;
      if (got.logprobs.size() != datums.size() ||
          (!got.elementwise.empty() && got.elementwise.size() != datums.size()) ||
          (!got.logits.empty() && got.logits.size() != datums.size())) {
        return absl::InternalError(absl::StrCat("rank ", r, " answered op ", o, " with the wrong datum count"));
      }
      int64_t tokens = 0;
      for (size_t k = 0; k < datums.size(); ++k) {
        tokens += Numel(got.logprobs[k]);
        if (absl::Status s = MoveFrame(got.logprobs[k], replies[r].buffers, out.buffers); !s.ok()) return s;
        merged.ops[o].logprobs[datums[k]] = got.logprobs[k];
        if (!got.elementwise.empty()) {
          if (absl::Status s = MoveFrame(got.elementwise[k], replies[r].buffers, out.buffers); !s.ok()) return s;
          elementwise[o][datums[k]] = got.elementwise[k];
          has_elementwise[o] = true;
        }
        if (!got.logits.empty()) {
          if (absl::Status s = MoveFrame(got.logits[k], replies[r].buffers, out.buffers); !s.ok()) return s;
          logits[o][datums[k]] = got.logits[k];
          has_logits[o] = true;
        }
      }
      metrics[o].emplace_back(tokens, std::move(got.metrics));
    }
  }
  for (size_t o = 0; o < ops; ++o) {
    if (has_elementwise[o]) merged.ops[o].elementwise = std::move(elementwise[o]);
    if (has_logits[o]) merged.ops[o].logits = std::move(logits[o]);
    if (metrics[o].size() == 1) {
      merged.ops[o].metrics = std::move(metrics[o][0].second);
      continue;
    }
    std::map<std::string, double>& m = merged.ops[o].metrics;
    std::map<std::string, int64_t> weight;
    for (const auto& [tokens, part] : metrics[o]) {
      for (const auto& [key, value] : part) {
        auto it = m.find(key);
        if (absl::EndsWith(key, ":sum")) {
          m[key] += value;
        } else if (absl::EndsWith(key, ":max")) {
          m[key] = it == m.end() ? value : std::max(it->second, value);
        } else if (absl::EndsWith(key, ":min")) {
          m[key] = it == m.end() ? value : std::min(it->second, value);
        } else {
          m[key] += value * static_cast<double>(tokens);
          weight[key] += tokens;
        }
      }
    }
    for (const auto& [key, w] : weight) m[key] = w > 0 ? m[key] / static_cast<double>(w) : 0.0;
  }
  out.envelope.body = ipc::Pack(merged);
  return out;
}

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
