#include "server/grpc/tinker_service.h"

#include <google/protobuf/util/json_util.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "server/grpc/handler.h"
#include "server/metrics.h"

namespace twinkle {
namespace {

namespace v1 = ::tinker::v1;
using tinker::Json;

// A request as the HTTP API's JSON body (Tinker's field names; unset optional fields absent).
Json BodyOf(const google::protobuf::Message& message) {
  std::string text;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(message, &text, options);
  Json j = Json::parse(text, nullptr, false);
  return j.is_object() ? j : Json::object();
}

// A JSON answer into a response message (fields it does not have are skipped).
absl::Status Fill(const Json& json, google::protobuf::Message* message) {
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;
  Json clean = json;
  // Nulls mean "absent" to us; the protobuf parser would reject some of them.
  std::function<void(Json&)> drop_nulls = [&](Json& j) {
    if (j.is_object()) {
      for (auto it = j.begin(); it != j.end();) {
        if (it->is_null()) {
          it = j.erase(it);
        } else {
          drop_nulls(*it);
          ++it;
        }
      }
    } else if (j.is_array()) {
      for (Json& e : j) drop_nulls(e);
    }
  };
  drop_nulls(clean);
  const auto status = google::protobuf::util::JsonStringToMessage(clean.dump(), message, options);
  if (!status.ok()) return absl::InternalError(absl::StrCat("encoding the answer: ", status.ToString()));
  return absl::OkStatus();
}

}  // namespace

#define TWINKLE_TINKER_DEF(Name, Request, Response)                                                \
  grpc::ServerUnaryReactor* TinkerServiceImpl::Name(grpc::CallbackServerContext* context,          \
                                                    const v1::Request* request, v1::Response* response)

// A call answered from `fn(tenant)`'s JSON.
#define TWINKLE_TINKER_JSON(Name, expr)                                                            \
  return HandleNow(context, state_, "TinkerService/" #Name, [&](const tenancy::Tenant& t) -> absl::Status { \
    absl::StatusOr<Json> r = (expr);                                                               \
    if (!r.ok()) return r.status();                                                                \
    return Fill(*r, response);                                                                     \
  })

TWINKLE_TINKER_DEF(GetServerCapabilities, GetServerCapabilitiesRequest, GetServerCapabilitiesResponse) {
  TWINKLE_TINKER_JSON(GetServerCapabilities, absl::StatusOr<Json>(api_.Capabilities()));
}
TWINKLE_TINKER_DEF(CreateSession, CreateSessionRequest, CreateSessionResponse) {
  TWINKLE_TINKER_JSON(CreateSession, api_.CreateSession(t, BodyOf(*request)));
}
TWINKLE_TINKER_DEF(SessionHeartbeat, SessionHeartbeatRequest, SessionHeartbeatResponse) {
  TWINKLE_TINKER_JSON(SessionHeartbeat, api_.SessionHeartbeat(t, BodyOf(*request)));
}
TWINKLE_TINKER_DEF(CreateModel, CreateModelRequest, FuturePromise) {
  TWINKLE_TINKER_JSON(CreateModel, api_.CreateModel(t, BodyOf(*request)));
}
TWINKLE_TINKER_DEF(UnloadModel, ModelRequest, FuturePromise) {
  TWINKLE_TINKER_JSON(UnloadModel, api_.UnloadModel(t, BodyOf(*request)));
}
TWINKLE_TINKER_DEF(ForwardBackward, ForwardBackwardRequest, FuturePromise) {
  TWINKLE_TINKER_JSON(ForwardBackward, api_.ForwardBackward(t, *request));
}
TWINKLE_TINKER_DEF(OptimStep, OptimStepRequest, FuturePromise) {
  TWINKLE_TINKER_JSON(OptimStep, api_.OptimStep(t, BodyOf(*request)));
}
TWINKLE_TINKER_DEF(SaveWeights, SaveWeightsRequest, FuturePromise) {
  TWINKLE_TINKER_JSON(SaveWeights, api_.SaveWeights(t, BodyOf(*request)));
}
TWINKLE_TINKER_DEF(LoadWeights, LoadWeightsRequest, FuturePromise) {
  TWINKLE_TINKER_JSON(LoadWeights, api_.LoadWeights(t, BodyOf(*request)));
}
TWINKLE_TINKER_DEF(SaveWeightsForSampler, SaveWeightsForSamplerRequest, FuturePromise) {
  TWINKLE_TINKER_JSON(SaveWeightsForSampler, api_.SaveWeightsForSampler(t, BodyOf(*request)));
}
TWINKLE_TINKER_DEF(GetInfo, ModelRequest, GetInfoResponse) {
  TWINKLE_TINKER_JSON(GetInfo, api_.GetInfo(t, BodyOf(*request)));
}
TWINKLE_TINKER_DEF(WeightsInfo, WeightsInfoRequest, WeightsInfoResponse) {
  TWINKLE_TINKER_JSON(WeightsInfo, api_.WeightsInfo(t, BodyOf(*request)));
}
TWINKLE_TINKER_DEF(CreateSamplingSession, CreateSamplingSessionRequest, CreateSamplingSessionResponse) {
  TWINKLE_TINKER_JSON(CreateSamplingSession, api_.CreateSamplingSession(t, BodyOf(*request)));
}
TWINKLE_TINKER_DEF(ListTrainingRuns, ListTrainingRunsRequest, ListTrainingRunsResponse) {
  TWINKLE_TINKER_JSON(ListTrainingRuns,
                      api_.ListTrainingRuns(t, request->limit() > 0 ? request->limit() : 20, request->offset()));
}
TWINKLE_TINKER_DEF(ListCheckpoints, ListCheckpointsRequest, ListCheckpointsResponse) {
  TWINKLE_TINKER_JSON(ListCheckpoints, api_.ListCheckpoints(t, request->training_run_id()));
}
TWINKLE_TINKER_DEF(DeleteCheckpoint, DeleteCheckpointRequest, DeleteCheckpointResponse) {
  TWINKLE_TINKER_JSON(DeleteCheckpoint,
                      api_.DeleteCheckpoint(t, request->training_run_id(), request->checkpoint_id()));
}

