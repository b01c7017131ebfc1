#include "core/engine/trainer.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/common/log.h"
#include "core/engine/sampler/sampler.h"
#include "core/engine/tensor_io.h"
#include "core/ipc/training_messages.h"

namespace twinkle::engine {
namespace {

absl::Status ApplyHyper(const std::map<std::string, double>& in, OptimizerHyper& out) {
  for (const auto& [key, value] : in) {
    if (key == "learning_rate") out.learning_rate = value;
    else if (key == "beta1") out.beta1 = value;
    else if (key == "beta2") out.beta2 = value;
    else if (key == "eps") out.eps = value;
    else if (key == "weight_decay") out.weight_decay = value;
    else if (key == "grad_clip_norm") out.grad_clip_norm = value;
    else if (key == "momentum") out.momentum = value;
    else if (key == "dampening") out.dampening = value;
    else if (key == "nesterov") out.nesterov = value != 0;
    else {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown optimizer parameter '", key,
          "' (accepted: learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm, momentum, "
          "dampening, nesterov)"));
    }
  }
  return absl::OkStatus();
}

// The coordinator's grad_scale (a Twinkle accumulation window's 1 / tokens), in place.
void ScaleGrads(const Adapter& adapter, double scale) {
  if (scale == 1.0) return;
  for (const auto& [name, t] : adapter.named_parameters()) {
    if (t.grad().defined()) t.grad().mul_(scale);
  }
}

}  // namespace

Trainer::Trainer(std::unique_ptr<DecoderModel> model, c10::Device device, int64_t max_lora_rank,
                 std::unique_ptr<ProcessGroup> group)
    : model_(std::move(model)), device_(device), max_lora_rank_(max_lora_rank), group_(std::move(group)) {}

absl::Status Trainer::InitSampler(at::ScalarType dtype, KvCacheSize cache_size) {
  absl::StatusOr<std::unique_ptr<Sampler>> sampler =
      Sampler::Create(*model_, device_, dtype, cache_size,
                      [this](const std::string& id) { return FindAdapter(id); });
  if (!sampler.ok()) return sampler.status();
  sampler_ = *std::move(sampler);
  return absl::OkStatus();
}

void Trainer::RegisterMethods(std::map<std::string, Method>& m) {
  m[ipc::kMethodCreateAdapter] = [this](const ipc::Message& r) { return CreateAdapter(r); };
  m[ipc::kMethodRemoveAdapter] = [this](const ipc::Message& r) { return RemoveAdapter(r); };
  m[ipc::kMethodForward] = [this](const ipc::Message& r) { return Forward(r, false); };
  m[ipc::kMethodForwardBackward] = [this](const ipc::Message& r) { return Forward(r, true); };
  m[ipc::kMethodOptimStep] = [this](const ipc::Message& r) { return OptimStep(r); };
  m[ipc::kMethodZeroGrad] = [this](const ipc::Message& r) { return ZeroGrad(r); };
  m[ipc::kMethodSetOptimizer] = [this](const ipc::Message& r) { return SetOptimizer(r); };
  m[ipc::kMethodClipGradNorm] = [this](const ipc::Message& r) { return ClipGradNorm(r); };
  m[ipc::kMethodGetAdapterState] = [this](const ipc::Message& r) { return GetAdapterState(r); };
  m[ipc::kMethodSetAdapterState] = [this](const ipc::Message& r) { return SetAdapterState(r); };
  m[ipc::kMethodSample] = [this](const ipc::Message& r) { return sampler_->Sample(r); };
  m[ipc::kMethodSampleStep] = [this](const ipc::Message& r) { return sampler_->SampleStep(r); };
  m[ipc::kMethodRejoinGroup] = [this](const ipc::Message& r) { return RejoinGroup(r); };
}

absl::StatusOr<MethodReply> Trainer::RejoinGroup(const ipc::Message& request) {
  absl::StatusOr<ipc::RejoinGroupRequest> req =
      ipc::Unpack<ipc::RejoinGroupRequest>(request.envelope.body, ipc::kMethodRejoinGroup);
  if (!req.ok()) return req.status();
  if (group_ == nullptr) {
    return absl::FailedPreconditionError("rejoin_group: this worker is not a rank of a process group");
  }
  if (absl::Status s = group_->Rejoin(req->epoch); !s.ok()) return s;
  Log(LogLevel::kInfo, "trainer", absl::StrCat("process group: rejoining at epoch ", req->epoch));
  return Reply(ipc::RejoinGroupRequest{req->epoch});
}

absl::StatusOr<Adapter*> Trainer::FindAdapter(const std::string& id) {
  auto it = adapters_.find(id);
  if (it == adapters_.end()) return absl::NotFoundError(absl::StrCat("no adapter '", id, "'"));
  return it->second.get();
}

