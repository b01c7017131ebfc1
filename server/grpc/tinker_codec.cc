#include "server/grpc/tinker_codec.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace twinkle::tinker {
namespace {

absl::StatusOr<std::string> Required(const std::string& value, const char* field) {
  if (value.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": missing"));
  return value;
}

}  // namespace

absl::StatusOr<CreateSessionRequest> Decode(const v1::CreateSessionRequest& m) {
  CreateSessionRequest r;
  if (m.tags_size() > 0) r.tags.emplace(m.tags().begin(), m.tags().end());
  return r;
}

absl::StatusOr<SessionHeartbeatRequest> Decode(const v1::SessionHeartbeatRequest& m) {
  absl::StatusOr<std::string> session = Required(m.session_id(), "session_id");
  if (!session.ok()) return session.status();
  return SessionHeartbeatRequest{*std::move(session)};
}

absl::StatusOr<CreateModelRequest> Decode(const v1::CreateModelRequest& m) {
  CreateModelRequest r;
  absl::StatusOr<std::string> session = Required(m.session_id(), "session_id");
  if (!session.ok()) return session.status();
  absl::StatusOr<std::string> base = Required(m.base_model(), "base_model");
  if (!base.ok()) return base.status();
  r.session_id = *std::move(session);
  r.model_seq_id = m.model_seq_id();
  r.base_model = *std::move(base);
  const v1::LoraConfig& lora = m.lora_config();
  if (lora.rank() != 0) r.lora_config.rank = lora.rank();  // 0: unset, the default rank
  if (lora.has_seed()) r.lora_config.seed = lora.seed();
  if (lora.has_train_attn()) r.lora_config.train_attn = lora.train_attn();
  if (lora.has_train_mlp()) r.lora_config.train_mlp = lora.train_mlp();
  if (lora.has_train_unembed()) r.lora_config.train_unembed = lora.train_unembed();
  return r;
}

absl::StatusOr<ModelRequest> Decode(const v1::ModelRequest& m) {
  absl::StatusOr<std::string> model_id = Required(m.model_id(), "model_id");
  if (!model_id.ok()) return model_id.status();
  return ModelRequest{*std::move(model_id)};
}

absl::StatusOr<OptimStepRequest> Decode(const v1::OptimStepRequest& m) {
  OptimStepRequest r;
  absl::StatusOr<std::string> model_id = Required(m.model_id(), "model_id");
  if (!model_id.ok()) return model_id.status();
  r.model_id = *std::move(model_id);
  r.seq_id = m.seq_id();
  const v1::AdamParams& p = m.adam_params();
  AdamParams& a = r.adam_params;
  if (p.has_learning_rate()) a.learning_rate = p.learning_rate();
  if (p.has_beta1()) a.beta1 = p.beta1();
  if (p.has_beta2()) a.beta2 = p.beta2();
  if (p.has_eps()) a.eps = p.eps();
  if (p.has_weight_decay()) a.weight_decay = p.weight_decay();
  if (p.has_grad_clip_norm()) a.grad_clip_norm = p.grad_clip_norm();
  return r;
}

absl::StatusOr<SaveWeightsRequest> Decode(const v1::SaveWeightsRequest& m) {
  absl::StatusOr<std::string> model_id = Required(m.model_id(), "model_id");
  if (!model_id.ok()) return model_id.status();
  absl::StatusOr<std::string> path = Required(m.path(), "path");
  if (!path.ok()) return path.status();
  SaveWeightsRequest r;
  r.model_id = *std::move(model_id);
  r.seq_id = m.seq_id();
  r.path = *std::move(path);
  r.overwrite = m.overwrite();
  return r;
}

absl::StatusOr<LoadWeightsRequest> Decode(const v1::LoadWeightsRequest& m) {
  // The message has no session_id: over gRPC a load always names its model.
  absl::StatusOr<std::string> model_id = Required(m.model_id(), "model_id");
  if (!model_id.ok()) return model_id.status();
  absl::StatusOr<std::string> path = Required(m.path(), "path");
  if (!path.ok()) return path.status();
  LoadWeightsRequest r;
  r.model_id = *std::move(model_id);
  r.seq_id = m.seq_id();
  r.path = *std::move(path);
  r.optimizer = m.optimizer();
  return r;
}

absl::StatusOr<SaveWeightsForSamplerRequest> Decode(const v1::SaveWeightsForSamplerRequest& m) {
  absl::StatusOr<std::string> model_id = Required(m.model_id(), "model_id");
  if (!model_id.ok()) return model_id.status();
  SaveWeightsForSamplerRequest r;
  r.model_id = *std::move(model_id);
  r.seq_id = m.seq_id();
  if (m.has_path()) r.path = m.path();
  if (m.has_sampling_session_seq_id()) r.sampling_session_seq_id = m.sampling_session_seq_id();
  return r;
}

absl::StatusOr<WeightsInfoRequest> Decode(const v1::WeightsInfoRequest& m) {
  absl::StatusOr<std::string> path = Required(m.tinker_path(), "tinker_path");
  if (!path.ok()) return path.status();
  return WeightsInfoRequest{*std::move(path)};
}

absl::StatusOr<CreateSamplingSessionRequest> Decode(const v1::CreateSamplingSessionRequest& m) {
  CreateSamplingSessionRequest r;
  r.session_id = m.session_id();
  // 0 is also proto3's unset: the service has always read it as "no seq id" (not deduplicated).
  r.sampling_session_seq_id = m.sampling_session_seq_id() != 0 ? m.sampling_session_seq_id() : -1;
  r.model_path = m.model_path();
  r.base_model = m.base_model();
  return r;
}

