// TrainingCoordinator: what runs on the scheduler thread — engine calls, residency
// (offload/reload), the Twinkle optimizer controls, and fused forward/backward steps.
#include <algorithm>
#include <cmath>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "core/common/log.h"
#include "core/training/coordinator.h"
#include "core/training/coordinator_state.h"
#include "core/training/inputs.h"

namespace twinkle::training {

using coordinator_internal::IsTwinkleLoss;
using coordinator_internal::kLog;

// ---- execution (scheduler thread) ----------------------------------------------------------

absl::StatusOr<ipc::Message> TrainingCoordinator::CallEngine(const char* method, std::string body,
                                                             std::vector<std::string> buffers) {
  return engine_.Call(ipc::MakeRequest(method, std::move(body), std::move(buffers)));
}

void TrainingCoordinator::SyncGeneration() {
  const uint64_t gen = engine_.generation();
  if (gen == generation_) return;
  generation_ = gen;
  // A new engine process holds no adapters. Resident ones it dropped go back to their restore
  // point (reloaded on next use like an offloaded adapter); without one their state is lost.
  // (A data-parallel rank restarted alone drops only the adapters it was home to.)
  absl::MutexLock lock(&mu_);
  for (const auto& [key, a] : adapters_) {
    if (!a->resident || !engine_.Dropped(key)) continue;
    a->resident = false;
    --stats_.resident;
    if (a->restore_point) {
      a->host_state = std::move(a->restore_point);
      a->lost_backwards += a->backwards_since_restore_point;
      a->backwards_since_restore_point = 0;
      ++stats_.restored;
      LogWarning(kLog, absl::StrCat("tenant ", a->tenant, ": adapter ", a->name,
                                    " restored to optimizer step ", a->optimizer_steps,
                                    " after an engine restart",
                                    a->lost_backwards > 0 ? absl::StrCat("; gradients of ", a->lost_backwards,
                                                                         " backward(s) lost")
                                                          : std::string()));
    } else {
      a->lost = true;
      ++stats_.lost;
      LogError(kLog, absl::StrCat("tenant ", a->tenant, ": adapter ", a->name,
                                  " lost its device state in an engine restart"));
    }
  }
}

void TrainingCoordinator::TakeRestorePoint(Adapter& a) {
  if (!options_.restore_points) return;
  a.restore_point.reset();
  a.backwards_since_restore_point = 0;
  absl::StatusOr<ipc::Message> state = CallEngine(ipc::kMethodGetAdapterState, ipc::Pack(ipc::AdapterRequest{a.key}));
  if (!state.ok()) {
    LogWarning(kLog, absl::StrCat("tenant ", a.tenant, ": adapter ", a.name,
                                  ": no restore point (", state.status().message(), ")"));
    return;
  }
  a.restore_point = std::make_shared<const ipc::Message>(*std::move(state));
}

absl::Status TrainingCoordinator::CheckNoLostGradients(Adapter& a) {
  if (a.lost_backwards == 0) return absl::OkStatus();
  const int64_t lost = a.lost_backwards;
  a.lost_backwards = 0;
  // What the backwards since the restart left would otherwise join the next window's.
  absl::StatusOr<ipc::Message> zeroed = CallEngine(ipc::kMethodZeroGrad, ipc::Pack(ipc::AdapterRequest{a.key}));
  if (!zeroed.ok()) return zeroed.status();
  TakeRestorePoint(a);
  return absl::AbortedError(absl::StrCat("adapter '", a.name, "': the gradients of ", lost,
                                         " forward_backward call(s) since optimizer step ", a.optimizer_steps,
                                         " were lost when the engine worker restarted (the adapter was restored "
                                         "to that step; this step's gradients are cleared): run the "
                                         "step's forward_backward calls again, then the optimizer step"));
}

absl::Status TrainingCoordinator::CreateOnEngine(Adapter& a) {
  ipc::CreateAdapterRequest req;
  req.adapter_id = a.key;
  req.rank = a.lora.rank;
  req.alpha = a.lora.alpha;
  req.dropout = a.lora.dropout;
  req.use_rslora = a.lora.use_rslora;
  req.targets = a.lora.targets;
  req.seed = a.lora.seed;
  req.optimizer = a.optimizer_cls;
  absl::StatusOr<ipc::Message> r = CallEngine(ipc::kMethodCreateAdapter, ipc::Pack(req));
  if (!r.ok()) return r.status();
  absl::StatusOr<ipc::CreateAdapterReply> reply =
      ipc::Unpack<ipc::CreateAdapterReply>(r->envelope.body, "create_adapter reply");
  if (!reply.ok()) return reply.status();
  a.num_parameters = reply->num_parameters;
  return absl::OkStatus();
}

absl::Status TrainingCoordinator::Offload(Adapter& a) {
  absl::StatusOr<ipc::Message> state = CallEngine(ipc::kMethodGetAdapterState, ipc::Pack(ipc::AdapterRequest{a.key}));
  if (!state.ok()) return state.status();
  absl::StatusOr<ipc::Message> removed = CallEngine(ipc::kMethodRemoveAdapter, ipc::Pack(ipc::AdapterRequest{a.key}));
  if (!removed.ok()) return removed.status();
  a.host_state = std::make_shared<const ipc::Message>(*std::move(state));
  a.restore_point.reset();  // the host state is newer, and complete
  a.backwards_since_restore_point = 0;
  a.resident = false;
  absl::MutexLock lock(&mu_);
  ++stats_.offloads;
  --stats_.resident;
  return absl::OkStatus();
}

absl::Status TrainingCoordinator::EnsureResident(Adapter& a, const std::vector<const Adapter*>& pinned) {
  if (a.lost) {
    // Never continue silently from older weights: the client decides (resume from a
    // checkpoint, or remove and start over).
    return absl::AbortedError(absl::StrCat("adapter '", a.name, "': adapter state lost since step ",
                                           a.optimizer_steps, " (the engine worker restarted); "
                                           "resume from checkpoint"));
  }
  a.last_use = ++use_tick_;
  if (a.resident) return absl::OkStatus();
  // Make room: offload the least recently used resident adapter not needed by this step.
  while (true) {
    std::vector<std::shared_ptr<Adapter>> resident;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [key, other] : adapters_) {
        if (other->resident) resident.push_back(other);
      }
    }
    if (static_cast<int32_t>(resident.size()) < options_.max_loras) break;
    std::shared_ptr<Adapter> victim;
    for (const auto& other : resident) {
      if (std::find(pinned.begin(), pinned.end(), other.get()) != pinned.end()) continue;
      if (!victim || other->last_use < victim->last_use) victim = other;
    }
    if (!victim) return absl::ResourceExhaustedError("every resident adapter is in use by this step");
    if (absl::Status s = Offload(*victim); !s.ok()) return s;
  }
  if (absl::Status s = CreateOnEngine(a); !s.ok()) return s;
  if (a.host_state) {
    absl::StatusOr<ipc::AdapterStateReply> state =
        ipc::Unpack<ipc::AdapterStateReply>(a.host_state->envelope.body, "get_adapter_state reply");
    if (!state.ok()) return state.status();
    absl::StatusOr<ipc::Message> set = CallEngine(
        ipc::kMethodSetAdapterState, ipc::Pack(ipc::RestoreRequestOf(*state, a.key)), a.host_state->buffers);
    if (!set.ok()) {
      (void)CallEngine(ipc::kMethodRemoveAdapter, ipc::Pack(ipc::AdapterRequest{a.key}));
      return set.status();
    }
    // What was just set is the adapter's state: it is also its restore point.
    if (options_.restore_points) a.restore_point = a.host_state;
    a.backwards_since_restore_point = 0;
    a.host_state.reset();
    absl::MutexLock lock(&mu_);
    ++stats_.reloads;
  } else {
    TakeRestorePoint(a);  // fresh: its initial weights
  }
  a.created_on_engine = true;
  a.resident = true;
  a.generation = generation_;
  absl::MutexLock lock(&mu_);
  ++stats_.resident;
  return absl::OkStatus();
}

