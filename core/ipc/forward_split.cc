#include "core/ipc/forward_split.h"

#include <algorithm>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
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

// Builds the parts of a split: Place puts datum d of op o into part p, as the next datum of
// p's copy of op o, copying its frames.
class PartBuilder {
 public:
  PartBuilder(const ipc::Message& request, const ipc::ForwardRequest& req, size_t parts)
      : request_(request), req_(req), parts_(parts), buffers_(parts) {
    split_.tokens.assign(parts, 0);
    split_.placement.resize(parts);
    for (ipc::ForwardRequest& p : parts_) p.return_logits = req.return_logits;
    for (const ipc::TrainOpMsg& op : req.ops) {
      split_.op_datums.push_back(op.datums.size());
      int64_t tokens = 0;
      for (const ipc::DatumMsg& d : op.datums) tokens += Numel(d.input_tokens);
      split_.op_tokens.push_back(tokens);
    }
  }

  absl::Status Place(size_t p, size_t o, size_t d) {
    std::vector<ForwardSplit::PartOp>& ops = split_.placement[p];
    if (ops.empty() || ops.back().op != o) {
      ops.push_back({o, {}});
      ipc::TrainOpMsg copy = req_.ops[o];
      copy.datums.clear();
      parts_[p].ops.push_back(std::move(copy));
    }
    ops.back().datums.push_back(d);
    ipc::DatumMsg datum = req_.ops[o].datums[d];
    if (absl::Status s = MoveFrame(datum.input_tokens, request_.buffers, buffers_[p]); !s.ok()) return s;
    if (absl::Status s = MoveFrame(datum.target_tokens, request_.buffers, buffers_[p]); !s.ok()) return s;
    for (auto& [name, desc] : datum.inputs) {
      if (absl::Status s = MoveFrame(desc, request_.buffers, buffers_[p]); !s.ok()) return s;
    }
    split_.tokens[p] += Numel(req_.ops[o].datums[d].input_tokens);
    parts_[p].ops.back().datums.push_back(std::move(datum));
    return absl::OkStatus();
  }

  const std::vector<int64_t>& tokens() const { return split_.tokens; }
  ipc::ForwardRequest& part(size_t p) { return parts_[p]; }

  // The split, with part p's request sent when has_request(p).
  template <typename HasRequest>
  ForwardSplit Finish(HasRequest has_request) {
    for (size_t p = 0; p < parts_.size(); ++p) {
      split_.has_request.push_back(has_request(p));
      split_.requests.push_back(
          ipc::MakeRequest(request_.envelope.method, ipc::Pack(parts_[p]), std::move(buffers_[p])));
    }
    return std::move(split_);
  }

 private:
  const ipc::Message& request_;
  const ipc::ForwardRequest& req_;
  std::vector<ipc::ForwardRequest> parts_;
  std::vector<std::vector<std::string>> buffers_;
  ForwardSplit split_;
};

absl::StatusOr<ipc::ForwardRequest> UnpackForward(const ipc::Message& request, const char* who) {
  const std::string& method = request.envelope.method;
  if (method != ipc::kMethodForwardBackward && method != ipc::kMethodForward) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": not a forward call: ", method));
  }
  return ipc::Unpack<ipc::ForwardRequest>(request.envelope.body, method);
}

}  // namespace

bool LossSplitsOverDatums(const std::string& loss_name) {
  return std::find(std::begin(kSumLosses), std::end(kSumLosses), loss_name) != std::end(kSumLosses);
}