absl::StatusOr<SampleRequest> Decode(const v1::SampleRequest& m) {
  SampleRequest r;
  r.sampling_session_id = m.sampling_session_id();
  r.seq_id = m.seq_id();
  r.num_samples = m.num_samples() > 0 ? m.num_samples() : 1;
  r.prompt.assign(m.prompt().begin(), m.prompt().end());
  r.prompt_logprobs = m.prompt_logprobs();
  r.topk_prompt_logprobs = m.topk_prompt_logprobs();
  r.topk_sample_logprobs = m.topk_sample_logprobs();
  const v1::SamplingParams& p = m.sampling_params();
  SamplingParams& sp = r.sampling_params;
  if (p.has_max_tokens()) sp.max_tokens = p.max_tokens();
  if (p.has_seed()) sp.seed = p.seed();
  if (p.has_temperature()) sp.temperature = p.temperature();
  if (p.has_top_k()) sp.top_k = p.top_k();
  if (p.has_top_p()) sp.top_p = p.top_p();
  if (p.has_stop_strs()) sp.stop_strings.emplace(p.stop_strs().values().begin(), p.stop_strs().values().end());
  if (p.has_stop_tokens()) sp.stop_tokens.emplace(p.stop_tokens().values().begin(), p.stop_tokens().values().end());
  return r;
}

absl::StatusOr<RetrieveFutureRequest> Decode(const v1::RetrieveFutureRequest& m) {
  absl::StatusOr<std::string> request_id = Required(m.request_id(), "request_id");
  if (!request_id.ok()) return request_id.status();
  return RetrieveFutureRequest{*std::move(request_id)};
}

absl::StatusOr<ListTrainingRunsRequest> Decode(const v1::ListTrainingRunsRequest& m) {
  return ListTrainingRunsRequest{m.limit() > 0 ? m.limit() : 20, m.offset(), ""};
}

absl::StatusOr<ListCheckpointsRequest> Decode(const v1::ListCheckpointsRequest& m) {
  return ListCheckpointsRequest{m.training_run_id(), ""};
}

absl::StatusOr<DeleteCheckpointRequest> Decode(const v1::DeleteCheckpointRequest& m) {
  return DeleteCheckpointRequest{m.training_run_id(), m.checkpoint_id()};
}

void Encode(const FuturePromise& r, v1::FuturePromise* m) {
  m->set_request_id(r.request_id);
  m->set_model_id(r.model_id);
  for (const std::string& id : r.sample_sequence_ids) m->add_sample_sequence_ids(id);
}

void Encode(const CreateSessionResult& r, v1::CreateSessionResponse* m) { m->set_session_id(r.session_id); }

void Encode(const SessionHeartbeatResult&, v1::SessionHeartbeatResponse*) {}

void Encode(const ServerCapabilities& r, v1::GetServerCapabilitiesResponse* m) {
  for (const SupportedModel& s : r.supported_models) {
    v1::SupportedModel* model = m->add_supported_models();
    model->set_model_name(s.model_name);
    model->set_max_context_length(s.max_context_length.value_or(0));
    model->set_trainable(s.trainable);
    model->set_sampleable(s.sampleable);
  }
}

void Encode(const GetInfoResult& r, v1::GetInfoResponse* m) {
  m->set_model_id(r.model_id);
  m->mutable_model_data()->set_arch(r.model_data.arch);
  m->mutable_model_data()->set_model_name(r.model_data.model_name);
  m->mutable_model_data()->set_tokenizer_id(r.model_data.tokenizer_id);
  m->set_is_lora(r.is_lora);
  m->set_lora_rank(static_cast<int32_t>(r.lora_rank));
  m->set_model_name(r.model_name);
}

void Encode(const WeightsInfoResult& r, v1::WeightsInfoResponse* m) {
  m->set_base_model(r.base_model);
  m->set_is_lora(r.is_lora);
  m->set_lora_rank(static_cast<int32_t>(r.lora_rank));
  m->set_train_unembed(r.train_unembed);
  m->set_train_mlp(r.train_mlp);
  m->set_train_attn(r.train_attn);
}

void Encode(const CreateSamplingSessionResult& r, v1::CreateSamplingSessionResponse* m) {
  m->set_sampling_session_id(r.sampling_session_id);
}

void Encode(const TrainingRunsResult& r, v1::ListTrainingRunsResponse* m) {
  for (const TrainingRunInfo& run : r.training_runs) {
    v1::TrainingRun* out = m->add_training_runs();
    out->set_training_run_id(run.training_run_id);
    out->set_base_model(run.base_model);
    out->set_model_owner(run.model_owner);
    out->set_is_lora(run.is_lora);
    out->set_lora_rank(static_cast<int32_t>(run.lora_rank.value_or(0)));
    out->set_last_request_time(run.last_request_time);
  }
  m->mutable_cursor()->set_offset(static_cast<int32_t>(r.cursor.offset));
  m->mutable_cursor()->set_limit(static_cast<int32_t>(r.cursor.limit));
  m->mutable_cursor()->set_total_count(static_cast<int32_t>(r.cursor.total_count));
}

void Encode(const CheckpointsResult& r, v1::ListCheckpointsResponse* m) {
  for (const CheckpointInfo& c : r.checkpoints) {
    v1::Checkpoint* out = m->add_checkpoints();
    out->set_checkpoint_id(c.checkpoint_id);
    out->set_checkpoint_type(c.checkpoint_type);
    out->set_time(c.time);
    out->set_tinker_path(c.tinker_path);
    out->set_size_bytes(c.size_bytes);
  }
}

void Encode(const DeleteCheckpointResult&, v1::DeleteCheckpointResponse*) {}

}  // namespace twinkle::tinker
