#pragma once
// The Tinker operations' typed requests and results: what TinkerApi takes and returns, with
// no transport in them. Codecs translate: the HTTP API's JSON (tinker_codec.h) and the gRPC
// tinker.v1 messages (server/grpc/tinker_service.cc). A decoder checks the wire form (types,
// required fields) and names the field as the SDK spells it; TinkerApi checks the values
// (ranges, limits, names), so both transports share every such rule and its message.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace twinkle::tinker {

// An op's answer: its request id, retrieved later with retrieve_future.
struct FuturePromise {
  std::string request_id;
  std::string model_id;                          // "" for sampling (JSON: null)
  std::vector<std::string> sample_sequence_ids;  // asample: one per requested sample
};

// ---- sessions ------------------------------------------------------------------------------

struct CreateSessionRequest {
  std::optional<std::vector<std::string>> tags;
  // An object of strings, kept as the SDK sent it (it is stored and returned as JSON); null
  // when absent.
  nlohmann::json user_metadata;
  std::optional<std::string> project_id;
  std::optional<std::string> display_name;
};
struct CreateSessionResult {
  std::string session_id;
};

struct SessionHeartbeatRequest {
  std::string session_id;
};
struct SessionHeartbeatResult {};

struct SupportedModel {
  std::string model_name;
  std::optional<int64_t> max_context_length;  // unknown until the engine has loaded the model
  bool trainable = true;
  bool sampleable = false;
};
struct ServerCapabilities {
  std::vector<SupportedModel> supported_models;
};

// ---- training ------------------------------------------------------------------------------

struct LoraConfig {
  int64_t rank = 32;
  uint64_t seed = 0;
  bool train_attn = true;
  bool train_mlp = true;
  bool train_unembed = true;
};
struct CreateModelRequest {
  std::string session_id;
  int64_t model_seq_id = 0;
  std::string base_model;
  LoraConfig lora_config;
  nlohmann::json user_metadata;  // an object of strings, or null
};

// unload_model and get_info.
struct ModelRequest {
  std::string model_id;
};

// Adam's hyperparameters; the defaults are Tinker's.
struct AdamParams {
  double learning_rate = 1e-4;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-12;
  double weight_decay = 0.0;
  double grad_clip_norm = 0.0;
};
struct OptimStepRequest {
  std::string model_id;
  int64_t seq_id = 0;
  AdamParams adam_params;
};

struct SaveWeightsRequest {
  std::string model_id;
  int64_t seq_id = 0;
  std::string path;  // the checkpoint name
  bool overwrite = false;
  std::optional<int64_t> ttl_seconds;
};

struct LoadWeightsRequest {
  // Unset: the SDK's create_training_client_from_state, which creates the model
  // (session_id, model_seq_id) and loads into it.
  std::optional<std::string> model_id;
  std::string session_id;
  int64_t model_seq_id = 0;
  int64_t seq_id = 0;
  std::string path;  // tinker://<model_id>/weights/<name>
  bool optimizer = false;
};

struct SaveWeightsForSamplerRequest {
  std::string model_id;
  int64_t seq_id = 0;
  std::string path;  // "": a live snapshot and a sampling session on it
  int64_t sampling_session_seq_id = -1;
  std::optional<int64_t> ttl_seconds;  // named form only
};

struct ModelData {
  std::string arch;
  std::string model_name;
  std::string tokenizer_id;
};
struct GetInfoResult {
  std::string model_id;
  ModelData model_data;
  bool is_lora = true;
  int64_t lora_rank = 0;
  std::string model_name;
};

struct WeightsInfoRequest {
  std::string tinker_path;
};
struct WeightsInfoResult {
  std::string base_model;
  bool is_lora = true;
  int64_t lora_rank = 0;
  bool train_unembed = false;
  bool train_mlp = false;
  bool train_attn = false;
};

// What an op without a protobuf result of its own finished with (create_model,
// unload_model, optim_step, the saves and loads): `type` names the op; the fields it sets
// are the ones its answer has.
struct OpResult {
  std::string type;
  std::optional<std::string> model_id;
  std::optional<std::string> path;
  std::optional<std::string> sampling_session_id;
  std::optional<std::map<std::string, double>> metrics;

