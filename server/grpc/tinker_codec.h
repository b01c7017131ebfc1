#pragma once
// TinkerService's codec: the tinker.v1 request messages straight into TinkerApi's typed
// requests (server/tinker/tinker_requests.h) and its typed results into the response
// messages. No JSON on the way. proto3 cannot tell an unset string from an empty one, so a
// required string that is empty is "<field>: missing", as the HTTP API says of an absent one.

#include "absl/status/statusor.h"
#include "server/tinker/tinker_requests.h"
#include "tinker/v1/tinker_service.pb.h"

namespace twinkle::tinker {

namespace v1 = ::tinker::v1;  // the generated wire messages

absl::StatusOr<CreateSessionRequest> Decode(const v1::CreateSessionRequest& m);
absl::StatusOr<SessionHeartbeatRequest> Decode(const v1::SessionHeartbeatRequest& m);
absl::StatusOr<CreateModelRequest> Decode(const v1::CreateModelRequest& m);
absl::StatusOr<ModelRequest> Decode(const v1::ModelRequest& m);
absl::StatusOr<OptimStepRequest> Decode(const v1::OptimStepRequest& m);
absl::StatusOr<SaveWeightsRequest> Decode(const v1::SaveWeightsRequest& m);
absl::StatusOr<LoadWeightsRequest> Decode(const v1::LoadWeightsRequest& m);
absl::StatusOr<SaveWeightsForSamplerRequest> Decode(const v1::SaveWeightsForSamplerRequest& m);
absl::StatusOr<WeightsInfoRequest> Decode(const v1::WeightsInfoRequest& m);
absl::StatusOr<CreateSamplingSessionRequest> Decode(const v1::CreateSamplingSessionRequest& m);
absl::StatusOr<SampleRequest> Decode(const v1::SampleRequest& m);
absl::StatusOr<RetrieveFutureRequest> Decode(const v1::RetrieveFutureRequest& m);
absl::StatusOr<ListTrainingRunsRequest> Decode(const v1::ListTrainingRunsRequest& m);
absl::StatusOr<ListCheckpointsRequest> Decode(const v1::ListCheckpointsRequest& m);
absl::StatusOr<DeleteCheckpointRequest> Decode(const v1::DeleteCheckpointRequest& m);

void Encode(const FuturePromise& r, v1::FuturePromise* m);
void Encode(const CreateSessionResult& r, v1::CreateSessionResponse* m);
void Encode(const SessionHeartbeatResult& r, v1::SessionHeartbeatResponse* m);
void Encode(const ServerCapabilities& r, v1::GetServerCapabilitiesResponse* m);
void Encode(const GetInfoResult& r, v1::GetInfoResponse* m);
void Encode(const WeightsInfoResult& r, v1::WeightsInfoResponse* m);
void Encode(const CreateSamplingSessionResult& r, v1::CreateSamplingSessionResponse* m);
void Encode(const TrainingRunsResult& r, v1::ListTrainingRunsResponse* m);
void Encode(const CheckpointsResult& r, v1::ListCheckpointsResponse* m);
void Encode(const DeleteCheckpointResult& r, v1::DeleteCheckpointResponse* m);

}  // namespace twinkle::tinker
