// The HTTP codec's encoders (tinker_codec.h): typed results into the JSON the SDK reads.
#include <string>
#include <utility>

#include "server/tinker/tinker_codec.h"

namespace twinkle::tinker {
namespace {

template <typename T>
Json OrNull(const std::optional<T>& value) {
  return value ? Json(*value) : Json(nullptr);
}

Json ToJson(const Cursor& c) { return {{"offset", c.offset}, {"limit", c.limit}, {"total_count", c.total_count}}; }

}  // namespace

Json ToJson(const FuturePromise& promise) {
  Json j = {{"request_id", promise.request_id}};
  j["model_id"] = promise.model_id.empty() ? Json(nullptr) : Json(promise.model_id);
  if (!promise.sample_sequence_ids.empty()) j["sample_sequence_ids"] = promise.sample_sequence_ids;
  return j;
}

Json ToJson(const CreateSessionResult& result) {
  return {{"session_id", result.session_id}, {"type", "create_session"}};
}

Json ToJson(const SessionHeartbeatResult&) { return {{"type", "session_heartbeat"}}; }

Json ToJson(const ServerCapabilities& result) {
  Json models = Json::array();
  for (const SupportedModel& m : result.supported_models) {
    Json model = {{"model_name", m.model_name}, {"trainable", m.trainable}, {"sampleable", m.sampleable}};
    if (m.max_context_length) model["max_context_length"] = *m.max_context_length;
    models.push_back(std::move(model));
  }
  return {{"supported_models", std::move(models)}};
}

Json ToJson(const GetInfoResult& r) {
  return {{"type", "get_info"},
          {"model_id", r.model_id},
          {"model_data",
           {{"arch", r.model_data.arch}, {"model_name", r.model_data.model_name},
            {"tokenizer_id", r.model_data.tokenizer_id}}},
          {"is_lora", r.is_lora},
          {"lora_rank", r.lora_rank},
          {"model_name", r.model_name}};
}

Json ToJson(const WeightsInfoResult& r) {
  return {{"base_model", r.base_model},       {"is_lora", r.is_lora},     {"lora_rank", r.lora_rank},
          {"train_unembed", r.train_unembed}, {"train_mlp", r.train_mlp}, {"train_attn", r.train_attn}};
}

Json ToJson(const OpResult& r) {
  Json j = {{"type", r.type}};
  if (r.model_id) j["model_id"] = *r.model_id;
  if (r.path) j["path"] = *r.path;
  if (r.sampling_session_id) j["sampling_session_id"] = *r.sampling_session_id;
  if (r.metrics) j["metrics"] = *r.metrics;  // an object, {} when there are none
  return j;
}

Json ToJson(const CreateSamplingSessionResult& result) {
  return {{"sampling_session_id", result.sampling_session_id}, {"type", "create_sampling_session"}};
}

Json ToJson(const CheckpointInfo& c) {
  return {{"checkpoint_id", c.checkpoint_id},
          {"checkpoint_type", c.checkpoint_type},
          {"time", c.time},
          {"tinker_path", c.tinker_path},
          {"size_bytes", c.size_bytes},
          {"public", c.published},
          {"expires_at", OrNull(c.expires_at)}};
}

Json ToJson(const TrainingRunInfo& r) {
  return {{"training_run_id", r.training_run_id},
          {"base_model", r.base_model},
          {"model_owner", r.model_owner},
          {"is_lora", r.is_lora},
          {"corrupted", r.corrupted},
          {"lora_rank", OrNull(r.lora_rank)},
          {"last_request_time", r.last_request_time},
          {"last_checkpoint", r.last_checkpoint ? ToJson(*r.last_checkpoint) : Json(nullptr)},
          {"last_sampler_checkpoint", r.last_sampler_checkpoint ? ToJson(*r.last_sampler_checkpoint) : Json(nullptr)},
          {"user_metadata", r.user_metadata.is_object() ? r.user_metadata : Json(nullptr)}};
}

Json ToJson(const TrainingRunsResult& result) {
  Json runs = Json::array();
  for (const TrainingRunInfo& r : result.training_runs) runs.push_back(ToJson(r));
  return {{"training_runs", std::move(runs)}, {"cursor", ToJson(result.cursor)}};
}

Json ToJson(const CheckpointsResult& result) {
  Json list = Json::array();
  for (const CheckpointInfo& c : result.checkpoints) list.push_back(ToJson(c));
  return {{"checkpoints", std::move(list)}, {"cursor", result.cursor ? ToJson(*result.cursor) : Json(nullptr)}};
}

Json ToJson(const DeleteCheckpointResult&) { return Json::object(); }

}  // namespace twinkle::tinker