absl::StatusOr<ForwardSplit> SplitForward(const ipc::Message& request, int32_t world_size,
                                          const std::vector<int32_t>& op_ranks) {
  absl::StatusOr<ipc::ForwardRequest> req = UnpackForward(request, "SplitForward");
  if (!req.ok()) return req.status();
  if (world_size < 1) return absl::InvalidArgumentError("SplitForward: world_size must be >= 1");
  if (!op_ranks.empty() && op_ranks.size() != req->ops.size()) {
    return absl::InvalidArgumentError(absl::StrCat("SplitForward: ", op_ranks.size(), " op ranks for ",
                                                   req->ops.size(), " ops"));
  }
  auto rank_of = [&](size_t o) { return op_ranks.empty() ? kSpreadOverRanks : op_ranks[o]; };
  for (size_t o = 0; o < op_ranks.size(); ++o) {
    if (op_ranks[o] != kSpreadOverRanks && (op_ranks[o] < 0 || op_ranks[o] >= world_size)) {
      return absl::InvalidArgumentError(absl::StrCat("SplitForward: op ", o, " placed on rank ", op_ranks[o],
                                                     " of ", world_size));
    }
  }
  const bool backward = request.envelope.method == ipc::kMethodForwardBackward;
  const size_t world = static_cast<size_t>(world_size);
  PartBuilder parts(request, *req, world);

  // Every adapter the spread ops train, in op order: the all-reduce's layout on every rank.
  std::vector<std::string> trained;
  for (size_t o = 0; o < req->ops.size(); ++o) {
    const ipc::TrainOpMsg& op = req->ops[o];
    if (backward && rank_of(o) == kSpreadOverRanks && !op.adapter_id.empty() && !op.disable_adapter &&
        !op.loss.name.empty() && std::find(trained.begin(), trained.end(), op.adapter_id) == trained.end()) {
      trained.push_back(op.adapter_id);
    }
  }
  auto least_loaded = [&parts] {
    const std::vector<int64_t>& t = parts.tokens();
    return static_cast<size_t>(std::min_element(t.begin(), t.end()) - t.begin());
  };
  for (size_t o = 0; o < req->ops.size(); ++o) {
    if (rank_of(o) == kSpreadOverRanks) continue;
    for (size_t d = 0; d < req->ops[o].datums.size(); ++d) {
      if (absl::Status s = parts.Place(static_cast<size_t>(rank_of(o)), o, d); !s.ok()) return s;
    }
  }
  for (size_t o = 0; o < req->ops.size(); ++o) {
    if (rank_of(o) != kSpreadOverRanks) continue;
    const ipc::TrainOpMsg& op = req->ops[o];
    const bool by_datum = LossSplitsOverDatums(op.loss.name);
    const size_t whole = least_loaded();
    for (size_t d = 0; d < op.datums.size(); ++d) {
      if (absl::Status s = parts.Place(by_datum ? least_loaded() : whole, o, d); !s.ok()) return s;
    }
  }
  for (size_t r = 0; r < world; ++r) {
    parts.part(r).allreduce_adapters = world > 1 ? trained : std::vector<std::string>{};
    parts.part(r).max_pass_bytes = req->max_pass_bytes;  // each rank passes its share alone
  }
  return parts.Finish([&](size_t r) { return !parts.part(r).ops.empty() || (backward && !trained.empty()); });
}

absl::StatusOr<ForwardSplit> SplitForwardIntoPasses(const ipc::Message& request, const ActivationCost& cost,
                                                    int64_t max_bytes) {
  absl::StatusOr<ipc::ForwardRequest> req = UnpackForward(request, "SplitForwardIntoPasses");
  if (!req.ok()) return req.status();
  // Units in request order: (op, first datum, datum count) with their sequence lengths.
  struct Unit {
    size_t op, begin, count;
    std::vector<int64_t> lengths;
  };
  std::vector<Unit> units;
  for (size_t o = 0; o < req->ops.size(); ++o) {
    const ipc::TrainOpMsg& op = req->ops[o];
    if (LossSplitsOverDatums(op.loss.name)) {
      for (size_t d = 0; d < op.datums.size(); ++d) units.push_back({o, d, 1, {Numel(op.datums[d].input_tokens)}});
    } else {
      Unit u{o, 0, op.datums.size(), {}};
      for (const ipc::DatumMsg& d : op.datums) u.lengths.push_back(Numel(d.input_tokens));
      units.push_back(std::move(u));
    }
  }
  // Which pass each unit goes to: a new pass when the unit would take the current one over.
  std::vector<size_t> pass_of;
  std::vector<int64_t> current;
  size_t passes = 0;
  for (const Unit& u : units) {
    std::vector<int64_t> with = current;
    with.insert(with.end(), u.lengths.begin(), u.lengths.end());
    if (passes == 0 || (!current.empty() && EstimateActivationBytes(cost, with) > max_bytes)) {
      ++passes;
      with = u.lengths;
    }
    current = std::move(with);
    pass_of.push_back(passes - 1);
  }
  PartBuilder parts(request, *req, passes);
  for (size_t i = 0; i < units.size(); ++i) {
    for (size_t d = units[i].begin; d < units[i].begin + units[i].count; ++d) {
      if (absl::Status s = parts.Place(pass_of[i], units[i].op, d); !s.ok()) return s;
    }
  }
  return parts.Finish([](size_t) { return true; });
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
    const std::vector<ForwardSplit::PartOp>& placed = split.placement[r];
    if (reply->ops.size() != placed.size()) {
      return absl::InternalError(absl::StrCat("part ", r, " answered ", reply->ops.size(), " ops for ", placed.size()));
    }
    for (size_t j = 0; j < placed.size(); ++j) {
      const size_t o = placed[j].op;
      ipc::OpResultMsg& got = reply->ops[j];
      const std::vector<size_t>& datums = placed[j].datums;
      if (got.logprobs.size() != datums.size() ||
          (!got.elementwise.empty() && got.elementwise.size() != datums.size()) ||
          (!got.logits.empty() && got.logits.size() != datums.size())) {
        return absl::InternalError(absl::StrCat("part ", r, " answered op ", o, " with the wrong datum count"));
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

}  // namespace twinkle