FutureResult TrainingCoordinator::RunControl(Adapter& a, Control control, double max_norm, double norm_type) {
  SyncGeneration();
  OpOutput out;
  if (!a.Synced()) {  // inside a gradient-accumulation window: Twinkle does nothing
    out.skipped = true;
    return out;
  }
  if (absl::Status s = EnsureResident(a, {&a}); !s.ok()) return s;
  // The window's division by its token count, once, before the first norm or step.
  auto take_scale = [&] {
    const double scale = a.pending_grad_scale.value_or(1.0);
    a.pending_grad_scale.reset();
    return scale;
  };
  auto clip = [&]() -> absl::Status {
    ipc::ClipGradNormRequest req{a.key, max_norm, norm_type};
    req.grad_scale = take_scale();
    absl::StatusOr<ipc::Message> r = CallEngine(ipc::kMethodClipGradNorm, ipc::Pack(req));
    if (!r.ok()) return r.status();
    absl::StatusOr<ipc::ClipGradNormReply> reply =
        ipc::Unpack<ipc::ClipGradNormReply>(r->envelope.body, "clip_grad_norm reply");
    if (!reply.ok()) return reply.status();
    out.value = reply->total_norm;
    a.last_grad_norm = reply->total_norm;
    return absl::OkStatus();
  };
  auto step = [&](bool zero_grad) -> absl::Status {
    ipc::OptimStepRequest req;
    req.adapter_id = a.key;
    req.hyper = a.hyper;
    req.hyper["learning_rate"] = a.LearningRate();
    req.zero_grad = zero_grad;
    req.grad_scale = take_scale();
    absl::StatusOr<ipc::Message> r = CallEngine(ipc::kMethodOptimStep, ipc::Pack(req));
    if (!r.ok()) return r.status();
    a.last_lr = req.hyper["learning_rate"];
    ++a.optimizer_steps;
    return absl::OkStatus();
  };
  auto zero = [&]() -> absl::Status {
    absl::StatusOr<ipc::Message> r = CallEngine(ipc::kMethodZeroGrad, ipc::Pack(ipc::AdapterRequest{a.key}));
    if (r.ok()) a.pending_grad_scale.reset();  // the gradients it was for are gone
    return r.status();
  };
  absl::Status s;
  if (control == Control::kStep || control == Control::kClipGradAndStep) {
    if (absl::Status lost = CheckNoLostGradients(a); !lost.ok()) return lost;
  }
  switch (control) {
    case Control::kClipGradNorm:
      s = clip();
      break;
    case Control::kStep:
      s = step(false);
      if (s.ok()) out.value = *a.last_lr;
      break;
    case Control::kZeroGrad:
      s = zero();
      break;
    case Control::kLrStep:
      ++a.lr_steps;
      out.value = a.LearningRate();
      break;
    case Control::kClipGradAndStep:
      s = clip();
      if (s.ok()) s = step(true);  // step, then zero_grad
      if (s.ok()) ++a.lr_steps;
      break;
  }
  if (!s.ok()) return s;
  if (control == Control::kStep || control == Control::kZeroGrad || control == Control::kClipGradAndStep) {
    TakeRestorePoint(a);
  }
  return out;
}