template <typename Request>
absl::StatusOr<Trainer::AdapterCall<Request>> Trainer::ParseAdapterCall(const ipc::Message& request,
                                                                        const char* method) {
  absl::StatusOr<Request> req = ipc::Unpack<Request>(request.envelope.body, method);
  if (!req.ok()) return req.status();
  absl::StatusOr<Adapter*> adapter = FindAdapter(req->adapter_id);
  if (!adapter.ok()) return adapter.status();
  return AdapterCall<Request>{*std::move(req), *adapter};
}

absl::StatusOr<MethodReply> Trainer::CreateAdapter(const ipc::Message& request) {
  absl::StatusOr<ipc::CreateAdapterRequest> req =
      ipc::Unpack<ipc::CreateAdapterRequest>(request.envelope.body, ipc::kMethodCreateAdapter);
  if (!req.ok()) return req.status();
  if (req->adapter_id.empty()) return absl::InvalidArgumentError("adapter_id must not be empty");
  if (adapters_.count(req->adapter_id)) {
    return absl::AlreadyExistsError(absl::StrCat("adapter '", req->adapter_id, "' already exists"));
  }
  if (max_lora_rank_ > 0 && req->rank > max_lora_rank_) {
    return absl::FailedPreconditionError(absl::StrCat("LoRA rank ", req->rank,
                                                      " exceeds this server's max_lora_rank of ", max_lora_rank_));
  }
  absl::StatusOr<std::vector<LinearKind>> targets = ParseTargets(req->targets);
  if (!targets.ok()) return targets.status();
  AdapterConfig config{req->adapter_id, req->rank, req->alpha, req->dropout, req->use_rslora,
                       *targets, req->seed, req->optimizer};
  absl::StatusOr<std::unique_ptr<Adapter>> adapter = Adapter::Create(config, *model_, device_);
  if (!adapter.ok()) return adapter.status();
  ipc::CreateAdapterReply reply;
  for (const auto& [name, t] : (*adapter)->named_parameters()) reply.num_parameters += t.numel();
  reply.scale = (*adapter)->scale();
  adapters_[req->adapter_id] = *std::move(adapter);
  return Reply(reply);
}

absl::StatusOr<MethodReply> Trainer::RemoveAdapter(const ipc::Message& request) {
  absl::StatusOr<ipc::AdapterRequest> req =
      ipc::Unpack<ipc::AdapterRequest>(request.envelope.body, ipc::kMethodRemoveAdapter);
  if (!req.ok()) return req.status();
  auto it = adapters_.find(req->adapter_id);
  if (it == adapters_.end()) {
    return absl::NotFoundError(absl::StrCat("no adapter '", req->adapter_id, "'"));
  }
  // Its running sample_step requests are dropped (reported as "adapter removed").
  sampler_->AdapterRemoved(it->second.get());
  adapters_.erase(it);
  return MethodReply{};
}

absl::StatusOr<MethodReply> Trainer::OptimStep(const ipc::Message& request) {
  absl::StatusOr<AdapterCall<ipc::OptimStepRequest>> call =
      ParseAdapterCall<ipc::OptimStepRequest>(request, ipc::kMethodOptimStep);
  if (!call.ok()) return call.status();
  const ipc::OptimStepRequest& req = call->request;
  Adapter* adapter = call->adapter;
  OptimizerHyper hyper;
  if (absl::Status s = ApplyHyper(req.hyper, hyper); !s.ok()) return s;
  ScaleGrads(*adapter, req.grad_scale);
  absl::StatusOr<StepResult> step = adapter->optimizer().Step(hyper);
  if (!step.ok()) return step.status();
  if (req.zero_grad) adapter->optimizer().ZeroGrad();  // Tinker: apply and clear
  // Reset even when the gradients stay (Twinkle's step()): dropout seeds are keyed by the
  // step, which just advanced, so the next backward starts a new window of masks.
  adapter->micro_batches_since_step = 0;
  return Reply(ipc::OptimStepReply{step->grad_norm, step->learning_rate, step->step});
}

absl::StatusOr<MethodReply> Trainer::ZeroGrad(const ipc::Message& request) {
  absl::StatusOr<AdapterCall<ipc::AdapterRequest>> call =
      ParseAdapterCall<ipc::AdapterRequest>(request, ipc::kMethodZeroGrad);
  if (!call.ok()) return call.status();
  call->adapter->optimizer().ZeroGrad();
  call->adapter->micro_batches_since_step = 0;
  return MethodReply{};
}

absl::StatusOr<MethodReply> Trainer::SetOptimizer(const ipc::Message& request) {
  absl::StatusOr<AdapterCall<ipc::SetOptimizerRequest>> call =
      ParseAdapterCall<ipc::SetOptimizerRequest>(request, ipc::kMethodSetOptimizer);
  if (!call.ok()) return call.status();
  // Gradients stay: Twinkle may set the optimizer after a backward and step right away.
  if (absl::Status s = call->adapter->ResetOptimizer(call->request.optimizer); !s.ok()) return s;
  return MethodReply{};
}

