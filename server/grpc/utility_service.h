#pragma once
// twinkle.v1.UtilityService: server facts and capacity. Thin handler over ServingState.

#include "server/serving_state.h"
#include "twinkle/v1/utility.grpc.pb.h"

namespace twinkle {

class UtilityServiceImpl final : public twinkle::v1::UtilityService::CallbackService {
 public:
  explicit UtilityServiceImpl(ServingState& state) : state_(state) {}

  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const twinkle::v1::GetServerInfoRequest* request,
                                          twinkle::v1::ServerInfo* response) override;
  grpc::ServerUnaryReactor* GetCapacity(grpc::CallbackServerContext* context,
                                        const twinkle::v1::GetCapacityRequest* request,
                                        twinkle::v1::Capacity* response) override;

 private:
  ServingState& state_;
};

}  // namespace twinkle
