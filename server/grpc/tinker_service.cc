#include "server/grpc/tinker_service.h"

#include <memory>
#include <string>

#include "server/grpc/handler.h"
#include "server/grpc/tinker_codec.h"
#include "server/metrics.h"
#include "server/tinker/stored_result.h"

namespace twinkle {
namespace {

namespace v1 = ::tinker::v1;

// One call: `request` decoded, `call(decoded)` run, its result encoded into `response`.
template <typename Request, typename Response, typename Call>
absl::Status Serve(const Request& request, Response* response, Call call) {
  auto decoded = tinker::Decode(request);
  if (!decoded.ok()) return decoded.status();
  auto result = call(*decoded);
  if (!result.ok()) return result.status();
  tinker::Encode(*result, response);
  return absl::OkStatus();
}

// A finished future's answer: the RetrieveFutureResponse stored when its op completed.
absl::Status FillDone(const tinker::Poll& poll, v1::RetrieveFutureResponse* response) {
  if (!poll.error.ok()) {
    response->mutable_error()->set_error(std::string(poll.error.message()));
    response->mutable_error()->set_category(tinker::ErrorCategory(poll.error));
    return absl::OkStatus();
  }
  if (!tinker::IsStoredResponse(poll.result.proto)) {
    // Stored before results had a gRPC form of their own (an earlier server version).
    return absl::UnimplementedError("request_id: this result was stored by an earlier server version; "
                                    "retrieve it over the HTTP API");
  }
  if (!response->ParseFromString(poll.result.proto)) return absl::InternalError("decoding the stored answer");
  return absl::OkStatus();
}

}  // namespace

#define TWINKLE_TINKER_DEF(Name, Request, Response)                                                \
  grpc::ServerUnaryReactor* TinkerServiceImpl::Name(grpc::CallbackServerContext* context,          \
                                                    const v1::Request* request, v1::Response* response)

// A call served by TinkerApi::Method with the decoded request.
#define TWINKLE_TINKER_SERVE(Name, Method)                                                          \
  return HandleNow(context, state_, "TinkerService/" #Name, [&](const tenancy::Tenant& t) {       \
    return Serve(*request, response, [&](const auto& r) { return api_.Method(t, r); });            \
  })