absl::StatusOr<MethodReply> Trainer::ClipGradNorm(const ipc::Message& request) {
  absl::StatusOr<AdapterCall<ipc::ClipGradNormRequest>> call =
      ParseAdapterCall<ipc::ClipGradNormRequest>(request, ipc::kMethodClipGradNorm);
  if (!call.ok()) return call.status();
  const ipc::ClipGradNormRequest& req = call->request;
  absl::StatusOr<GradNormType> type = ParseGradNormType(req.norm_type);
  if (!type.ok()) return type.status();
  ScaleGrads(*call->adapter, req.grad_scale);
  absl::StatusOr<double> norm = call->adapter->optimizer().ClipGradNorm(req.max_norm, *type);
  if (!norm.ok()) return norm.status();
  return Reply(ipc::ClipGradNormReply{*norm});
}

absl::StatusOr<MethodReply> Trainer::GetAdapterState(const ipc::Message& request) {
  absl::StatusOr<AdapterCall<ipc::AdapterRequest>> call =
      ParseAdapterCall<ipc::AdapterRequest>(request, ipc::kMethodGetAdapterState);
  if (!call.ok()) return call.status();
  Adapter* adapter = call->adapter;
  MethodReply reply;
  ipc::AdapterStateReply body;
  for (const auto& [name, t] : adapter->named_parameters()) {
    absl::StatusOr<ipc::TensorDesc> w = AppendTensor(t, reply);
    if (!w.ok()) return w.status();
    body.weights[name] = *w;
    if (t.grad().defined()) {
      absl::StatusOr<ipc::TensorDesc> g = AppendTensor(t.grad(), reply);
      if (!g.ok()) return g.status();
      body.grads[name] = *g;
    }
  }
  for (const auto& [name, t] : adapter->optimizer().StateTensors()) {
    absl::StatusOr<ipc::TensorDesc> s = AppendTensor(t, reply);
    if (!s.ok()) return s.status();
    body.optimizer[name] = *s;
  }
  body.step = adapter->optimizer().step();
  body.optimizer_kind = adapter->optimizer().kind_name();
  body.micro_batches_since_step = adapter->micro_batches_since_step;
  const AdapterConfig& config = adapter->config();
  body.config.adapter_id = config.id;
  body.config.rank = config.rank;
  body.config.alpha = config.alpha;
  body.config.dropout = config.dropout;
  body.config.use_rslora = config.use_rslora;
  body.config.targets.clear();
  for (LinearKind kind : config.targets) body.config.targets.push_back(LinearKindName(kind));
  body.config.seed = config.seed;
  body.config.optimizer = config.optimizer;
  Adapter::PeftTargets peft = adapter->peft_targets();
  body.peft = ipc::PeftTargets{std::move(peft.target_modules), std::move(peft.target_parameters),
                               std::move(peft.rank_pattern), std::move(peft.alpha_pattern)};
  return Reply(body, std::move(reply));
}

absl::StatusOr<MethodReply> Trainer::SetAdapterState(const ipc::Message& request) {
  absl::StatusOr<AdapterCall<ipc::SetAdapterStateRequest>> call =
      ParseAdapterCall<ipc::SetAdapterStateRequest>(request, ipc::kMethodSetAdapterState);
  if (!call.ok()) return call.status();
  const ipc::SetAdapterStateRequest& req = call->request;
  // Read every frame first; Adapter::Restore then validates and stages before it changes
  // anything, so a bad request leaves the adapter as it was.
  AdapterStateUpdate update;
  for (const auto& [name, desc] : req.weights) {
    absl::StatusOr<at::Tensor> t = ReadTensor(desc, request);
    if (!t.ok()) return absl::InvalidArgumentError(absl::StrCat("weight '", name, "': ", t.status().message()));
    update.weights[name] = *std::move(t);
  }
  if (req.grads.has_value()) {
    update.grads.emplace();
    for (const auto& [name, desc] : *req.grads) {
      absl::StatusOr<at::Tensor> t = ReadTensor(desc, request);
      if (!t.ok()) return absl::InvalidArgumentError(absl::StrCat("gradient '", name, "': ", t.status().message()));
      (*update.grads)[name] = *std::move(t);
    }
  }
  for (const auto& [name, desc] : req.optimizer) {
    absl::StatusOr<at::Tensor> t = ReadTensor(desc, request);
    if (!t.ok()) return absl::InvalidArgumentError(absl::StrCat("optimizer state '", name, "': ", t.status().message()));
    update.optimizer_state.emplace_back(name, *std::move(t));
  }
  update.optimizer_kind = req.optimizer_kind;
  update.reset_optimizer = req.reset_optimizer;
  update.micro_batches_since_step = req.micro_batches_since_step;
  if (absl::Status s = call->adapter->Restore(update); !s.ok()) return s;
  return MethodReply{};
}

}  // namespace twinkle::engine
