// The trainer's forward and forward_backward: one fused pass over many adapters' ops
// (ForwardPass), several passes under the activation-memory budget (PlanPasses, RunPasses),
// and on a rank of a process group the gradients' all-reduce (ReduceGradients).

#include "core/engine/trainer.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/common/log.h"
#include "core/engine/loss/loss.h"
#include "core/common/splitmix.h"
#include "core/engine/tensor_io.h"
#include "core/ipc/training_messages.h"

namespace twinkle::engine {
namespace {

// Whether every id of a freshly read int64 [L] tensor (host memory) is in [0, vocab): a plain
// loop, where min()/max() and .item() would cost four ATen ops per datum.
bool TokensInRange(const at::Tensor& ids, int64_t vocab) {
  const int64_t* p = ids.const_data_ptr<int64_t>();
  bool ok = true;
  for (int64_t i = 0, n = ids.numel(); i < n; ++i) ok &= p[i] >= 0 && p[i] < vocab;
  return ok;
}

// One op's rows in the packed batch.
struct OpRows {
  int64_t begin = 0, end = 0;
  Adapter* adapter = nullptr;  // null: base model rows
  std::vector<int64_t> datum_lens;
};

}  // namespace

absl::Status Trainer::ReduceGradients(const std::vector<Adapter*>& adapters,
                                      std::vector<at::Tensor> earlier) {
  // One flat buffer, one collective per fused step: the adapters' parameters in request
  // order, each the gradient this rank's rows gave it (zeros without rows here).
  std::vector<at::Tensor> parts;
  for (Adapter* adapter : adapters) {
    for (const auto& [name, p] : adapter->named_parameters()) {
      const at::Tensor& g = p.grad();
      parts.push_back(g.defined() ? g.reshape({-1}) : at::zeros({p.numel()}, p.options()));
    }
  }
  at::Tensor flat = at::cat(parts);
  if (absl::Status s = group_->AllReduceSum(flat); !s.ok()) return s;
  int64_t offset = 0;
  size_t i = 0;
  for (Adapter* adapter : adapters) {
    for (const auto& [name, p] : adapter->named_parameters()) {
      const at::Tensor sum = flat.narrow(0, offset, p.numel()).view(p.sizes());
      offset += p.numel();
      const at::Tensor& before = earlier[i++];
      const_cast<at::Tensor&>(p).mutable_grad() = before.defined() ? before + sum : sum.clone();
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<MethodReply> Trainer::Forward(const ipc::Message& request, bool backward) {
  const char* method = backward ? ipc::kMethodForwardBackward : ipc::kMethodForward;
  absl::StatusOr<ipc::ForwardRequest> req = ipc::Unpack<ipc::ForwardRequest>(request.envelope.body, method);
  if (!req.ok()) return req.status();
  const bool data_parallel = !req->allreduce_adapters.empty();
  if (data_parallel && (!backward || group_ == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        method, ": allreduce_adapters needs forward_backward on a rank of a process group"));
  }
  absl::StatusOr<std::optional<ForwardSplit>> passes = PlanPasses(request, *req);
  if (!passes.ok()) return passes.status();
  if (!data_parallel && !passes->has_value()) return ForwardPass(request, *req, backward, {});

  // The adapters this step trains: their gradients so far are set aside while the step's
  // pass(es) fill fresh ones, so a step that fails (on any pass, or on another rank) leaves
  // them exactly as they were. Data parallel, the request's allreduce_adapters come first
  // (summed over the ranks); after them the adapters only this rank trains (an adapter
  // sharded onto its home rank), whose gradients stay local.
  std::vector<Adapter*> trained;
  size_t reduced = 0;
  absl::Status invalid;  // data parallel, an error still joins the collectives below
  auto add_trained = [&](const std::string& id, bool listed) {
    absl::StatusOr<Adapter*> adapter = FindAdapter(id);
    if (!adapter.ok()) {
      invalid = adapter.status();
      return;
    }
    const bool seen = std::find(trained.begin(), trained.end(), *adapter) != trained.end();
    if (listed && seen) {
      invalid = absl::InvalidArgumentError(absl::StrCat(method, ": adapter '", id, "' is listed twice in allreduce_adapters"));
    } else if (!seen) {
      trained.push_back(*adapter);
    }
  };
  for (const std::string& id : req->allreduce_adapters) {
    if (invalid.ok()) add_trained(id, true);
  }
  reduced = trained.size();
  for (const ipc::TrainOpMsg& op : req->ops) {
    if (!backward || !invalid.ok() || op.adapter_id.empty() || op.disable_adapter || op.loss.name.empty()) continue;
    add_trained(op.adapter_id, false);
  }
  if (!invalid.ok() && !data_parallel) return invalid;
  std::vector<at::Tensor> earlier;
  size_t reduced_params = 0;
  if (invalid.ok()) {
    for (size_t i = 0; i < trained.size(); ++i) {
      for (const auto& [name, p] : trained[i]->named_parameters()) {
        earlier.push_back(p.grad());
        const_cast<at::Tensor&>(p).mutable_grad() = at::Tensor();
        if (i < reduced) ++reduced_params;
      }
    }
  }
  auto restore = [&] {
    size_t i = 0;
    for (Adapter* adapter : trained) {
      for (const auto& [name, p] : adapter->named_parameters()) {
        if (i < earlier.size()) const_cast<at::Tensor&>(p).mutable_grad() = earlier[i++];
      }
    }
  };
  // Adds the earlier gradients back to the step's, for trained[first...].
  auto add_back = [&](size_t first, size_t param) {
    for (size_t a = first; a < trained.size(); ++a) {
      for (const auto& [name, p] : trained[a]->named_parameters()) {
        const at::Tensor& before = earlier[param++];
        at::Tensor& grad = const_cast<at::Tensor&>(p).mutable_grad();
        if (before.defined()) grad = grad.defined() ? before + grad : before;
      }
    }
  };
  absl::StatusOr<MethodReply> reply =
      !invalid.ok() ? absl::StatusOr<MethodReply>(invalid)
      : req->ops.empty() ? Reply(ipc::ForwardReply{})  // no rows here: only the collectives
                         : RunPasses(request, *req, *passes, backward);
  if (data_parallel) {
    // A rank that failed (a bad input, an unknown adapter) still takes part in the
    // collectives, so no peer is left waiting: first every rank says whether it failed; if
    // any did, all drop this step's gradients (as one rank that failed would) and return an
    // error; otherwise the new gradients of the listed adapters are summed over the ranks.
    at::Tensor failed =
        at::full({1}, reply.ok() ? 0.0f : 1.0f, at::TensorOptions().dtype(at::kFloat).device(device_));
    if (absl::Status s = group_->AllReduceSum(failed); !s.ok()) {
      restore();
      return s;
    }
    const float failures = failed.to(at::kCPU).item<float>();
    if (failures > 0) {
      restore();
      if (!reply.ok()) return reply.status();
      return absl::AbortedError(absl::StrCat(method, ": ", static_cast<int>(failures),
                                             " other rank(s) failed this data-parallel step; no gradient was kept"));
    }
    std::vector<Adapter*> summed(trained.begin(), trained.begin() + static_cast<std::ptrdiff_t>(reduced));
    std::vector<at::Tensor> summed_earlier(earlier.begin(), earlier.begin() + static_cast<std::ptrdiff_t>(reduced_params));
    if (absl::Status s = ReduceGradients(summed, std::move(summed_earlier)); !s.ok()) return s;
    add_back(reduced, reduced_params);
  } else {
    if (!reply.ok()) {
      restore();
      return reply.status();
    }
    add_back(0, 0);
  }
  // Every rank counts the micro-batch, rows here or not, so the counters stay equal; one
  // count per request however many passes it took.
  for (Adapter* adapter : trained) ++adapter->micro_batches_since_step;
  return reply;
}

absl::StatusOr<std::optional<ForwardSplit>> Trainer::PlanPasses(const ipc::Message& request,
                                                                const ipc::ForwardRequest& req) const {
  if (req.max_pass_bytes <= 0 || !activation_cost_.known() || req.ops.empty()) return std::nullopt;
  std::vector<int64_t> lengths;
  for (const ipc::TrainOpMsg& op : req.ops) {
    for (const ipc::DatumMsg& d : op.datums) {
      int64_t n = 1;
      for (int64_t dim : d.input_tokens.shape) n *= dim;
      lengths.push_back(n);
    }
  }
  if (EstimateActivationBytes(activation_cost_, lengths) <= req.max_pass_bytes) return std::nullopt;
  absl::StatusOr<ForwardSplit> split = SplitForwardIntoPasses(request, activation_cost_, req.max_pass_bytes);
  if (!split.ok()) return split.status();
  if (split->requests.size() < 2) return std::nullopt;
  return std::optional<ForwardSplit>(*std::move(split));
}

absl::StatusOr<MethodReply> Trainer::RunPasses(const ipc::Message& request, const ipc::ForwardRequest& req,
                                               const std::optional<ForwardSplit>& passes, bool backward) {
  if (!passes.has_value()) return ForwardPass(request, req, backward, {false, 0});
  const char* method = backward ? ipc::kMethodForwardBackward : ipc::kMethodForward;
  const size_t n = passes->requests.size();
  std::vector<MethodReply> replies;
  for (size_t p = 0; p < n; ++p) {
    const ipc::Message& part = passes->requests[p];
    absl::StatusOr<ipc::ForwardRequest> part_req = ipc::Unpack<ipc::ForwardRequest>(part.envelope.body, method);
    if (!part_req.ok()) return part_req.status();
    absl::StatusOr<MethodReply> reply = ForwardPass(part, *part_req, backward, {false, p});
    if (!reply.ok()) {
      return absl::Status(reply.status().code(),
                          absl::StrCat("pass ", p + 1, " of ", n, ": ", reply.status().message()));
    }
    replies.push_back(*std::move(reply));
  }
  std::string line = absl::StrCat(method, " in ", n, " passes within ", req.max_pass_bytes >> 20,
                                  " MiB (engine.activation_memory_mib): tokens");
  for (int64_t t : passes->tokens) absl::StrAppend(&line, " ", t);
  Log(LogLevel::kDebug, "trainer", line);
  return MergeForward(*passes, std::move(replies));
}

absl::StatusOr<MethodReply> Trainer::ForwardPass(const ipc::Message& request, const ipc::ForwardRequest& fwd,
                                                 bool backward, PassOptions options) {
  const char* method = backward ? ipc::kMethodForwardBackward : ipc::kMethodForward;
  const ipc::ForwardRequest* req = &fwd;
  if (req->ops.empty()) return absl::InvalidArgumentError(absl::StrCat(method, ": no ops"));
  const int64_t vocab = model_->config().vocab_size;

  // Pack every datum of every op into one row batch, op after op.
  std::vector<OpRows> rows;
  std::vector<at::Tensor> tokens, targets;
  std::vector<int64_t> seq_lens, seq_groups;
  int64_t n = 0;
  for (size_t o = 0; o < req->ops.size(); ++o) {
    const ipc::TrainOpMsg& op = req->ops[o];
    OpRows r;
    r.begin = n;
    if (!op.adapter_id.empty() && !op.disable_adapter) {
      absl::StatusOr<Adapter*> adapter = FindAdapter(op.adapter_id);
      if (!adapter.ok()) return adapter.status();
      r.adapter = *adapter;
    }
    if (op.datums.empty()) return absl::InvalidArgumentError(absl::StrCat("op ", o, " has no datums"));
    for (size_t d = 0; d < op.datums.size(); ++d) {
      const std::string where = absl::StrCat("op ", o, " datum ", d);
      absl::StatusOr<at::Tensor> in = ReadTensor(op.datums[d].input_tokens, request);
      if (!in.ok()) return absl::InvalidArgumentError(absl::StrCat(where, " input_tokens: ", in.status().message()));
      if (in->dim() != 1 || in->numel() == 0 || in->scalar_type() != at::kLong) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": input_tokens must be a non-empty int64 [L]"));
      }
      if (!TokensInRange(*in, vocab)) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": token id outside [0, ", vocab, ")"));
      }
      at::Tensor target;
      if (!op.datums[d].target_tokens.dtype.empty()) {
        absl::StatusOr<at::Tensor> t = ReadTensor(op.datums[d].target_tokens, request);
        if (!t.ok()) return absl::InvalidArgumentError(absl::StrCat(where, " target_tokens: ", t.status().message()));
        // [L], or [L, K] soft targets (K tokens per position; cross_entropy).
        if (t->scalar_type() != at::kLong || t->dim() < 1 || t->dim() > 2 || t->size(0) != in->size(0) ||
            (t->dim() == 2 && t->size(1) < 1)) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": target_tokens must be int64 [L] or [L, K] like input_tokens"));
        }
        if (!TokensInRange(*t, vocab)) {
          return absl::InvalidArgumentError(absl::StrCat(where, ": target token outside [0, ", vocab, ")"));
        }
        target = *t;
      } else {
        if (!op.loss.name.empty()) {
          return absl::InvalidArgumentError(absl::StrCat(where, ": the loss needs target_tokens"));
        }
        target = at::zeros_like(*in);
      }
      tokens.push_back(*in);
      targets.push_back(target);
      seq_lens.push_back(in->numel());
      seq_groups.push_back(static_cast<int64_t>(o));
      r.datum_lens.push_back(in->numel());
      n += in->numel();
    }
    r.end = n;
    rows.push_back(std::move(r));
  }

  // LoRA segments per (layer, linear): every op with an adapter that targets the linear.
  const LoraSegmentsFn lora = [&](int64_t layer, LinearKind kind, const at::Tensor& x) {
    std::vector<kernels::LoraSegment> segments;
    for (const OpRows& r : rows) {
      if (r.adapter == nullptr || !r.adapter->targets(kind)) continue;
      kernels::LoraSegment s{r.begin, r.end, r.adapter->a(layer, kind), r.adapter->b(layer, kind),
                             r.adapter->scale(kind), {}};
      const double p = r.adapter->config().dropout;
      if (backward && p > 0) {
        // The mask depends only on this adapter's seed, step, micro-batch, layer and linear,
        // so a fused step draws exactly what a solo step would.
        uint64_t seed = SplitMix64(r.adapter->config().seed);
        for (uint64_t v : {static_cast<uint64_t>(r.adapter->optimizer().step()),
                           static_cast<uint64_t>(r.adapter->micro_batches_since_step),
                           static_cast<uint64_t>(layer), static_cast<uint64_t>(kind)}) {
          seed = SplitMix64(seed ^ v);
        }
        // A later pass of a request run in passes (under the memory budget) draws fresh
        // masks; pass 0 keeps the unsplit request's draw.
        if (options.pass > 0) seed = SplitMix64(seed ^ (0x7061737300000000ULL | options.pass));
        at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
        const at::Tensor xs = x.narrow(0, r.begin, r.end - r.begin);
        const at::Tensor keep = at::empty(xs.sizes(), at::TensorOptions().dtype(at::kFloat))
                                    .bernoulli_(1 - p, gen).to(xs.device()).to(xs.scalar_type());
        s.x = xs * keep / (1 - p);
      }
      segments.push_back(std::move(s));
    }
    return segments;
  };

  std::optional<c10::NoGradGuard> no_grad;
  if (!backward) no_grad.emplace();
  // Soft targets: when any datum has [L, K] targets, every datum's become [L, K_max] (a
  // datum's own columns first, then copies of its first column), and each datum gets back
  // its own K columns ([L] targets: column 0 as [L]).
  int64_t width = 0;
  for (const at::Tensor& t : targets) width = std::max<int64_t>(width, t.dim() == 2 ? t.size(1) : 0);
  std::vector<at::Tensor> padded;
  if (width > 0) {
    for (const at::Tensor& t : targets) {
      const at::Tensor t2 = t.dim() == 2 ? t : t.unsqueeze(1);
      padded.push_back(t2.size(1) == width
                           ? t2
                           : at::cat({t2, t2.narrow(1, 0, 1).expand({t2.size(0), width - t2.size(1)})}, 1));
    }
  }
  const at::Tensor input = at::cat(tokens).to(device_);
  const at::Tensor target = at::cat(width > 0 ? padded : targets).to(device_);
  const at::Tensor hidden = model_->Hidden(input, seq_lens, seq_groups, lora);
  // log p(target) = logit[target] - logsumexp(logits), in row chunks: the [N, vocab] logits
  // exist whole only when the request asks for them back.
  at::Tensor logits;
  const at::Tensor logprobs = model_->TargetLogprobs(hidden, target, seq_lens, seq_groups, lora,
                                                     req->return_logits ? &logits : nullptr);

  // Every datum's log-probs as one split: autograd then has one node that concatenates their
  // gradients, where a narrow per datum would add a full-size [N] gradient per datum.
  std::vector<at::Tensor> datum_logprobs =
      seq_lens.size() == 1 ? std::vector<at::Tensor>{logprobs} : logprobs.split_with_sizes(seq_lens);
  if (width > 0) {
    for (size_t i = 0; i < datum_logprobs.size(); ++i) {
      datum_logprobs[i] = targets[i].dim() == 2 ? datum_logprobs[i].narrow(1, 0, targets[i].size(1))
                                                : datum_logprobs[i].select(1, 0);
    }
  }
  size_t datum_index = 0;

  MethodReply reply;
  ipc::ForwardReply body;
  at::Tensor total;
  for (size_t o = 0; o < rows.size(); ++o) {
    const ipc::TrainOpMsg& op = req->ops[o];
    const OpRows& r = rows[o];
    ipc::OpResultMsg result;
    std::vector<LossDatum> datums;
    int64_t start = r.begin;
    for (size_t d = 0; d < r.datum_lens.size(); ++d) {
      const int64_t len = r.datum_lens[d];
      LossDatum datum;
      datum.logprobs = datum_logprobs[datum_index++];
      for (const auto& [name, desc] : op.datums[d].inputs) {
        absl::StatusOr<at::Tensor> t = ReadTensor(desc, request);
        if (!t.ok()) {
          return absl::InvalidArgumentError(absl::StrCat("op ", o, " datum ", d, " input '", name, "': ", t.status().message()));
        }
        datum.inputs[name] = t->device() == device_ ? *std::move(t) : t->to(device_);
      }
      absl::StatusOr<ipc::TensorDesc> lp = AppendTensor(datum.logprobs, reply);
      if (!lp.ok()) return lp.status();
      result.logprobs.push_back(*lp);
      if (req->return_logits) {
        absl::StatusOr<ipc::TensorDesc> lg = AppendTensor(logits.narrow(0, start, len), reply);
        if (!lg.ok()) return lg.status();
        result.logits.push_back(*lg);
      }
      datums.push_back(std::move(datum));
      start += len;
    }
    if (!op.loss.name.empty()) {
      const LossSpec spec{op.loss.name, op.loss.config, op.loss.string_config};
      if (absl::Status s = ValidateLossSpec(spec); !s.ok()) return s;
      absl::StatusOr<LossResult> loss =
          ComputeLoss(spec, datums, LossContext{op.window_tokens, op.window_sequences});
      if (!loss.ok()) return absl::Status(loss.status().code(), absl::StrCat("op ", o, ": ", loss.status().message()));
      for (const at::Tensor& e : loss->elementwise) {
        absl::StatusOr<ipc::TensorDesc> desc =
            AppendTensor(e.scalar_type() == at::kFloat ? e : e.to(at::kFloat), reply);
        if (!desc.ok()) return desc.status();
        result.elementwise.push_back(*desc);
      }
      result.metrics = loss->metrics;
      // Base-only rows ride along in the fused pass forward-only: nothing of theirs trains.
      if (backward && r.adapter != nullptr) total = total.defined() ? total + loss->total : loss->total;
    } else if (backward && r.adapter != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("forward_backward: op ", o, " trains adapter '",
                                                     op.adapter_id, "' but names no loss"));
    }
    body.ops.push_back(std::move(result));
  }
  if (backward && total.defined()) {
    total.backward();
    // Otherwise Forward counts it, once per request (passes, data parallelism).
    if (options.count_micro_batch) {
      for (const OpRows& r : rows) {
        if (r.adapter != nullptr) ++r.adapter->micro_batches_since_step;
      }
    }
  }
  return Reply(body, std::move(reply));
}

}  // namespace twinkle::engine
