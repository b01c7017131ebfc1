// TrainingCoordinator, submission: every Submit* call checks its arguments on the caller's
// thread, then puts one op on the adapter's queue (core/scheduler) and returns its future id
// at once; the op's work runs later on the scheduler thread (coordinator_execution.cc). The
// lifecycle, sessions and adapters are in coordinator.cc, checkpoints in
// coordinator_checkpoints.cc.
#include "core/training/coordinator.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/ipc/forward_split.h"
#include "core/ipc/messages.h"
#include "core/ipc/training_messages.h"
#include "core/training/coordinator_state.h"
#include "core/training/inputs.h"

namespace twinkle::training {
namespace {

// Twinkle class names → the engine's loss names; engine names pass through.
std::string EngineLossName(const std::string& cls) {
  static const std::map<std::string, std::string> kAliases = {
      {"CrossEntropyLoss", "twinkle:cross_entropy"}, {"GRPOLoss", "twinkle:grpo"},
      {"GSPOLoss", "twinkle:gspo"},                  {"CISPOLoss", "twinkle:cispo"},
      {"BNPOLoss", "twinkle:bnpo"},                  {"DRGRPOLoss", "twinkle:dr_grpo"},
      {"DPOLoss", "twinkle:dpo"}};
  auto it = kAliases.find(cls);
  return it == kAliases.end() ? cls : it->second;
}

// Twinkle's keyword names → the engine optimizer's.
absl::StatusOr<std::map<std::string, double>> OptimizerHyper(const std::map<std::string, double>& config) {
  static const std::map<std::string, std::string> kNames = {
      {"lr", "learning_rate"}, {"learning_rate", "learning_rate"}, {"weight_decay", "weight_decay"},
      {"beta1", "beta1"},      {"beta2", "beta2"},                 {"eps", "eps"},
      {"momentum", "momentum"}, {"dampening", "dampening"},        {"nesterov", "nesterov"},
      {"max_grad_norm", "grad_clip_norm"}};
  std::map<std::string, double> out = {{"learning_rate", kDefaultLr}, {"weight_decay", kDefaultWeightDecay}};
  for (const auto& [key, value] : config) {
    auto it = kNames.find(key);
    if (it == kNames.end()) {
      std::vector<std::string> known;
      for (const auto& [k, v] : kNames) known.push_back(k);
      return absl::InvalidArgumentError(absl::StrCat("config.", key, ": unknown optimizer argument (accepted: ",
                                                     absl::StrJoin(known, ", "), ")"));
    }
    if (!std::isfinite(value)) return absl::InvalidArgumentError(absl::StrCat("config.", key, ": not finite"));
    out[it->second] = value;
  }
  return out;
}

const char* ControlName(Control control) {
  switch (control) {
    case Control::kClipGradNorm: return "clip_grad_norm";
    case Control::kStep: return "step";
    case Control::kZeroGrad: return "zero_grad";
    case Control::kLrStep: return "lr_step";
    case Control::kClipGradAndStep: return "clip_grad_and_step";
  }
  return "control";
}

std::string FormatNumber(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

}  // namespace

// ---- submission ----------------------------------------------------------------------------

absl::Status TrainingCoordinator::CheckPending(const TenantContext& tenant) const {
  const int64_t pending = scheduler_->queued_for_tenant(tenant.id);
  if (pending >= tenant.max_pending_ops) {
    return absl::ResourceExhaustedError(absl::StrCat("you have ", pending, " queued ops, your quota (max_pending_ops) is ",
                                                     tenant.max_pending_ops, "; wait for some to finish"));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitWithWeights(const TenantContext& tenant,
                                                                const std::string& name,
                                                                std::function<FutureResult(CapturedWeights)> then,
                                                                const SubmitOptions& options) {
  absl::StatusOr<std::shared_ptr<Adapter>> adapter = Find(tenant, name);
  if (!adapter.ok()) return adapter.status();
  std::shared_ptr<Adapter> a = *adapter;
  return SubmitControlOp(tenant, a, "snapshot", [this, a, then = std::move(then)]() -> FutureResult {
    SyncGeneration();
    if (absl::Status s = EnsureResident(*a, {a.get()}); !s.ok()) return s;
    absl::StatusOr<ipc::Message> state = CallEngine(ipc::kMethodGetAdapterState, ipc::Pack(ipc::AdapterRequest{a->key}));
    if (!state.ok()) return state.status();
    absl::StatusOr<ipc::AdapterStateReply> body =
        ipc::Unpack<ipc::AdapterStateReply>(state->envelope.body, "get_adapter_state reply");
    if (!body.ok()) return body.status();
    // Keep the weights only (the reply also carries gradients and optimizer state).
    CapturedWeights captured;
    captured.config = body->config;
    for (const auto& [key, desc] : body->weights) {
      if (absl::Status s = ipc::ValidateTensor(desc, state->buffers); !s.ok()) return s;
      ipc::TensorDesc copy = desc;
      copy.frame = static_cast<uint32_t>(captured.buffers.size());
      captured.buffers.push_back(std::move(state->buffers[desc.frame]));
      captured.weights.emplace(key, std::move(copy));
    }
    return then(std::move(captured));
  }, options);
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitTask(const TenantContext& tenant, const std::string& queue,
                                                         const char* name, int64_t tokens, std::function<FutureResult(uint64_t)> run,
                                                         const SubmitOptions& options) {
  if (absl::Status s = CheckPending(tenant); !s.ok()) return s;
  sched::Op op;
  op.tenant = tenant.id;
  op.adapter = TaskQueue(tenant.id, queue);
  op.usage.key_id = tenant.key_id;
  op.kind = sched::OpKind::kOther;
  op.tokens = tokens;
  op.deadline = options.deadline;
  op.seq_id = options.seq_id;
  op.idempotency_key = options.idempotency_key;
  op.name = name;
  op.fingerprint = options.fingerprint;
  op.payload = ControlPayload{[this, run = std::move(run)]() -> FutureResult { return run(current_op_); }};
  return scheduler_->Submit(std::move(op));
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitControlOp(const TenantContext& tenant,
                                                              const std::shared_ptr<Adapter>& adapter,
                                                              const char* name, std::function<FutureResult()> run,
                                                              const SubmitOptions& options) {
  if (absl::Status s = CheckPending(tenant); !s.ok()) return s;
  sched::Op op;
  op.tenant = tenant.id;
  op.adapter = adapter->key;
  op.usage = {tenant.key_id, adapter->run_id, adapter->session_id};
  op.kind = sched::OpKind::kOther;
  op.deadline = options.deadline;
  op.seq_id = options.seq_id;
  op.idempotency_key = options.idempotency_key;
  op.name = name;
  op.fingerprint = options.fingerprint;
  op.payload = ControlPayload{std::move(run)};
  return scheduler_->Submit(std::move(op));
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitForward(const TenantContext& tenant, const std::string& name,
                                                            ForwardMode mode, const ForwardArgs& args,
                                                            bool disable_lora, const SubmitOptions& options) {
  absl::StatusOr<std::shared_ptr<Adapter>> adapter = Find(tenant, name);
  if (!adapter.ok()) return adapter.status();
  const int64_t vocab = engine_.vocab_size();
  if (vocab <= 0) return absl::UnavailableError("the engine has not loaded the model yet");
  absl::StatusOr<PackedOp> packed = PackForward(args, vocab, options_.max_tokens_per_request);
  if (!packed.ok()) return packed.status();
  if (packed->tokens > tenant.max_tokens_per_request) {
    return absl::FailedPreconditionError(absl::StrCat("inputs: ", packed->tokens, " tokens, above your quota of ",
                                                      tenant.max_tokens_per_request, " per request (max_tokens_per_request)"));
  }
  // Refused here, before the op is queued: on the engine it would fail its whole fused step.
  const int64_t context = options_.max_context_tokens > 0 ? options_.max_context_tokens
                                                          : engine_.max_position_embeddings();
  for (size_t i = 0; context > 0 && i < packed->lengths.size(); ++i) {
    if (packed->lengths[i] > context) {
      return absl::InvalidArgumentError(absl::StrCat(
          "inputs: sequence ", i, " holds ", packed->lengths[i], " tokens, above the model's context of ",
          context, " tokens (", options_.max_context_tokens > 0 ? "model.max_context_tokens" : "max_position_embeddings",
          ")"));
    }
  }
  // Memory admission, also before any engine memory is spent: the engine's estimate of this
  // request's activations (as a forward_backward's, also for a forward: on the safe side).
  // Above the budget, the engine runs a request in passes that each fit (their gradients
  // accumulate), cutting between sequences where the loss is a sum over them (Tinker's
  // losses, forward-only); so what must fit is one sequence, or the whole request when its
  // loss (Twinkle's, the adapter's) is taken over all its sequences together.
  const int64_t activation_bytes = EstimateActivationBytes(engine_.activation_cost(), packed->lengths);
  const int64_t budget = options_.activation_memory_bytes;
  if (budget > 0 && activation_bytes > budget) {
    constexpr int64_t kMiB = int64_t{1} << 20;
    auto mib = [](int64_t bytes) { return bytes / kMiB + (bytes % kMiB != 0 ? 1 : 0); };
    const std::string loss = args.loss ? args.loss->name : "";
    const bool in_passes = mode == ForwardMode::kForwardOnly || (args.loss && LossSplitsOverDatums(loss));
    if (!in_passes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "inputs: ", packed->tokens, " tokens in ", packed->lengths.size(), " sequences need an estimated ",
          mib(activation_bytes), " MiB of activation memory, above the ", budget / kMiB,
          " MiB a step may use (engine.activation_memory_mib), and the loss ",
          loss.empty() ? "set on the adapter" : absl::StrCat("'", loss, "'"),
          " is taken over all of a request's sequences together, so the request cannot run in passes; send "
          "fewer or shorter sequences per request"));
    }
    for (size_t i = 0; i < packed->lengths.size(); ++i) {
      const int64_t alone = EstimateActivationBytes(engine_.activation_cost(), {packed->lengths[i]});
      if (alone > budget) {
        return absl::InvalidArgumentError(absl::StrCat(
            "inputs: sequence ", i, " (", packed->lengths[i], " tokens) alone needs an estimated ", mib(alone),
            " MiB of activation memory, above the ", budget / kMiB,
            " MiB a step may use (engine.activation_memory_mib); send shorter sequences, or enable "
            "engine.activation_checkpointing"));
      }
    }
  }
  if (absl::Status s = CheckPending(tenant); !s.ok()) return s;
  sched::Op op;
  op.tenant = tenant.id;
  op.adapter = (*adapter)->key;
  op.usage = {tenant.key_id, (*adapter)->run_id, (*adapter)->session_id};
  op.kind = mode == ForwardMode::kForwardBackward ? sched::OpKind::kForwardBackward : sched::OpKind::kForward;
  op.tokens = packed->tokens;
  op.activation_bytes = activation_bytes;
  if (mode == ForwardMode::kForward) (*adapter)->last_forward_activation_bytes = activation_bytes;
  op.deadline = options.deadline;
  op.seq_id = options.seq_id;
  op.idempotency_key = options.idempotency_key;
  op.name = mode == ForwardMode::kForwardBackward ? "forward_backward"
            : mode == ForwardMode::kForward       ? "forward"
                                                  : "forward_only";
  op.fingerprint = options.fingerprint;
  op.payload = FusedPayload{*adapter, *std::move(packed), mode, disable_lora && mode == ForwardMode::kForwardOnly};
  return scheduler_->Submit(std::move(op));
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitBackward(const TenantContext& tenant, const std::string& name,
                                                             const SubmitOptions& options) {
  absl::StatusOr<std::shared_ptr<Adapter>> adapter = Find(tenant, name);
  if (!adapter.ok()) return adapter.status();
  if (absl::Status s = CheckPending(tenant); !s.ok()) return s;
  sched::Op op;
  op.tenant = tenant.id;
  op.adapter = (*adapter)->key;
  op.usage = {tenant.key_id, (*adapter)->run_id, (*adapter)->session_id};
  op.kind = sched::OpKind::kForwardBackward;
  op.tokens = 1;
  // It reruns the adapter's last forward with backward: that forward's estimate.
  op.activation_bytes = (*adapter)->last_forward_activation_bytes;
  op.deadline = options.deadline;
  op.seq_id = options.seq_id;
  op.idempotency_key = options.idempotency_key;
  op.name = "backward";
  op.fingerprint = options.fingerprint;
  op.payload = FusedPayload{*adapter, std::nullopt, ForwardMode::kForwardBackward, false};
  return scheduler_->Submit(std::move(op));
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitCalculateLoss(const TenantContext& tenant,
                                                                  const std::string& name,
                                                                  const SubmitOptions& options) {
  absl::StatusOr<std::shared_ptr<Adapter>> adapter = Find(tenant, name);
  if (!adapter.ok()) return adapter.status();
  Adapter* a = adapter->get();
  return SubmitControlOp(tenant, *adapter, "calculate_loss", [a]() -> FutureResult {
    if (!a->last_loss) return absl::FailedPreconditionError("calculate_loss: no forward has run on this adapter yet");
    OpOutput out;
    out.value = out.loss = *a->last_loss;
    return out;
  }, options);
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitControl(const TenantContext& tenant, const std::string& name,
                                                            Control control, double max_norm, double norm_type,
                                                            const SubmitOptions& options) {
  absl::StatusOr<std::shared_ptr<Adapter>> adapter = Find(tenant, name);
  if (!adapter.ok()) return adapter.status();
  if (control == Control::kClipGradNorm || control == Control::kClipGradAndStep) {
    if (!(max_norm > 0) || !std::isfinite(max_norm)) {
      return absl::InvalidArgumentError(absl::StrCat("max_grad_norm: ", max_norm, " must be a positive number"));
    }
    if (norm_type != 2 && !std::isinf(norm_type)) {
      return absl::InvalidArgumentError(absl::StrCat("norm_type: ", norm_type, " is not supported (2 or inf)"));
    }
  }
  std::shared_ptr<Adapter> a = *adapter;
  return SubmitControlOp(tenant, a, ControlName(control), [this, a, control, max_norm, norm_type]() -> FutureResult {
    return RunControl(*a, control, max_norm, norm_type);
  }, options);
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitSetLoss(const TenantContext& tenant, const std::string& name,
                                                            const std::string& loss_cls,
                                                            const std::map<std::string, double>& config,
                                                            const std::map<std::string, std::string>& string_config) {
  absl::StatusOr<std::shared_ptr<Adapter>> adapter = Find(tenant, name);
  if (!adapter.ok()) return adapter.status();
  const std::string engine_name = EngineLossName(loss_cls);
  const std::vector<std::string> known = engine_.supported_losses();
  if (std::find(known.begin(), known.end(), engine_name) == known.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss_cls: unsupported loss '", loss_cls, "' (supported: CrossEntropyLoss, GRPOLoss, GSPOLoss, CISPOLoss, "
        "BNPOLoss, DRGRPOLoss, DPOLoss, or the engine names ", absl::StrJoin(known, ", "), ")"));
  }
  for (const auto& [key, value] : config) {
    if (!std::isfinite(value)) return absl::InvalidArgumentError(absl::StrCat("config.", key, ": not finite"));
  }
  std::shared_ptr<Adapter> a = *adapter;
  ipc::LossSpecMsg spec{engine_name, config, string_config};
  return SubmitControlOp(tenant, a, "set_loss", [a, spec]() -> FutureResult {
    a->loss = spec;
    return OpOutput{};
  }, {});
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitSetOptimizer(const TenantContext& tenant, const std::string& name,
                                                                 const std::string& optimizer_cls,
                                                                 const std::map<std::string, double>& config) {
  absl::StatusOr<std::shared_ptr<Adapter>> adapter = Find(tenant, name);
  if (!adapter.ok()) return adapter.status();
  const std::string kind = absl::AsciiStrToLower(optimizer_cls);
  if (kind != "adamw" && kind != "adam" && kind != "sgd") {
    return absl::InvalidArgumentError(absl::StrCat("optimizer_cls: unsupported optimizer '", optimizer_cls,
                                                   "' (supported: AdamW, Adam, SGD)"));
  }
  absl::StatusOr<std::map<std::string, double>> hyper = OptimizerHyper(config);
  if (!hyper.ok()) return hyper.status();
  std::shared_ptr<Adapter> a = *adapter;
  return SubmitControlOp(tenant, a, "set_optimizer", [this, a, kind, hyper = *hyper]() -> FutureResult {
    SyncGeneration();
    if (absl::Status s = EnsureResident(*a, {a.get()}); !s.ok()) return s;
    ipc::SetOptimizerRequest req{a->key, kind};
    absl::StatusOr<ipc::Message> r = CallEngine(ipc::kMethodSetOptimizer, ipc::Pack(req));
    if (!r.ok()) return r.status();
    a->optimizer_cls = kind;
    a->hyper = hyper;
    a->optimizer_steps = 0;
    TakeRestorePoint(*a);  // a fresh optimizer: the old restore point's moments no longer apply
    return OpOutput{};
  }, {});
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitSetLrScheduler(const TenantContext& tenant, const std::string& name,
                                                                   const std::string& scheduler_cls,
                                                                   const std::map<std::string, double>& config) {
  absl::StatusOr<std::shared_ptr<Adapter>> adapter = Find(tenant, name);
  if (!adapter.ok()) return adapter.status();
  SchedulerSpec spec{scheduler_cls, config};
  absl::StatusOr<std::unique_ptr<LrScheduler>> made = LrScheduler::Create(spec);
  if (!made.ok()) return absl::InvalidArgumentError(absl::StrCat("scheduler_cls: ", made.status().message()));
  std::shared_ptr<Adapter> a = *adapter;
  return SubmitControlOp(tenant, a, "set_lr_scheduler", [a, spec]() -> FutureResult {
    a->schedule = spec;
    a->scheduler = *LrScheduler::Create(spec);
    a->lr_steps = 0;
    return OpOutput{};
  }, {});
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitCalculateMetric(const TenantContext& tenant,
                                                                    const std::string& name, bool is_training) {
  absl::StatusOr<std::shared_ptr<Adapter>> adapter = Find(tenant, name);
  if (!adapter.ok()) return adapter.status();
  std::shared_ptr<Adapter> a = *adapter;
  return SubmitControlOp(tenant, a, "calculate_metric", [a]() -> FutureResult {
    OpOutput out;
    if (a->loss_count > 0) out.metric_strings["loss"] = FormatNumber(a->loss_sum / static_cast<double>(a->loss_count));
    if (a->last_grad_norm) out.metric_strings["grad_norm"] = FormatNumber(*a->last_grad_norm);
    if (a->last_lr) out.metric_strings["learning rate"] = FormatNumber(*a->last_lr);
    out.metric_strings["iters"] = absl::StrCat(a->optimizer_steps);
    a->loss_sum = 0;
    a->loss_count = 0;
    return out;
  }, {});
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitGetTrainConfigs(const TenantContext& tenant,
                                                                    const std::string& name) {
  absl::StatusOr<std::shared_ptr<Adapter>> adapter = Find(tenant, name);
  if (!adapter.ok()) return adapter.status();
  std::shared_ptr<Adapter> a = *adapter;
  return SubmitControlOp(tenant, a, "get_train_configs", [a]() -> FutureResult {
    nlohmann::json j;
    j["adapter_name"] = a->name;
    j["run_id"] = a->run_id;
    j["lora"] = {{"r", a->lora.rank}, {"lora_alpha", a->lora.alpha}, {"lora_dropout", a->lora.dropout},
                 {"target_modules", a->lora.targets}, {"use_rslora", a->lora.use_rslora}};
    j["gradient_accumulation_steps"] = a->gradient_accumulation_steps;
    j["loss"] = {{"name", a->loss.name}, {"config", a->loss.config}};
    j["optimizer"] = {{"name", a->optimizer_cls}, {"config", a->hyper}};
    if (a->schedule) j["lr_scheduler"] = {{"name", a->schedule->name}, {"config", a->schedule->config}};
    j["cur_step"] = a->backward_count;
    j["optimizer_steps"] = a->optimizer_steps;
    OpOutput out;
    out.text = j.dump();
    return out;
  }, {});
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitGetStateDict(const TenantContext& tenant,
                                                                 const std::string& name) {
  absl::StatusOr<std::shared_ptr<Adapter>> adapter = Find(tenant, name);
  if (!adapter.ok()) return adapter.status();
  std::shared_ptr<Adapter> a = *adapter;
  return SubmitControlOp(tenant, a, "get_state_dict", [this, a]() -> FutureResult {
    SyncGeneration();
    if (absl::Status s = EnsureResident(*a, {a.get()}); !s.ok()) return s;
    absl::StatusOr<ipc::Message> r = CallEngine(ipc::kMethodGetAdapterState, ipc::Pack(ipc::AdapterRequest{a->key}));
    if (!r.ok()) return r.status();
    absl::StatusOr<ipc::AdapterStateReply> state =
        ipc::Unpack<ipc::AdapterStateReply>(r->envelope.body, "get_adapter_state reply");
    if (!state.ok()) return state.status();
    OpOutput out;
    for (const auto& [key, desc] : state->weights) {
      absl::StatusOr<std::vector<float>> values = ipc::ReadVectorFrame<float>(desc, r->buffers, "engine reply");
      if (!values.ok()) return values.status();
      out.tensors[key] = FloatTensor{desc.shape, *std::move(values)};
    }
    return out;
  }, {});
}


}  // namespace twinkle::training
