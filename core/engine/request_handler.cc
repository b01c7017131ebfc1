#include "core/engine/request_handler.h"

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/engine/loss/loss_probe.h"
#include "core/engine/loss/loss.h"
#include "core/engine/model/activation_memory.h"
#include "core/engine/model/decoder.h"
#include "core/engine/model/loader.h"
#include "core/engine/optim/optim_probe.h"
#include "core/engine/trainer.h"
#include "core/ipc/training_messages.h"
#include "core/ipc/messages.h"

namespace twinkle::engine {
namespace {

absl::StatusOr<c10::ScalarType> ParseDtype(const std::string& name) {
  if (name == "float32") return c10::ScalarType::Float;
  if (name == "bfloat16") return c10::ScalarType::BFloat16;
  if (name == "float16") return c10::ScalarType::Half;
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported dtype '", name, "' (expected float32, bfloat16 or float16)"));
}

absl::StatusOr<c10::Device> ParseDevice(const std::string& name) {
  try {
    return c10::Device(name);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("bad device '", name, "': ", e.what()));
  }
}

// The debug methods of --test-hooks.
absl::StatusOr<MethodReply> DebugSleep(const ipc::Message& request) {
  absl::StatusOr<ipc::DebugRequest> req = ipc::Unpack<ipc::DebugRequest>(request.envelope.body, "debug_sleep");
  if (!req.ok()) return req.status();
  absl::SleepFor(absl::Milliseconds(req->milliseconds));
  return MethodReply{};
}

absl::StatusOr<MethodReply> DebugReplyFrames(const ipc::Message& request) {
  absl::StatusOr<ipc::DebugRequest> req =
      ipc::Unpack<ipc::DebugRequest>(request.envelope.body, "debug_reply_frames");
  if (!req.ok()) return req.status();
  MethodReply reply;
  reply.buffers.resize(static_cast<size_t>(std::max<int64_t>(0, req->frames)));
  return reply;
}

}  // namespace

RequestHandler::RequestHandler(std::string device, bool test_hooks, DistributedOptions distributed)
    : device_(std::move(device)), distributed_(std::move(distributed)) {
  if (test_hooks) {
    methods_[ipc::kMethodDebugSleep] = DebugSleep;
    methods_[ipc::kMethodDebugReplyFrames] = DebugReplyFrames;
  }
  // Training methods answer FailedPrecondition until a model is loaded; LoadModel replaces
  // these entries with the trainer's.
  for (const char* name : {ipc::kMethodCreateAdapter, ipc::kMethodRemoveAdapter, ipc::kMethodForward,
                           ipc::kMethodForwardBackward, ipc::kMethodOptimStep, ipc::kMethodZeroGrad,
                           ipc::kMethodGetAdapterState, ipc::kMethodSetAdapterState,
                           ipc::kMethodSetOptimizer, ipc::kMethodClipGradNorm, ipc::kMethodRejoinGroup,
                           ipc::kMethodSample, ipc::kMethodSampleStep}) {
    methods_[name] = [name](const ipc::Message&) -> absl::StatusOr<MethodReply> {
      return absl::FailedPreconditionError(absl::StrCat(name, ": no model loaded (load_model first)"));
    };
  }
  methods_[ipc::kMethodLoadModel] = [this](const ipc::Message& m) { return LoadModel(m); };
  methods_[kMethodLossProbe] = [](const ipc::Message& m) { return RunLossProbe(m); };
  methods_["optim_probe"] = [](const ipc::Message& m) { return RunOptimProbe(m); };
}
RequestHandler::~RequestHandler() = default;

absl::StatusOr<MethodReply> RequestHandler::Handle(const ipc::Message& request) {
  const std::string& method = request.envelope.method;
  auto it = methods_.find(method);
  if (it == methods_.end()) {
    return absl::UnimplementedError(absl::StrCat("engine has no method '", method, "'"));
  }
  try {
    return it->second(request);
  } catch (const std::exception& e) {  // the engine's exception boundary
    return absl::InternalError(absl::StrCat(method, ": ", e.what()));
  }
}

