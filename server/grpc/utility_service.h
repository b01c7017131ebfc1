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
  grpc::ServerUnaryReactor* ListTrainingRuns(grpc::CallbackServerContext* context,
                                             const twinkle::v1::ListTrainingRunsRequest* request,
                                             twinkle::v1::ListTrainingRunsResponse* response) override;
  grpc::ServerUnaryReactor* GetTrainingRun(grpc::CallbackServerContext* context,
                                           const twinkle::v1::GetTrainingRunRequest* request,
                                           twinkle::v1::TrainingRun* response) override;
  grpc::ServerUnaryReactor* ListCheckpoints(grpc::CallbackServerContext* context,
                                            const twinkle::v1::ListCheckpointsRequest* request,
                                            twinkle::v1::ListCheckpointsResponse* response) override;
  grpc::ServerUnaryReactor* DeleteCheckpoint(grpc::CallbackServerContext* context,
                                             const twinkle::v1::DeleteCheckpointRequest* request,
                                             twinkle::v1::DeleteCheckpointResponse* response) override;
  grpc::ServerUnaryReactor* GetTokenizerFiles(grpc::CallbackServerContext* context,
                                              const twinkle::v1::GetTokenizerFilesRequest* request,
                                              twinkle::v1::GetTokenizerFilesResponse* response) override;
  grpc::ServerUnaryReactor* ExportMergedModel(grpc::CallbackServerContext* context,
                                              const twinkle::v1::ExportMergedModelRequest* request,
                                              twinkle::v1::ExportMergedModelResponse* response) override;

 private:
  ServingState& state_;
};

}  // namespace twinkle