TWINKLE_TINKER_DEF(Sample, SampleRequest, FuturePromise) {
  // The HTTP API's asample body.
  Json body = {{"sampling_session_id", request->sampling_session_id()},
               {"seq_id", request->seq_id()},
               {"num_samples", request->num_samples() > 0 ? request->num_samples() : 1},
               {"prompt_logprobs", request->prompt_logprobs()},
               {"topk_prompt_logprobs", request->topk_prompt_logprobs()},
               {"topk_sample_logprobs", request->topk_sample_logprobs()},
               {"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", Json(std::vector<int32_t>(
                                                                           request->prompt().begin(),
                                                                           request->prompt().end()))}}}}}}};
  const v1::SamplingParams& p = request->sampling_params();
  Json params = Json::object();
  if (p.has_max_tokens()) params["max_tokens"] = p.max_tokens();
  if (p.has_seed()) params["seed"] = p.seed();
  if (p.has_temperature()) params["temperature"] = p.temperature();
  if (p.has_top_k()) params["top_k"] = p.top_k();
  if (p.has_top_p()) params["top_p"] = p.top_p();
  if (p.has_stop_strs()) params["stop"] = std::vector<std::string>(p.stop_strs().values().begin(), p.stop_strs().values().end());
  if (p.has_stop_tokens()) params["stop"] = std::vector<int32_t>(p.stop_tokens().values().begin(), p.stop_tokens().values().end());
  body["sampling_params"] = std::move(params);
  TWINKLE_TINKER_JSON(Sample, api_.ASample(t, body));
}

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
  api_.RetrieveFuture(**tenant, BodyOf(*request), [response, finish](absl::StatusOr<tinker::Poll> poll) {
    if (!poll.ok()) return finish(poll.status());
    if (poll->outcome == nullptr) {
      response->mutable_try_again()->set_request_id(poll->request_id);
      response->mutable_try_again()->set_queue_state(poll->queue_state);
      return finish(absl::OkStatus());
    }
    const tinker::Outcome& o = *poll->outcome;
    if (!o.error.ok()) {
      response->mutable_error()->set_error(std::string(o.error.message()));
      response->mutable_error()->set_category(tinker::ErrorCategory(o.error));
      return finish(absl::OkStatus());
    }
    if (!o.proto.empty() && o.json.contains("loss_fn_outputs")) {
      if (!response->mutable_forward_backward()->ParseFromString(o.proto)) {
        return finish(absl::InternalError("encoding the answer"));
      }
      return finish(absl::OkStatus());
    }
    if (!o.proto.empty() && o.json.contains("sequences")) {
      if (!response->mutable_sample()->ParseFromString(o.proto)) return finish(absl::InternalError("encoding the answer"));
      return finish(absl::OkStatus());
    }
    finish(Fill(o.json, response->mutable_op()));
  });
  return reactor;
}

#undef TWINKLE_TINKER_JSON
#undef TWINKLE_TINKER_DEF

}  // namespace twinkle
