#include "core/engine/loss/loss_probe.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <exception>
#include <map>
#include <msgpack.hpp>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/engine/loss/loss.h"
#include "core/engine/tensor_io.h"
#include "core/ipc/messages.h"

namespace twinkle::engine {
namespace {

struct ProbeLoss {
  std::string name;
  // Numbers or strings; msgpack::object stays valid while the request's handle lives.
  std::map<std::string, msgpack::object> config;
  MSGPACK_DEFINE_MAP(name, config);
};
struct ProbeDatum {
  ipc::TensorDesc logprobs;
  std::map<std::string, ipc::TensorDesc> inputs;
  MSGPACK_DEFINE_MAP(logprobs, inputs);
};
struct ProbeContext {
  int64_t window_tokens = 0;
  int64_t window_sequences = 0;
  MSGPACK_DEFINE_MAP(window_tokens, window_sequences);
};
struct ProbeRequest {
  ProbeLoss loss;
  std::vector<ProbeDatum> datums;
  ProbeContext context;
  MSGPACK_DEFINE_MAP(loss, datums, context);
};
struct ProbeReply {
  double total = 0;
  std::vector<ipc::TensorDesc> elementwise;
  std::vector<ipc::TensorDesc> grad_logprobs;
  std::map<std::string, double> metrics;
  MSGPACK_DEFINE_MAP(total, elementwise, grad_logprobs, metrics);
};

absl::StatusOr<LossSpec> ToSpec(const ProbeLoss& loss) {
  LossSpec spec;
  spec.name = loss.name;
  for (const auto& [key, value] : loss.config) {
    switch (value.type) {
      case msgpack::type::POSITIVE_INTEGER:
      case msgpack::type::NEGATIVE_INTEGER:
      case msgpack::type::FLOAT32:
      case msgpack::type::FLOAT64:
        spec.config[key] = value.as<double>();
        break;
      case msgpack::type::BOOLEAN:  // e.g. DPO's reference_free
        spec.config[key] = value.as<bool>() ? 1.0 : 0.0;
        break;
      case msgpack::type::STR:
        spec.string_config[key] = value.as<std::string>();
        break;
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("loss_probe: config '", key, "' must be a number, a boolean or a string"));
    }
  }
  return spec;
}

absl::StatusOr<ipc::Message> Probe(const ipc::Message& request) {
  const std::string& body = request.envelope.body;
  msgpack::object_handle handle;
  ProbeRequest req;
  try {
    handle = msgpack::unpack(body.data(), body.size());
    handle.get().convert(req);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("ipc: malformed loss_probe body: ", e.what()));
  }
  absl::StatusOr<LossSpec> spec = ToSpec(req.loss);
  if (!spec.ok()) return spec.status();

  // The probe needs gradients even if the calling thread runs under a no-grad guard.
  c10::AutoGradMode grad_mode(true);
  std::vector<LossDatum> datums(req.datums.size());
  for (size_t i = 0; i < req.datums.size(); ++i) {
    absl::StatusOr<at::Tensor> lp = ReadTensor(req.datums[i].logprobs, request);
    if (!lp.ok()) return lp.status();
    // A leaf that requires grad, so backward() fills in d total / d logprobs.
    datums[i].logprobs = lp->requires_grad_(true);
    for (const auto& [name, desc] : req.datums[i].inputs) {
      absl::StatusOr<at::Tensor> t = ReadTensor(desc, request);
      if (!t.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("loss_probe: datum ", i, " input '", name, "': ", t.status().message()));
      }
      datums[i].inputs[name] = *std::move(t);
    }
  }
  LossContext context{req.context.window_tokens, req.context.window_sequences};
  absl::StatusOr<LossResult> result = ComputeLoss(*spec, datums, context);
  if (!result.ok()) return result.status();
  result->total.backward();

  ipc::Message out;
  ProbeReply reply;
  reply.total = result->total.item<double>();
  reply.metrics = result->metrics;
  for (size_t i = 0; i < datums.size(); ++i) {
    absl::StatusOr<ipc::TensorDesc> e = AppendTensor(result->elementwise[i], out);
    if (!e.ok()) return e.status();
    reply.elementwise.push_back(*e);
    const at::Tensor& lp = datums[i].logprobs;
    at::Tensor grad = lp.grad().defined() ? lp.grad() : at::zeros_like(lp);
    absl::StatusOr<ipc::TensorDesc> g = AppendTensor(grad, out);
    if (!g.ok()) return g.status();
    reply.grad_logprobs.push_back(*g);
  }
  out.envelope.body = ipc::Pack(reply);
  return out;
}

}  // namespace

absl::StatusOr<ipc::Message> RunLossProbe(const ipc::Message& request) {
  try {
    return Probe(request);
  } catch (const std::exception& e) {  // c10::Error included
    return absl::InternalError(absl::StrCat("loss_probe: ", e.what()));
  }
}

}  // namespace twinkle::engine
