#pragma once
// tinker.v1.TinkerService: the Tinker API over gRPC. Each handler decodes its request message
// into TinkerApi's typed request (tinker_codec.h), calls the same TinkerApi method the HTTP
// route calls and encodes the typed result into its response message, so both transports
// share every rule (ids, ordering, idempotency, futures, errors) and no JSON is involved.

#include <grpcpp/grpcpp.h>

#include "server/serving_state.h"
#include "server/tinker/tinker_api.h"
#include "tinker/v1/tinker_service.grpc.pb.h"

namespace twinkle {

class TinkerServiceImpl final : public ::tinker::v1::TinkerService::CallbackService {
 public:
  TinkerServiceImpl(ServingState& state, tinker::TinkerApi& api) : state_(state), api_(api) {}

#define TWINKLE_TINKER_RPC(Name, Request, Response)                                              \
  grpc::ServerUnaryReactor* Name(grpc::CallbackServerContext* context, const ::tinker::v1::Request* request, \
                                 ::tinker::v1::Response* response) override
  TWINKLE_TINKER_RPC(GetServerCapabilities, GetServerCapabilitiesRequest, GetServerCapabilitiesResponse);
  TWINKLE_TINKER_RPC(CreateSession, CreateSessionRequest, CreateSessionResponse);
  TWINKLE_TINKER_RPC(SessionHeartbeat, SessionHeartbeatRequest, SessionHeartbeatResponse);
  TWINKLE_TINKER_RPC(CreateModel, CreateModelRequest, FuturePromise);
  TWINKLE_TINKER_RPC(UnloadModel, ModelRequest, FuturePromise);
  TWINKLE_TINKER_RPC(ForwardBackward, ForwardBackwardRequest, FuturePromise);
  TWINKLE_TINKER_RPC(OptimStep, OptimStepRequest, FuturePromise);
  TWINKLE_TINKER_RPC(SaveWeights, SaveWeightsRequest, FuturePromise);
  TWINKLE_TINKER_RPC(LoadWeights, LoadWeightsRequest, FuturePromise);
  TWINKLE_TINKER_RPC(SaveWeightsForSampler, SaveWeightsForSamplerRequest, FuturePromise);
  TWINKLE_TINKER_RPC(Sample, SampleRequest, FuturePromise);
  TWINKLE_TINKER_RPC(RetrieveFuture, RetrieveFutureRequest, RetrieveFutureResponse);
  TWINKLE_TINKER_RPC(GetInfo, ModelRequest, GetInfoResponse);
  TWINKLE_TINKER_RPC(WeightsInfo, WeightsInfoRequest, WeightsInfoResponse);
  TWINKLE_TINKER_RPC(CreateSamplingSession, CreateSamplingSessionRequest, CreateSamplingSessionResponse);
  TWINKLE_TINKER_RPC(ListTrainingRuns, ListTrainingRunsRequest, ListTrainingRunsResponse);
  TWINKLE_TINKER_RPC(ListCheckpoints, ListCheckpointsRequest, ListCheckpointsResponse);
  TWINKLE_TINKER_RPC(DeleteCheckpoint, DeleteCheckpointRequest, DeleteCheckpointResponse);
#undef TWINKLE_TINKER_RPC

 private:
  ServingState& state_;
  tinker::TinkerApi& api_;
};

}  // namespace twinkle