namespace {

// Twinkle's token-mean losses over an accumulation window. The window's later calls are not
// known when its first one runs, so each call's loss is divided by this constant (a power of
// two: exact) instead of its own token count, and when the window is complete its gradients
// are multiplied by kWindowUnit / (the window's tokens): Σ_calls ∇(sum of token losses) /
// window tokens, which is what one call with the whole window's batch computes (and what
// Twinkle's clip_grad_norm does when it divides the gradients by the token count).
constexpr int64_t kWindowUnit = int64_t{1} << 31;

bool WindowedLoss(int32_t gradient_accumulation_steps, const ipc::LossSpecMsg& loss) {
  if (gradient_accumulation_steps <= 1) return false;
  if (loss.name == "twinkle:cross_entropy") {
    auto r = loss.string_config.find("reduction");
    return r == loss.string_config.end() || r->second != "sum";
  }
  return loss.name == "twinkle:cispo" || loss.name == "twinkle:bnpo";
}

}  // namespace

std::vector<FutureResult> TrainingCoordinator::RunFused(const std::vector<const sched::Op*>& batch) {
  SyncGeneration();
  const bool backward = batch[0]->kind == sched::OpKind::kForwardBackward;
  std::vector<FutureResult> results(batch.size(), absl::InternalError("not run"));
  std::vector<const Adapter*> pinned;
  for (const sched::Op* op : batch) pinned.push_back(std::any_cast<const FusedPayload&>(op->payload).adapter.get());

  // Each op's engine part; ops that cannot run get their error here and stay out.
  ipc::Message request;
  ipc::ForwardRequest body;
  std::vector<size_t> included;
  std::vector<const PackedOp*> packed_of(batch.size(), nullptr);
  for (size_t i = 0; i < batch.size(); ++i) {
    const FusedPayload& p = std::any_cast<const FusedPayload&>(batch[i]->payload);
    Adapter& a = *p.adapter;
    const PackedOp* packed = p.packed ? &*p.packed : (a.last_forward ? &*a.last_forward : nullptr);
    if (packed == nullptr) {
      results[i] = absl::FailedPreconditionError("backward: no forward has run on this adapter yet");
      continue;
    }
    if (absl::Status s = EnsureResident(a, pinned); !s.ok()) {
      results[i] = s;
      continue;
    }
    ipc::TrainOpMsg msg = AppendFrames(*packed, request.buffers);
    msg.adapter_id = a.key;
    msg.disable_adapter = p.disable_lora;
    if (p.mode != ForwardMode::kForwardOnly) {
      // A loss named by the call itself (Tinker) wins over the adapter's SetLoss.
      if (msg.loss.name.empty()) msg.loss = a.loss;
      // Tinker's losses take per-token weights where Twinkle's take a mask.
      if (!IsTwinkleLoss(msg.loss.name)) {
        for (ipc::DatumMsg& d : msg.datums) {
          auto mask = d.inputs.find("mask");
          if (mask == d.inputs.end()) continue;
          if (msg.loss.name == "cross_entropy") d.inputs["weights"] = mask->second;
          d.inputs.erase("mask");
        }
      }
    }
    if (backward && WindowedLoss(a.gradient_accumulation_steps, msg.loss)) {
      if (a.backward_count % a.gradient_accumulation_steps == 0) a.window_tokens = 0;  // a new window
      msg.window_tokens = kWindowUnit;
    }
    body.ops.push_back(std::move(msg));
    included.push_back(i);
    packed_of[i] = packed;
  }
  if (included.empty()) return results;
  // One op's engine error must not fail the others: if a fused step fails, run each alone.
  request.envelope.method = backward ? ipc::kMethodForwardBackward : ipc::kMethodForward;
  body.max_pass_bytes = options_.activation_memory_bytes;  // over it, the engine runs passes
  request.envelope.body = ipc::Pack(body);
  absl::StatusOr<ipc::Message> reply = engine_.Call(std::move(request));
  if (!reply.ok() && included.size() > 1) {
    for (size_t i : included) results[i] = RunFused({batch[i]})[0];
    return results;
  }
  absl::StatusOr<ipc::ForwardReply> parsed =
      reply.ok() ? ipc::Unpack<ipc::ForwardReply>(reply->envelope.body, "forward reply")
                 : absl::StatusOr<ipc::ForwardReply>(reply.status());
  if (parsed.ok() && parsed->ops.size() != included.size()) {
    parsed = absl::InternalError("engine reply: wrong number of op results");
  }
  for (size_t k = 0; k < included.size(); ++k) {
    const size_t i = included[k];
    if (!parsed.ok()) {
      results[i] = parsed.status();
      continue;
    }
    const FusedPayload& p = std::any_cast<const FusedPayload&>(batch[i]->payload);
    Adapter& a = *p.adapter;
    const ipc::OpResultMsg& r = parsed->ops[k];
    OpOutput out;
    absl::Status s;
    for (size_t d = 0; d < r.logprobs.size() && s.ok(); ++d) {
      SequenceResult seq;
      absl::StatusOr<std::vector<float>> lp = ipc::ReadVectorFrame<float>(r.logprobs[d], reply->buffers, "engine reply");
      if (!lp.ok()) s = lp.status();
      else seq.logps = *std::move(lp);
      if (s.ok() && d < r.elementwise.size()) {
        absl::StatusOr<std::vector<float>> el = ipc::ReadVectorFrame<float>(r.elementwise[d], reply->buffers, "engine reply");
        if (!el.ok()) s = el.status();
        else seq.loss = *std::move(el);
      }
      // Nothing follows the last token (unless the caller gave its target: Tinker).
      if (!seq.logps.empty() && !packed_of[i]->explicit_targets) seq.logps.back() = 0;
      for (float v : seq.loss) out.loss += v;
      out.sequences.push_back(std::move(seq));
    }
    if (!s.ok()) {
      results[i] = s;
      continue;
    }
    out.metrics = r.metrics;
    if (backward && WindowedLoss(a.gradient_accumulation_steps, body.ops[k].loss)) {
      // The engine divided by kWindowUnit: report this call's own mean, as without a window,
      // and count its tokens towards the window's division.
      const auto n = out.metrics.find("num_tokens:sum");
      const int64_t tokens = n == out.metrics.end() ? 0 : static_cast<int64_t>(n->second);
      const double to_mean = static_cast<double>(kWindowUnit) / static_cast<double>(std::max<int64_t>(tokens, 1));
      out.loss *= to_mean;
      for (SequenceResult& seq : out.sequences) {
        for (float& v : seq.loss) v = static_cast<float>(v * to_mean);
      }
      if (auto m = out.metrics.find("loss:mean"); m != out.metrics.end()) m->second *= to_mean;
      a.window_tokens += tokens;
      if ((a.backward_count + 1) % a.gradient_accumulation_steps == 0) {
        a.pending_grad_scale = static_cast<double>(kWindowUnit) / static_cast<double>(std::max<int64_t>(a.window_tokens, 1));
      }
    }
    if (p.mode != ForwardMode::kForwardOnly) {
      a.loss_sum += out.loss;
      ++a.loss_count;
    }
    if (p.mode == ForwardMode::kForward) {
      a.last_forward = *packed_of[i];
      a.last_loss = out.loss;
    }
    if (backward) {
      ++a.backward_count;
      ++a.backwards_since_restore_point;
    }
    results[i] = std::move(out);
  }
  return results;
}

}  // namespace twinkle::training

