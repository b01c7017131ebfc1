#pragma once
// The HTTP API's codec: the Tinker SDK's JSON bodies into the typed requests
// (tinker_requests.h) and the typed results into the JSON the SDK reads (tinker_decode.cc,
// tinker_encode.cc). Decoders check the wire form only: a field of the wrong type, or a
// required one missing, is InvalidArgument naming the field as the SDK spells it; the
// values are TinkerApi's to check. Encoders write every key the SDK reads, null where a
// value is absent.

#include <string>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "server/tinker/tinker_requests.h"

namespace twinkle::tinker {

using Json = nlohmann::json;

// ---- decoding ------------------------------------------------------------------------------

absl::StatusOr<CreateSessionRequest> DecodeCreateSession(const Json& body);
absl::StatusOr<SessionHeartbeatRequest> DecodeSessionHeartbeat(const Json& body);
absl::StatusOr<CreateModelRequest> DecodeCreateModel(const Json& body);
absl::StatusOr<ModelRequest> DecodeModelRequest(const Json& body);
absl::StatusOr<OptimStepRequest> DecodeOptimStep(const Json& body);
absl::StatusOr<SaveWeightsRequest> DecodeSaveWeights(const Json& body);
absl::StatusOr<LoadWeightsRequest> DecodeLoadWeights(const Json& body);
absl::StatusOr<SaveWeightsForSamplerRequest> DecodeSaveWeightsForSampler(const Json& body);
absl::StatusOr<WeightsInfoRequest> DecodeWeightsInfo(const Json& body);
absl::StatusOr<CreateSamplingSessionRequest> DecodeCreateSamplingSession(const Json& body);
absl::StatusOr<SampleRequest> DecodeSample(const Json& body);
absl::StatusOr<RetrieveFutureRequest> DecodeRetrieveFuture(const Json& body);

// ---- encoding ------------------------------------------------------------------------------

Json ToJson(const FuturePromise& promise);
Json ToJson(const CreateSessionResult& result);
Json ToJson(const SessionHeartbeatResult& result);
Json ToJson(const ServerCapabilities& result);
Json ToJson(const GetInfoResult& result);
Json ToJson(const WeightsInfoResult& result);
Json ToJson(const OpResult& result);
Json ToJson(const CreateSamplingSessionResult& result);
Json ToJson(const CheckpointInfo& checkpoint);
Json ToJson(const TrainingRunInfo& run);
Json ToJson(const TrainingRunsResult& result);
Json ToJson(const CheckpointsResult& result);
Json ToJson(const DeleteCheckpointResult& result);

}  // namespace twinkle::tinker
