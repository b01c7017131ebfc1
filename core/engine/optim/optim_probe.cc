#include "core/engine/optim/optim_probe.h"

#include <ATen/ATen.h>

#include <exception>
#include <map>
#include <msgpack.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/training/lr_scheduler.h"
#include "core/engine/optim/optimizer.h"
#include "core/engine/tensor_io.h"
#include "core/ipc/messages.h"

namespace twinkle::engine {

using training::LrScheduler;
namespace {

struct HyperBody {
  double learning_rate = 1e-4, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  double momentum = 0.0;
  bool nesterov = false;
  double dampening = 0.0;
  double grad_clip_norm = 0.0;
  MSGPACK_DEFINE_MAP(learning_rate, beta1, beta2, eps, weight_decay, momentum, nesterov, dampening,
                     grad_clip_norm);
};

struct SchedulerBody {
  std::string name;
  std::map<std::string, double> config;
  MSGPACK_DEFINE_MAP(name, config);
};

struct ProbeRequest {
  std::string optimizer;
  std::vector<ipc::TensorDesc> params;
  std::vector<std::optional<std::vector<std::optional<ipc::TensorDesc>>>> grads;
  std::vector<HyperBody> hyper;
  std::optional<SchedulerBody> scheduler;
  double base_lr = 0;
  MSGPACK_DEFINE_MAP(optimizer, params, grads, hyper, scheduler, base_lr);
};

struct ProbeStepResult {
  double grad_norm = 0;
  double learning_rate = 0;
  int64_t step = 0;
  MSGPACK_DEFINE_MAP(grad_norm, learning_rate, step);
};

struct ProbeReply {
  std::vector<ipc::TensorDesc> params;
  std::map<std::string, ipc::TensorDesc> state;
  std::vector<ProbeStepResult> results;
  MSGPACK_DEFINE_MAP(params, state, results);
};

OptimizerHyper ToHyper(const HyperBody& b) {
  OptimizerHyper h;
  h.learning_rate = b.learning_rate;
  h.beta1 = b.beta1;
  h.beta2 = b.beta2;
  h.eps = b.eps;
  h.weight_decay = b.weight_decay;
  h.momentum = b.momentum;
  h.nesterov = b.nesterov;
  h.dampening = b.dampening;
  h.grad_clip_norm = b.grad_clip_norm;
  return h;
}

absl::StatusOr<ipc::Message> Run(const ipc::Message& request) {
  absl::StatusOr<ProbeRequest> req =
      ipc::Unpack<ProbeRequest>(request.envelope.body, "optim_probe");
  if (!req.ok()) return req.status();
  if (req->grads.size() != req->hyper.size()) {
    return absl::InvalidArgumentError(absl::StrCat("optim_probe: ", req->grads.size(),
                                                   " gradient steps but ", req->hyper.size(),
                                                   " hyper entries"));
  }
  std::vector<at::Tensor> params;
  for (const ipc::TensorDesc& desc : req->params) {
    absl::StatusOr<at::Tensor> t = ReadTensor(desc, request);
    if (!t.ok()) return t.status();
    // Leaf tensors that require grad, as an adapter's parameters are: the optimizer must
    // update them under no-grad like torch.optim does.
    params.push_back(t->requires_grad_(true));
  }
  std::unique_ptr<LrScheduler> scheduler;
  if (req->scheduler.has_value()) {
    absl::StatusOr<std::unique_ptr<LrScheduler>> s =
        LrScheduler::Create({req->scheduler->name, req->scheduler->config});
    if (!s.ok()) return s.status();
    scheduler = *std::move(s);
  }
  absl::StatusOr<std::unique_ptr<Optimizer>> opt = Optimizer::Create(req->optimizer, params);
  if (!opt.ok()) return opt.status();

  ProbeReply reply;
  for (size_t step = 0; step < req->grads.size(); ++step) {
    const auto& grads = req->grads[step];
    if (grads.has_value() && !grads->empty() && grads->size() != params.size()) {
      return absl::InvalidArgumentError(absl::StrCat("optim_probe: step ", step, " has ",
                                                     grads->size(), " gradients for ",
                                                     params.size(), " params"));
    }
    for (size_t i = 0; grads.has_value() && i < grads->size(); ++i) {
      if (!(*grads)[i].has_value()) continue;
      absl::StatusOr<at::Tensor> g = ReadTensor(*(*grads)[i], request);
      if (!g.ok()) return g.status();
      params[i].mutable_grad() = *std::move(g);
    }
    OptimizerHyper hyper = ToHyper(req->hyper[step]);
    if (scheduler) hyper.learning_rate = scheduler->LearningRate(req->base_lr, (*opt)->step());
    absl::StatusOr<StepResult> result = (*opt)->Step(hyper);
    if (!result.ok()) {
      return absl::Status(result.status().code(),
                          absl::StrCat("optim_probe step ", step, ": ", result.status().message()));
    }
    reply.results.push_back({result->grad_norm, result->learning_rate, result->step});
    (*opt)->ZeroGrad();
  }

  ipc::Message out;
  for (const at::Tensor& p : params) {
    absl::StatusOr<ipc::TensorDesc> desc = AppendTensor(p, out);
    if (!desc.ok()) return desc.status();
    reply.params.push_back(*desc);
  }
  for (const auto& [name, tensor] : (*opt)->StateTensors()) {
    absl::StatusOr<ipc::TensorDesc> desc = AppendTensor(tensor, out);
    if (!desc.ok()) return desc.status();
    reply.state[name] = *desc;
  }
  out.envelope.body = ipc::Pack(reply);
  return out;
}

}  // namespace

absl::StatusOr<ipc::Message> RunOptimProbe(const ipc::Message& request) {
  try {
    return Run(request);
  } catch (const std::exception& e) {  // c10::Error derives from std::exception
    return absl::InternalError(absl::StrCat("optim_probe: ", e.what()));
  }
}

}  // namespace twinkle::engine