TWINKLE_TINKER_DEF(GetServerCapabilities, GetServerCapabilitiesRequest, GetServerCapabilitiesResponse) {
  return HandleNow(context, state_, "TinkerService/GetServerCapabilities", [&](const tenancy::Tenant&) {
    tinker::Encode(api_.GetServerCapabilities(), response);
    return absl::OkStatus();
  });
}
TWINKLE_TINKER_DEF(CreateSession, CreateSessionRequest, CreateSessionResponse) {
  TWINKLE_TINKER_SERVE(CreateSession, CreateSession);
}
TWINKLE_TINKER_DEF(SessionHeartbeat, SessionHeartbeatRequest, SessionHeartbeatResponse) {
  TWINKLE_TINKER_SERVE(SessionHeartbeat, SessionHeartbeat);
}
TWINKLE_TINKER_DEF(CreateModel, CreateModelRequest, FuturePromise) { TWINKLE_TINKER_SERVE(CreateModel, CreateModel); }
TWINKLE_TINKER_DEF(UnloadModel, ModelRequest, FuturePromise) { TWINKLE_TINKER_SERVE(UnloadModel, UnloadModel); }
TWINKLE_TINKER_DEF(ForwardBackward, ForwardBackwardRequest, FuturePromise) {
  // The request message is TinkerApi's own typed request here.
  return HandleNow(context, state_, "TinkerService/ForwardBackward", [&](const tenancy::Tenant& t) {
    absl::StatusOr<tinker::FuturePromise> promise = api_.ForwardBackward(t, *request);
    if (!promise.ok()) return promise.status();
    tinker::Encode(*promise, response);
    return absl::OkStatus();
  });
}
TWINKLE_TINKER_DEF(OptimStep, OptimStepRequest, FuturePromise) { TWINKLE_TINKER_SERVE(OptimStep, OptimStep); }
TWINKLE_TINKER_DEF(SaveWeights, SaveWeightsRequest, FuturePromise) { TWINKLE_TINKER_SERVE(SaveWeights, SaveWeights); }
TWINKLE_TINKER_DEF(LoadWeights, LoadWeightsRequest, FuturePromise) { TWINKLE_TINKER_SERVE(LoadWeights, LoadWeights); }
TWINKLE_TINKER_DEF(SaveWeightsForSampler, SaveWeightsForSamplerRequest, FuturePromise) {
  TWINKLE_TINKER_SERVE(SaveWeightsForSampler, SaveWeightsForSampler);
}
TWINKLE_TINKER_DEF(GetInfo, ModelRequest, GetInfoResponse) { TWINKLE_TINKER_SERVE(GetInfo, GetInfo); }
TWINKLE_TINKER_DEF(WeightsInfo, WeightsInfoRequest, WeightsInfoResponse) {
  TWINKLE_TINKER_SERVE(WeightsInfo, WeightsInfo);
}
TWINKLE_TINKER_DEF(CreateSamplingSession, CreateSamplingSessionRequest, CreateSamplingSessionResponse) {
  TWINKLE_TINKER_SERVE(CreateSamplingSession, CreateSamplingSession);
}
TWINKLE_TINKER_DEF(ListTrainingRuns, ListTrainingRunsRequest, ListTrainingRunsResponse) {
  TWINKLE_TINKER_SERVE(ListTrainingRuns, ListTrainingRuns);
}
TWINKLE_TINKER_DEF(ListCheckpoints, ListCheckpointsRequest, ListCheckpointsResponse) {
  TWINKLE_TINKER_SERVE(ListCheckpoints, ListCheckpoints);
}
TWINKLE_TINKER_DEF(DeleteCheckpoint, DeleteCheckpointRequest, DeleteCheckpointResponse) {
  TWINKLE_TINKER_SERVE(DeleteCheckpoint, DeleteCheckpoint);
}
TWINKLE_TINKER_DEF(Sample, SampleRequest, FuturePromise) { TWINKLE_TINKER_SERVE(Sample, Sample); }

TWINKLE_TINKER_DEF(RetrieveFuture, RetrieveFutureRequest, RetrieveFutureResponse) {
  // Long-polls without a thread: the future's completion (or the timer) finishes the call.
  auto timer = std::make_shared<RequestTimer>(state_.metrics, "TinkerService/RetrieveFuture");
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto finish = [context, reactor, timer](const absl::Status& status) {
    timer->set_code(absl::StatusCodeToString(status.code()));
    FinishCall(context, reactor, status);
  };
  if (state_.draining.load()) {
    finish(absl::UnavailableError("server is shutting down"));
    return reactor;
  }
  absl::StatusOr<const tenancy::Tenant*> tenant = state_.authenticator->AuthenticateGrpc(*context);
  if (!tenant.ok()) {
    finish(tenant.status());
    return reactor;
  }
  absl::StatusOr<tinker::RetrieveFutureRequest> decoded = tinker::Decode(*request);
  if (!decoded.ok()) {
    finish(decoded.status());
    return reactor;
  }
  api_.RetrieveFuture(**tenant, *decoded, [response, finish](absl::StatusOr<tinker::Poll> poll) {
    if (!poll.ok()) return finish(poll.status());
    if (!poll->done) {
      response->mutable_try_again()->set_request_id(poll->request_id);
      response->mutable_try_again()->set_queue_state(poll->queue_state);
      return finish(absl::OkStatus());
    }
    finish(FillDone(*poll, response));
  });
  return reactor;
}

#undef TWINKLE_TINKER_SERVE
#undef TWINKLE_TINKER_DEF

}  // namespace twinkle
