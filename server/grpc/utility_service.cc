#include "server/grpc/utility_service.h"

#include <filesystem>

#include "absl/status/status.h"
#include "server/grpc/handler.h"
#include "twinkle_version.h"

namespace twinkle {

grpc::ServerUnaryReactor* UtilityServiceImpl::GetServerInfo(
    grpc::CallbackServerContext* context, const twinkle::v1::GetServerInfoRequest*,
    twinkle::v1::ServerInfo* response) {
  return HandleNow(context, state_, "UtilityService/GetServerInfo", [&](const tenancy::Tenant&) -> absl::Status {
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
  return HandleNow(context, state_, "UtilityService/GetCapacity", [&](const tenancy::Tenant&) -> absl::Status {
    // Server-wide: how many adapters exist, of how many the server holds at most.
    const int32_t max = state_.config.limits.max_adapters;
    const int32_t used = state_.coordinator->adapter_count();
    response->set_max_adapters(max);
    response->set_used_adapters(used);
    response->set_free_adapters(std::max(0, max - used));
    return absl::OkStatus();
  });
}

}  // namespace twinkle