  // Each op's result, with the fields its answer has.
  static OpResult OfModel(std::string type, std::string model_id) {  // create_model, unload_model
    OpResult r;
    r.type = std::move(type);
    r.model_id = std::move(model_id);
    return r;
  }
  static OpResult OfPath(std::string type, std::string path) {  // the saves
    OpResult r;
    r.type = std::move(type);
    r.path = std::move(path);
    return r;
  }
  static OpResult OfLoad(std::string model_id, std::string path) {
    OpResult r = OfModel("load_weights", std::move(model_id));
    r.path = std::move(path);
    return r;
  }
  static OpResult OfSamplingSession(std::string type, std::string sampling_session_id) {
    OpResult r;
    r.type = std::move(type);
    r.sampling_session_id = std::move(sampling_session_id);
    return r;
  }
  static OpResult OfMetrics(std::string type, std::map<std::string, double> metrics) {  // optim_step
    OpResult r;
    r.type = std::move(type);
    r.metrics = std::move(metrics);
    return r;
  }
};

// ---- sampling ------------------------------------------------------------------------------

struct CreateSamplingSessionRequest {
  std::string session_id;
  int64_t sampling_session_seq_id = -1;  // < 0: not deduplicated
  std::string model_path;                // "": the base model
  std::string base_model;
};
struct CreateSamplingSessionResult {
  std::string sampling_session_id;
};

struct SamplingParams {
  std::optional<int64_t> max_tokens;
  std::optional<uint64_t> seed;
  double temperature = 1.0;
  int64_t top_k = -1;  // < 0: off
  double top_p = 1.0;
  // Unset: the implicit EOS stop only. Set and empty: no stop at all, not even EOS (the
  // SDK's stop=[]). Otherwise these strings and token ids besides EOS.
  std::optional<std::vector<std::string>> stop_strings;
  std::optional<std::vector<int64_t>> stop_tokens;
};

// target_prompt_logprobs as the request gave it: the ids [rows, width] densely (a sparse CSR
// request's unlisted cells are -1) and, for a CSR request, its indices, so that the reply
// comes back in the same layout.
struct TargetPromptTokens {
  int64_t rows = 0, width = 0;
  bool sparse = false;
  std::vector<int64_t> crow, col;
  std::vector<int64_t> dense;
};

struct SampleRequest {
  std::string sampling_session_id;  // "": the tenant's implicit session on model_path
  std::string model_path;
  std::string base_model;  // without a session or model_path: which base model ("": the default)
  int64_t seq_id = -1;
  int64_t num_samples = 1;
  std::vector<int64_t> prompt;
  SamplingParams sampling_params;
  bool prompt_logprobs = false;
  int64_t topk_prompt_logprobs = 0;
  int64_t topk_sample_logprobs = 0;
  bool record_stability_info = false;
  std::optional<int64_t> prompt_logprobs_last_n;
  std::optional<TargetPromptTokens> target_prompt_logprobs;
  int64_t prompt_alt_tokens_k = 0;
};

// ---- futures -------------------------------------------------------------------------------

struct RetrieveFutureRequest {
  std::string request_id;
};

// ---- REST ----------------------------------------------------------------------------------

struct CheckpointInfo {
  std::string checkpoint_id;
  std::string checkpoint_type;
  std::string time;  // ISO 8601, UTC
  std::string tinker_path;
  int64_t size_bytes = 0;
  bool published = false;
  std::optional<std::string> expires_at;
};

struct TrainingRunInfo {
  std::string training_run_id;
  std::string base_model;
  std::string model_owner;
  bool is_lora = true;
  bool corrupted = false;
  std::optional<int64_t> lora_rank;
  std::string last_request_time;
  std::optional<CheckpointInfo> last_checkpoint;
  std::optional<CheckpointInfo> last_sampler_checkpoint;
  nlohmann::json user_metadata;  // an object, or null
};

struct Cursor {
  int64_t offset = 0;
  int64_t limit = 0;
  int64_t total_count = 0;
};

struct ListTrainingRunsRequest {
  int32_t limit = 20;
  int32_t offset = 0;
  std::string access_scope;  // "" / "owned" or "accessible"
};
struct TrainingRunsResult {
  std::vector<TrainingRunInfo> training_runs;
  Cursor cursor;
};

struct ListCheckpointsRequest {
  std::string training_run_id;
  std::string access_scope;
};
struct CheckpointsResult {
  std::vector<CheckpointInfo> checkpoints;
  std::optional<Cursor> cursor;  // a run's checkpoints: none
};

struct DeleteCheckpointRequest {
  std::string training_run_id;
  std::string checkpoint_id;  // weights/<name> | sampler_weights/<name>
};
struct DeleteCheckpointResult {};

}  // namespace twinkle::tinker
