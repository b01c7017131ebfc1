#include "server/grpc/training_service.h"

#include <cerrno>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "server/grpc/handler.h"
#include "server/grpc/twinkle_requests.h"

namespace twinkle {
namespace {

namespace v1 = twinkle::v1;
using training::Control;
using training::ForwardMode;
using training::OpOutput;

training::ForwardArgs ToForwardArgs(const v1::ForwardRequest& r) {
  training::ForwardArgs args;
  for (const v1::InputFeature& f : r.inputs()) {
    args.inputs.push_back({{f.input_ids().begin(), f.input_ids().end()}, {f.labels().begin(), f.labels().end()}});
  }
  args.advantages.assign(r.advantages().begin(), r.advantages().end());
  for (const v1::FloatList& l : r.old_logps()) args.old_logps.emplace_back(l.values().begin(), l.values().end());
  for (const v1::FloatList& l : r.ref_logps()) args.ref_logps.emplace_back(l.values().begin(), l.values().end());
  return args;
}

void FillModelOutput(const OpOutput& out, v1::ModelOutput* m) {
  for (const training::SequenceResult& s : out.sequences) {
    v1::SequenceOutput* seq = m->add_sequences();
    seq->mutable_logps()->Add(s.logps.begin(), s.logps.end());
    seq->mutable_loss()->Add(s.loss.begin(), s.loss.end());
  }
  m->set_loss(out.loss);
  for (const auto& [k, v] : out.metrics) (*m->mutable_metrics())[k] = v;
}

void FillScalar(const OpOutput& out, v1::ScalarResponse* r) {
  r->set_value(out.value);
  r->set_skipped(out.skipped);
}

std::map<std::string, double> ToMap(const google::protobuf::Map<std::string, double>& m) {
  return {m.begin(), m.end()};
}

}  // namespace

#define TWINKLE_RPC_DEF(Service, Name, Request, Response)                                      \
  grpc::ServerUnaryReactor* Service::Name(grpc::CallbackServerContext* context,               \
                                          const v1::Request* request, v1::Response* response)

TWINKLE_RPC_DEF(TrainingServiceImpl, CreateSession, CreateSessionRequest, CreateSessionResponse) {
  return HandleNow(context, state_, "TrainingService/CreateSession", [&](const tenancy::Tenant& t) {
    absl::StatusOr<std::string> id = state_.models->CreateSession(training::ContextOf(t));
    if (!id.ok()) return id.status();
    response->set_session_id(*id);
    return absl::OkStatus();
  });
}

TWINKLE_RPC_DEF(TrainingServiceImpl, SessionHeartbeat, SessionHeartbeatRequest, SessionHeartbeatResponse) {
  return HandleNow(context, state_, "TrainingService/SessionHeartbeat", [&](const tenancy::Tenant& t) {
    return state_.models->Heartbeat(training::ContextOf(t), request->session_id());
  });
}

TWINKLE_RPC_DEF(TrainingServiceImpl, AddAdapter, AddAdapterRequest, AddAdapterResponse) {
  // Blocks this callback thread while the engine creates the adapter (milliseconds).
  return HandleNow(context, state_, "TrainingService/AddAdapter", [&](const tenancy::Tenant& t) -> absl::Status {
    training::AddAdapterArgs args;
    args.name = request->adapter_name();
    const v1::LoraConfig& c = request->config();
    args.lora.rank = c.r() == 0 ? 8 : c.r();
    args.lora.alpha = c.lora_alpha() == 0 ? training::kDefaultLoraAlpha : c.lora_alpha();
    args.lora.dropout = c.lora_dropout();
    if (c.target_modules_size() > 0) args.lora.targets.assign(c.target_modules().begin(), c.target_modules().end());
    args.lora.use_rslora = c.use_rslora();
    args.lora.seed = c.seed();
    args.gradient_accumulation_steps =
        request->gradient_accumulation_steps() == 0 ? 1 : request->gradient_accumulation_steps();
    args.session_id = request->session_id();
    // On the base model it names (the default one when none); an adapter name is the tenant's
    // across models, so later calls that name only the adapter find their model.
    absl::StatusOr<ModelStack*> stack = state_.models->ForBaseModel(request->base_model());
    if (!stack.ok()) return stack.status();
    if (ModelStack* other = state_.models->OfAdapter(t.id, args.name); other != nullptr && other != *stack) {
      return absl::AlreadyExistsError(
          absl::StrCat("adapter '", args.name, "' already exists (on base model '", other->name(), "')"));
    }
    // The tenant's quota counts its adapters on every model (each coordinator sees only its own).
    if (const int32_t mine = state_.models->AdaptersOf(training::ContextOf(t)); mine >= t.quotas.max_adapters) {
      return absl::FailedPreconditionError(absl::StrCat("you have ", mine, " adapters, your quota (max_adapters) is ",
                                                        t.quotas.max_adapters, "; remove one first"));
    }
    absl::StatusOr<training::AddAdapterResult> r = (*stack)->coordinator().AddAdapter(training::ContextOf(t), args);
    if (!r.ok()) return r.status();
    response->set_adapter_name(r->name);
    response->set_num_parameters(r->num_parameters);
    response->set_run_id(r->run_id);
    return absl::OkStatus();
  });
}

TWINKLE_RPC_DEF(TrainingServiceImpl, RemoveAdapter, AdapterRequest, Empty) {
  return HandleNow(context, state_, "TrainingService/RemoveAdapter", [&](const tenancy::Tenant& t) {
    return state_.models->CoordinatorFor(t.id, request->adapter_name()).RemoveAdapter(training::ContextOf(t), request->adapter_name());
  });
}

TWINKLE_RPC_DEF(TrainingServiceImpl, SetLoss, SetLossRequest, Empty) {
  return HandleQueued(
      context, state_, "TrainingService/SetLoss", false,
      [&](const tenancy::Tenant& t) {
        return state_.models->CoordinatorFor(t.id, request->adapter_name()).SubmitSetLoss(training::ContextOf(t), request->adapter_name(), request->loss_cls(),
                                                 ToMap(request->config()),
                                                 {request->string_config().begin(), request->string_config().end()});
      },
      [](uint64_t) {}, [](const OpOutput&) { return absl::OkStatus(); });
}

TWINKLE_RPC_DEF(TrainingServiceImpl, SetOptimizer, SetOptimizerRequest, Empty) {
  return HandleQueued(
      context, state_, "TrainingService/SetOptimizer", false,
      [&](const tenancy::Tenant& t) {
        return state_.models->CoordinatorFor(t.id, request->adapter_name()).SubmitSetOptimizer(training::ContextOf(t), request->adapter_name(),
                                                      request->optimizer_cls(), ToMap(request->config()));
      },
      [](uint64_t) {}, [](const OpOutput&) { return absl::OkStatus(); });
}

TWINKLE_RPC_DEF(TrainingServiceImpl, SetLrScheduler, SetLrSchedulerRequest, Empty) {
  return HandleQueued(
      context, state_, "TrainingService/SetLrScheduler", false,
      [&](const tenancy::Tenant& t) {
        return state_.models->CoordinatorFor(t.id, request->adapter_name()).SubmitSetLrScheduler(training::ContextOf(t), request->adapter_name(),
                                                        request->scheduler_cls(), ToMap(request->config()));
      },
      [](uint64_t) {}, [](const OpOutput&) { return absl::OkStatus(); });
}

grpc::ServerUnaryReactor* TrainingServiceImpl::RunForward(grpc::CallbackServerContext* context, const char* method,
                                                          const v1::ForwardRequest* request,
                                                          v1::ForwardResponse* response, int mode) {
  return HandleQueued(
      context, state_, method, request->options().return_future(),
      [&](const tenancy::Tenant& t) -> absl::StatusOr<uint64_t> {
        training::ForwardArgs args = ToForwardArgs(*request);
        int64_t tokens = 0;
        for (const auto& f : args.inputs) tokens += static_cast<int64_t>(f.input_ids.size());
        if (absl::Status s = state_.rate_limiter->Acquire(t, tokens); !s.ok()) return s;
        absl::StatusOr<uint64_t> id = state_.models->CoordinatorFor(t.id, request->adapter_name()).SubmitForward(
            training::ContextOf(t), request->adapter_name(), static_cast<ForwardMode>(mode), args,
            request->disable_lora(), ToSubmitOptions(context, request->options(), request));
        if (!id.ok()) state_.rate_limiter->Refund(t, tokens);
        return id;
      },
      [response](uint64_t id) { response->set_future_id(id); },
      [response](const OpOutput& out) {
        FillModelOutput(out, response->mutable_result());
        return absl::OkStatus();
      });
}

TWINKLE_RPC_DEF(TrainingServiceImpl, Forward, ForwardRequest, ForwardResponse) {
  return RunForward(context, "TrainingService/Forward", request, response, static_cast<int>(ForwardMode::kForward));
}
TWINKLE_RPC_DEF(TrainingServiceImpl, ForwardOnly, ForwardRequest, ForwardResponse) {
  return RunForward(context, "TrainingService/ForwardOnly", request, response,
                    static_cast<int>(ForwardMode::kForwardOnly));
}
TWINKLE_RPC_DEF(TrainingServiceImpl, ForwardBackward, ForwardRequest, ForwardResponse) {
  return RunForward(context, "TrainingService/ForwardBackward", request, response,
                    static_cast<int>(ForwardMode::kForwardBackward));
}

TWINKLE_RPC_DEF(TrainingServiceImpl, CalculateLoss, AdapterRequest, ScalarResponse) {
  return HandleQueued(
      context, state_, "TrainingService/CalculateLoss", request->options().return_future(),
      [&](const tenancy::Tenant& t) {
        return state_.models->CoordinatorFor(t.id, request->adapter_name()).SubmitCalculateLoss(training::ContextOf(t), request->adapter_name(),
                                                       ToSubmitOptions(context, request->options(), request));
      },
      [response](uint64_t id) { response->set_future_id(id); },
      [response](const OpOutput& out) {
        FillScalar(out, response);
        return absl::OkStatus();
      });
}

TWINKLE_RPC_DEF(TrainingServiceImpl, Backward, AdapterRequest, Empty) {
  return HandleQueued(
      context, state_, "TrainingService/Backward", false,
      [&](const tenancy::Tenant& t) {
        return state_.models->CoordinatorFor(t.id, request->adapter_name()).SubmitBackward(training::ContextOf(t), request->adapter_name(),
                                                  ToSubmitOptions(context, request->options(), request));
      },
      [](uint64_t) {}, [](const OpOutput&) { return absl::OkStatus(); });
}

grpc::ServerUnaryReactor* TrainingServiceImpl::RunControl(grpc::CallbackServerContext* context, const char* method,
                                                          const std::string& adapter,
                                                          const v1::RequestOptions& options, int control,
                                                          double max_norm, double norm_type,
                                                          v1::ScalarResponse* response) {
  return HandleQueued(
      context, state_, method, options.return_future(),
      [&](const tenancy::Tenant& t) {
        return state_.models->CoordinatorFor(t.id, adapter).SubmitControl(training::ContextOf(t), adapter, static_cast<Control>(control), max_norm,
                                                 norm_type, ToSubmitOptions(context, options));
      },
      [response](uint64_t id) { response->set_future_id(id); },
      [response](const OpOutput& out) {
        FillScalar(out, response);
        return absl::OkStatus();
      });
}

TWINKLE_RPC_DEF(TrainingServiceImpl, ClipGradNorm, ClipGradNormRequest, ScalarResponse) {
  return RunControl(context, "TrainingService/ClipGradNorm", request->adapter_name(), request->options(),
                    static_cast<int>(Control::kClipGradNorm),
                    request->max_grad_norm() == 0 ? 1.0 : request->max_grad_norm(),
                    request->norm_type() == 0 ? 2.0 : request->norm_type(), response);
}
TWINKLE_RPC_DEF(TrainingServiceImpl, Step, AdapterRequest, ScalarResponse) {
  return RunControl(context, "TrainingService/Step", request->adapter_name(), request->options(),
                    static_cast<int>(Control::kStep), 0, 2, response);
}
TWINKLE_RPC_DEF(TrainingServiceImpl, ZeroGrad, AdapterRequest, ScalarResponse) {
  return RunControl(context, "TrainingService/ZeroGrad", request->adapter_name(), request->options(),
                    static_cast<int>(Control::kZeroGrad), 0, 2, response);
}
TWINKLE_RPC_DEF(TrainingServiceImpl, LrStep, AdapterRequest, ScalarResponse) {
  return RunControl(context, "TrainingService/LrStep", request->adapter_name(), request->options(),
                    static_cast<int>(Control::kLrStep), 0, 2, response);
}
TWINKLE_RPC_DEF(TrainingServiceImpl, ClipGradAndStep, ClipGradNormRequest, ScalarResponse) {
  return RunControl(context, "TrainingService/ClipGradAndStep", request->adapter_name(), request->options(),
                    static_cast<int>(Control::kClipGradAndStep),
                    request->max_grad_norm() == 0 ? 1.0 : request->max_grad_norm(),
                    request->norm_type() == 0 ? 2.0 : request->norm_type(), response);
}

TWINKLE_RPC_DEF(TrainingServiceImpl, CalculateMetric, CalculateMetricRequest, MetricResponse) {
  return HandleQueued(
      context, state_, "TrainingService/CalculateMetric", false,
      [&](const tenancy::Tenant& t) {
        return state_.models->CoordinatorFor(t.id, request->adapter_name()).SubmitCalculateMetric(training::ContextOf(t), request->adapter_name(),
                                                         request->is_training());
      },
      [](uint64_t) {},
      [response](const OpOutput& out) {
        for (const auto& [k, v] : out.metric_strings) (*response->mutable_result())[k] = v;
        return absl::OkStatus();
      });
}

TWINKLE_RPC_DEF(TrainingServiceImpl, GetTrainConfigs, AdapterRequest, TextResponse) {
  return HandleQueued(
      context, state_, "TrainingService/GetTrainConfigs", false,
      [&](const tenancy::Tenant& t) {
        return state_.models->CoordinatorFor(t.id, request->adapter_name()).SubmitGetTrainConfigs(training::ContextOf(t), request->adapter_name());
      },
      [](uint64_t) {},
      [response](const OpOutput& out) {
        response->set_result(out.text);
        return absl::OkStatus();
      });
}

TWINKLE_RPC_DEF(TrainingServiceImpl, GetStateDict, AdapterRequest, StateDictResponse) {
  return HandleQueued(
      context, state_, "TrainingService/GetStateDict", false,
      [&](const tenancy::Tenant& t) {
        return state_.models->CoordinatorFor(t.id, request->adapter_name()).SubmitGetStateDict(training::ContextOf(t), request->adapter_name());
      },
      [](uint64_t) {},
      [response](const OpOutput& out) {
        for (const auto& [name, tensor] : out.tensors) {
          v1::NamedTensor* n = response->add_tensors();
          n->set_name(name);
          n->mutable_shape()->Add(tensor.shape.begin(), tensor.shape.end());
          n->mutable_values()->Add(tensor.values.begin(), tensor.values.end());
        }
        return absl::OkStatus();
      });
}

TWINKLE_RPC_DEF(TrainingServiceImpl, Save, SaveRequest, SaveResponse) {
  return HandleQueued(
      context, state_, "TrainingService/Save", false,
      [&](const tenancy::Tenant& t) {
        training::SaveArgs args;
        args.name = request->name();
        args.save_optimizer = request->save_optimizer();
        args.is_sampler = request->is_sampler();
        args.consumed_train_samples = request->consumed_train_samples();
        if (request->has_ttl_seconds()) args.ttl_seconds = request->ttl_seconds();
        return state_.models->CoordinatorFor(t.id, request->adapter_name()).SubmitSave(training::ContextOf(t), request->adapter_name(), args);
      },
      [](uint64_t) {},
      [response](const OpOutput& out) {
        response->set_twinkle_path(out.checkpoint_uri);
        response->set_checkpoint_dir(out.checkpoint_dir);
        return absl::OkStatus();
      });
}

TWINKLE_RPC_DEF(TrainingServiceImpl, Load, LoadRequest, Empty) {
  // Reads and verifies the checkpoint on this callback thread, then waits for its op.
  return HandleQueued(
      context, state_, "TrainingService/Load", false,
      [&](const tenancy::Tenant& t) {
        return state_.models->CoordinatorFor(t.id, request->adapter_name()).SubmitLoad(
            training::ContextOf(t), request->adapter_name(), request->name(),
            request->load_optimizer() ? training::LoadMode::kWeightsAndOptimizer : training::LoadMode::kWeights);
      },
      [](uint64_t) {}, [](const OpOutput&) { return absl::OkStatus(); });
}

TWINKLE_RPC_DEF(TrainingServiceImpl, ResumeFromCheckpoint, LoadRequest, ResumeResponse) {
  return HandleQueued(
      context, state_, "TrainingService/ResumeFromCheckpoint", false,
      [&](const tenancy::Tenant& t) {
        return state_.models->CoordinatorFor(t.id, request->adapter_name()).SubmitLoad(
            training::ContextOf(t), request->adapter_name(), request->name(),
            request->resume_only_model() ? training::LoadMode::kResumeOnlyModel : training::LoadMode::kResume);
      },
      [](uint64_t) {},
      [response](const OpOutput& out) {
        response->set_cur_step(out.cur_step);
        response->set_consumed_train_samples(out.consumed_train_samples);
        response->set_gradient_accumulation_steps(out.gradient_accumulation_steps);
        return absl::OkStatus();
      });
}

TWINKLE_RPC_DEF(TrainingServiceImpl, WaitFuture, WaitFutureRequest, FutureResponse) {
  const uint64_t id = request->future_id();
  return HandleWait(
      context, state_, "TrainingService/WaitFuture", id, WaitTimeout(*context, *request),
      [response, id](const FutureValue& value) -> absl::Status {
        const auto* out = std::get_if<OpOutput>(&value);
        if (out == nullptr) {
          return absl::InvalidArgumentError(
              absl::StrCat("future ", id, " is not a training op (a sampling future? use WaitSample)"));
        }
        response->set_done(true);
        if (!out->sequences.empty()) {
          FillModelOutput(*out, response->mutable_forward()->mutable_result());
        } else {
          FillScalar(*out, response->mutable_scalar());
        }
        return absl::OkStatus();
      },
      [response] { response->set_done(false); });
}

TWINKLE_RPC_DEF(TrainingServiceImpl, CancelFuture, CancelFutureRequest, Empty) {
  return HandleNow(context, state_, "TrainingService/CancelFuture", [&](const tenancy::Tenant& t) {
    // Future ids are server-wide; the scheduler that queued it is the one that knows it.
    absl::Status status = absl::NotFoundError("unknown future");
    for (ModelStack* m : state_.models->stacks()) {
      status = m->coordinator().scheduler().Cancel(request->future_id(), t.id);
      if (!absl::IsNotFound(status)) return status;
    }
    return status;
  });
}

TWINKLE_RPC_DEF(TestingServiceImpl, PauseScheduler, Empty, Empty) {
  return HandleNow(context, state_, "TestingService/PauseScheduler", [&](const tenancy::Tenant&) {
    for (ModelStack* m : state_.models->stacks()) m->coordinator().scheduler().Pause();
    return absl::OkStatus();
  });
}
TWINKLE_RPC_DEF(TestingServiceImpl, ResumeScheduler, Empty, Empty) {
  return HandleNow(context, state_, "TestingService/ResumeScheduler", [&](const tenancy::Tenant&) {
    for (ModelStack* m : state_.models->stacks()) m->coordinator().scheduler().Resume();
    return absl::OkStatus();
  });
}
TWINKLE_RPC_DEF(TestingServiceImpl, StepScheduler, StepSchedulerRequest, Empty) {
  return HandleNow(context, state_, "TestingService/StepScheduler", [&](const tenancy::Tenant&) {
    for (ModelStack* m : state_.models->stacks()) m->coordinator().scheduler().Step(request->steps() <= 0 ? 1 : request->steps());
    return absl::OkStatus();
  });
}

TWINKLE_RPC_DEF(TestingServiceImpl, InjectFault, InjectFaultRequest, Empty) {
  return HandleNow(context, state_, "TestingService/InjectFault", [&](const tenancy::Tenant&) -> absl::Status {
    absl::StatusOr<storage::FaultInjectingFileSystem::Op> op = storage::FaultInjectingFileSystem::ParseOp(request->op());
    if (!op.ok()) return op.status();
    int error = 0;
    if (request->error() == "ENOSPC") error = ENOSPC;
    else if (request->error() == "EIO") error = EIO;
    else return absl::InvalidArgumentError(absl::StrCat("error: '", request->error(), "' (accepted: ENOSPC, EIO)"));
    state_.faults->Arm(*op, error, request->nth() <= 0 ? 1 : request->nth());
    return absl::OkStatus();
  });
}

#undef TWINKLE_RPC_DEF

}  // namespace twinkle
