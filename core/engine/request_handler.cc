#include "core/engine/request_handler.h"

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/engine/model/loader.h"
#include "core/ipc/messages.h"

namespace twinkle::engine {
namespace {

absl::StatusOr<c10::ScalarType> ParseDtype(const std::string& name) {
  if (name == "float32") return c10::ScalarType::Float;
  if (name == "bfloat16") return c10::ScalarType::BFloat16;
  if (name == "float16") return c10::ScalarType::Half;
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported dtype '", name, "' (expected float32, bfloat16 or float16)"));
}

absl::StatusOr<c10::Device> ParseDevice(const std::string& name) {
  try {
    return c10::Device(name);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("bad device '", name, "': ", e.what()));
  }
}

}  // namespace

RequestHandler::RequestHandler(std::string device) : device_(std::move(device)) {}
RequestHandler::~RequestHandler() = default;

absl::StatusOr<std::string> RequestHandler::Handle(const ipc::Message& request) {
  const std::string& method = request.envelope.method;
  try {
    if (method == ipc::kMethodLoadModel) return LoadModel(request.envelope.body);
  } catch (const std::exception& e) {  // the engine's exception boundary
    return absl::InternalError(absl::StrCat(method, ": ", e.what()));
  }
  return absl::UnimplementedError(absl::StrCat("engine has no method '", method, "'"));
}

absl::StatusOr<std::string> RequestHandler::LoadModel(const std::string& body) {
  absl::StatusOr<ipc::LoadModelRequest> req = ipc::Unpack<ipc::LoadModelRequest>(body, "load_model");
  if (!req.ok()) return req.status();
  absl::StatusOr<c10::ScalarType> dtype = ParseDtype(req->dtype);
  if (!dtype.ok()) return dtype.status();
  absl::StatusOr<c10::Device> device = ParseDevice(req->device.empty() ? device_ : req->device);
  if (!device.ok()) return device.status();

  const absl::Time start = absl::Now();
  absl::StatusOr<engine::LoadedModel> loaded = engine::LoadModel(req->model_dir, *dtype, *device);
  if (!loaded.ok()) return loaded.status();
  model_ = std::make_unique<engine::LoadedModel>(*std::move(loaded));

  ipc::LoadModelReply reply;
  reply.architecture = model_->config.architecture;
  reply.model_type = model_->config.model_type;
  reply.parameter_count = model_->parameter_count;
  reply.dtype = req->dtype;
  reply.device = device->str();
  reply.num_layers = static_cast<int32_t>(model_->config.num_hidden_layers);
  reply.vocab_size = model_->config.vocab_size;
  reply.hidden_size = model_->config.hidden_size;
  // Losses arrive with the training engine; until then this worker trains nothing and says so.
  reply.supported_losses = {};
  reply.load_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return ipc::Pack(reply);
}

}  // namespace twinkle::engine
