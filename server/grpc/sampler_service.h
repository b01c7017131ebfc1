#pragma once
// twinkle.v1.SamplerService: thin handlers over core/sampling's SamplerCoordinator (see
// handler.h for what every call does around its own work).

#include "server/serving_state.h"
#include "twinkle/v1/sampler.grpc.pb.h"

namespace twinkle {

class SamplerServiceImpl final : public twinkle::v1::SamplerService::CallbackService {
 public:
  explicit SamplerServiceImpl(ServingState& state) : state_(state) {}

#define TWINKLE_RPC(Name, Request, Response)                                   \
  grpc::ServerUnaryReactor* Name(grpc::CallbackServerContext* context,        \
                                 const twinkle::v1::Request* request,         \
                                 twinkle::v1::Response* response) override;
  TWINKLE_RPC(CreateSamplingSession, CreateSamplingSessionRequest, SamplingSession)
  TWINKLE_RPC(SnapshotAdapter, SnapshotAdapterRequest, SamplingSession)
  TWINKLE_RPC(GetSamplingSession, SamplingSessionRequest, SamplingSession)
  TWINKLE_RPC(CloseSamplingSession, SamplingSessionRequest, Empty)
  TWINKLE_RPC(Sample, SampleRequest, SampleResponse)
  TWINKLE_RPC(WaitSample, WaitFutureRequest, SampleResponse)
#undef TWINKLE_RPC

 private:
  ServingState& state_;
};

}  // namespace twinkle