namespace twinkle::training {

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitOptimStep(const TenantContext& tenant, const std::string& name,
                                                              const std::map<std::string, double>& hyper,
                                                              const SubmitOptions& options) {
  static const char* const kKeys[] = {"learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"};
  for (const auto& [key, value] : hyper) {
    if (std::find_if(std::begin(kKeys), std::end(kKeys), [&](const char* k) { return key == k; }) == std::end(kKeys)) {
      return absl::InvalidArgumentError(absl::StrCat("adam_params.", key, ": unknown parameter"));
    }
    if (!std::isfinite(value)) return absl::InvalidArgumentError(absl::StrCat("adam_params.", key, ": not finite"));
  }
  absl::StatusOr<std::shared_ptr<Adapter>> adapter = Find(tenant, name);
  if (!adapter.ok()) return adapter.status();
  std::shared_ptr<Adapter> a = *adapter;
  return SubmitControlOp(tenant, a, "optim_step", [this, a, hyper]() -> FutureResult {
    SyncGeneration();
    if (absl::Status s = EnsureResident(*a, {a.get()}); !s.ok()) return s;
    if (absl::Status s = CheckNoLostGradients(*a); !s.ok()) return s;
    ipc::OptimStepRequest req;
    req.adapter_id = a->key;
    req.hyper = hyper;
    req.zero_grad = true;
    absl::StatusOr<ipc::Message> r = CallEngine(ipc::kMethodOptimStep, ipc::Pack(req));
    if (!r.ok()) return r.status();
    absl::StatusOr<ipc::OptimStepReply> reply = ipc::Unpack<ipc::OptimStepReply>(r->envelope.body, "optim_step reply");
    if (!reply.ok()) return reply.status();
    ++a->optimizer_steps;
    a->last_grad_norm = reply->grad_norm;
    a->last_lr = reply->learning_rate;
    TakeRestorePoint(*a);
    OpOutput out;
    out.value = reply->learning_rate;
    out.metrics = {{"grad_norm:mean", reply->grad_norm}, {"learning_rate:mean", reply->learning_rate}};
    return out;
  }, options);
}

}  // namespace twinkle::training
