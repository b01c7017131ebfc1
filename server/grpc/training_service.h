#pragma once
// twinkle.v1.TrainingService and twinkle.v1.TestingService: thin handlers that map protobuf
// onto core/training's TrainingCoordinator (see handler.h for what every call does).

#include "server/serving_state.h"
#include "twinkle/v1/training.grpc.pb.h"

namespace twinkle {

class TrainingServiceImpl final : public twinkle::v1::TrainingService::CallbackService {
 public:
  explicit TrainingServiceImpl(ServingState& state) : state_(state) {}

#define TWINKLE_RPC(Name, Request, Response)                                              \
  grpc::ServerUnaryReactor* Name(grpc::CallbackServerContext* context,                   \
                                 const twinkle::v1::Request* request,                    \
                                 twinkle::v1::Response* response) override;
  TWINKLE_RPC(CreateSession, CreateSessionRequest, CreateSessionResponse)
  TWINKLE_RPC(SessionHeartbeat, SessionHeartbeatRequest, SessionHeartbeatResponse)
  TWINKLE_RPC(AddAdapter, AddAdapterRequest, AddAdapterResponse)
  TWINKLE_RPC(RemoveAdapter, AdapterRequest, Empty)
  TWINKLE_RPC(SetLoss, SetLossRequest, Empty)
  TWINKLE_RPC(SetOptimizer, SetOptimizerRequest, Empty)
  TWINKLE_RPC(SetLrScheduler, SetLrSchedulerRequest, Empty)
  TWINKLE_RPC(Forward, ForwardRequest, ForwardResponse)
  TWINKLE_RPC(ForwardOnly, ForwardRequest, ForwardResponse)
  TWINKLE_RPC(ForwardBackward, ForwardRequest, ForwardResponse)
  TWINKLE_RPC(CalculateLoss, AdapterRequest, ScalarResponse)
  TWINKLE_RPC(Backward, AdapterRequest, Empty)
  TWINKLE_RPC(ClipGradNorm, ClipGradNormRequest, ScalarResponse)
  TWINKLE_RPC(Step, AdapterRequest, ScalarResponse)
  TWINKLE_RPC(ZeroGrad, AdapterRequest, ScalarResponse)
  TWINKLE_RPC(LrStep, AdapterRequest, ScalarResponse)
  TWINKLE_RPC(ClipGradAndStep, ClipGradNormRequest, ScalarResponse)
  TWINKLE_RPC(CalculateMetric, CalculateMetricRequest, MetricResponse)
  TWINKLE_RPC(GetTrainConfigs, AdapterRequest, TextResponse)
  TWINKLE_RPC(GetStateDict, AdapterRequest, StateDictResponse)
  TWINKLE_RPC(Save, SaveRequest, SaveResponse)
  TWINKLE_RPC(Load, LoadRequest, Empty)
  TWINKLE_RPC(ResumeFromCheckpoint, LoadRequest, ResumeResponse)
  TWINKLE_RPC(WaitFuture, WaitFutureRequest, FutureResponse)
  TWINKLE_RPC(CancelFuture, CancelFutureRequest, Empty)

 private:
  grpc::ServerUnaryReactor* RunForward(grpc::CallbackServerContext* context, const char* method,
                                       const twinkle::v1::ForwardRequest* request,
                                       twinkle::v1::ForwardResponse* response, int mode);
  grpc::ServerUnaryReactor* RunControl(grpc::CallbackServerContext* context, const char* method,
                                       const std::string& adapter, const twinkle::v1::RequestOptions& options,
                                       int control, double max_norm, double norm_type,
                                       twinkle::v1::ScalarResponse* response);
  ServingState& state_;
};

// Exists only when the config sets testing.hooks.
class TestingServiceImpl final : public twinkle::v1::TestingService::CallbackService {
 public:
  explicit TestingServiceImpl(ServingState& state) : state_(state) {}
  TWINKLE_RPC(PauseScheduler, Empty, Empty)
  TWINKLE_RPC(ResumeScheduler, Empty, Empty)
  TWINKLE_RPC(StepScheduler, StepSchedulerRequest, Empty)
  TWINKLE_RPC(InjectFault, InjectFaultRequest, Empty)
#undef TWINKLE_RPC

 private:
  ServingState& state_;
};

}  // namespace twinkle
