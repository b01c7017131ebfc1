#include "server/grpc/utility_service.h"

#include <filesystem>

#include "absl/status/status.h"
#include "server/status_map.h"
#include "twinkle_version.h"

namespace twinkle {
namespace {

// Runs `fill` unless the server is draining, records the call, and finishes the reactor.
template <typename Fill>
grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* context, ServingState& state,
                                const char* method, Fill fill) {
  RequestTimer timer(state.metrics, method);
  absl::Status status = state.draining.load()
                            ? absl::UnavailableError("server is shutting down")
                            : fill();
  const grpc::Status grpc_status = ToGrpcStatus(status);
  timer.set_code(absl::StatusCodeToString(status.code()));
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc_status);
  return reactor;
}

}  // namespace

grpc::ServerUnaryReactor* UtilityServiceImpl::GetServerInfo(
    grpc::CallbackServerContext* context, const twinkle::v1::GetServerInfoRequest*,
    twinkle::v1::ServerInfo* response) {
  return Unary(context, state_, "UtilityService/GetServerInfo", [&]() -> absl::Status {
    const Config& config = state_.config;
    response->set_server_version(kTwinkleVersion);
    response->set_base_model_id(config.model.name);
    response->set_base_model_name(std::filesystem::path(config.model.path).filename().string());
    response->set_dtype(config.model.dtype);
    response->set_max_lora_rank(config.limits.max_lora_rank);
    auto* limits = response->mutable_limits();
    limits->set_max_adapters(config.limits.max_adapters);
    limits->set_max_lora_rank(config.limits.max_lora_rank);
    limits->set_max_tokens_per_request(config.limits.max_tokens_per_request);
    if (std::optional<ModelInfo> info = state_.supervisor.model_info()) {
      response->set_architecture(info->architecture);
      response->set_parameter_count(info->parameter_count);
      for (const std::string& loss : info->supported_losses) response->add_supported_loss_names(loss);
    }
    for (const WorkerSnapshot& w : state_.supervisor.Snapshot()) {
      auto* device = response->add_devices();
      device->set_rank(w.rank);
      device->set_device(w.device);
      device->set_ready(w.ready);
      device->set_restarts(w.restarts);
    }
    response->set_serving(state_.Serving());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* UtilityServiceImpl::GetCapacity(grpc::CallbackServerContext* context,
                                                          const twinkle::v1::GetCapacityRequest*,
                                                          twinkle::v1::Capacity* response) {
  return Unary(context, state_, "UtilityService/GetCapacity", [&]() -> absl::Status {
    // No adapter can be created before the training engine lands, so none is in use.
    const int32_t max = state_.config.limits.max_adapters;
    response->set_max_adapters(max);
    response->set_used_adapters(0);
    response->set_free_adapters(max);
    return absl::OkStatus();
  });
}

}  // namespace twinkle