absl::StatusOr<MethodReply> RequestHandler::LoadModel(const ipc::Message& request) {
  absl::StatusOr<ipc::LoadModelRequest> req =
      ipc::Unpack<ipc::LoadModelRequest>(request.envelope.body, "load_model");
  if (!req.ok()) return req.status();
  absl::StatusOr<c10::ScalarType> dtype = ParseDtype(req->dtype);
  if (!dtype.ok()) return dtype.status();
  absl::StatusOr<c10::Device> device = ParseDevice(req->device.empty() ? device_ : req->device);
  if (!device.ok()) return device.status();

  if (req->logit_chunk_rows < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("load_model: logit_chunk_rows must be >= 0, got ", req->logit_chunk_rows));
  }

  const absl::Time start = absl::Now();
  absl::StatusOr<engine::LoadedModel> loaded = engine::LoadModel(req->model_dir, *dtype, *device);
  if (!loaded.ok()) return loaded.status();
  const ModelConfig& config = loaded->config;
  ipc::LoadModelReply reply;
  reply.architecture = config.architecture;
  reply.model_type = config.model_type;
  reply.parameter_count = loaded->parameter_count;
  reply.dtype = req->dtype;
  reply.device = device->str();
  reply.num_layers = static_cast<int32_t>(config.num_hidden_layers);
  reply.vocab_size = config.vocab_size;
  reply.hidden_size = config.hidden_size;
  reply.supported_losses = SupportedLossNames();
  reply.max_position_embeddings = config.max_position_embeddings;
  // What a forward_backward will take of the device, for the coordinator's admission
  // (engine.activation_memory_mib). The CPU path always runs the flash kernel; on CUDA,
  // SDPA's flash kernel needs half precision, so float32 is estimated as math attention.
  const ActivationCost cost = ActivationCostOf(
      config, {.itemsize = static_cast<int64_t>(c10::elementSize(*dtype)),
               .checkpointing = req->activation_checkpointing,
               .logit_chunk_rows = LogitChunkRows(config.vocab_size, req->logit_chunk_rows),
               .flash_attention = device->is_cpu() || *dtype != c10::kFloat,
               .max_lora_rank = req->max_lora_rank});
  reply.activation_fixed_bytes = cost.fixed_bytes;
  reply.activation_token_bytes = cost.token_bytes;
  reply.activation_seq_sq_bytes = cost.seq_sq_bytes;
  reply.activation_chunk_rows = cost.chunk_rows;
  reply.activation_chunk_row_bytes = cost.chunk_row_bytes;
  std::unique_ptr<ProcessGroup> group;
  if (distributed_.world_size > 1) {
    if (trainer_ != nullptr) {
      return absl::FailedPreconditionError(
          "load_model: this rank already joined its process group; restart the worker to reload");
    }
    absl::StatusOr<std::unique_ptr<ProcessGroup>> joined = ProcessGroup::Create(distributed_, *device);
    if (!joined.ok()) return joined.status();
    group = *std::move(joined);
    reply.world_size = group->world_size();
  }
  auto model = std::make_unique<DecoderModel>(config, std::move(loaded->weights));
  model->set_logit_chunk_rows(req->logit_chunk_rows);
  model->set_activation_checkpointing(req->activation_checkpointing);
  auto trainer = std::make_unique<Trainer>(std::move(model), *device, req->max_lora_rank,
                                           std::move(group));
  trainer->set_activation_cost(cost);
  if (absl::Status s = trainer->InitSampler(
          *dtype, {req->kv_cache_blocks, req->kv_block_size, req->state_slots});
      !s.ok()) {
    return s;
  }
  reply.kv_cache_blocks = trainer->sampler().blocks_total();
  reply.kv_block_size = trainer->sampler().block_size();
  reply.state_slots = trainer->sampler().states_total();
  trainer_ = std::move(trainer);
  trainer_->RegisterMethods(methods_);
  reply.load_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  MethodReply out;
  out.envelope.body = ipc::Pack(reply);
  return out;
}

}  // namespace twinkle::engine
