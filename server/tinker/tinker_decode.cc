// The HTTP codec's decoders (tinker_codec.h): the SDK's JSON bodies into typed requests.
// Lenient like the SDK's own models: unknown keys are ignored, null is absent, integers may
// come as decimal strings.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/ipc/training_messages.h"
#include "server/tinker/tinker_codec.h"
#include "server/tinker/tinker_internal.h"
#include "server/tinker/tinker_json.h"

namespace twinkle::tinker {
namespace {

bool Present(const Json& body, const char* key) { return body.contains(key) && !body[key].is_null(); }

// An optional string field: absent or null = nullopt.
absl::StatusOr<std::optional<std::string>> OptionalString(const Json& body, const char* key) {
  if (!Present(body, key)) return std::nullopt;
  if (!body[key].is_string()) return absl::InvalidArgumentError(absl::StrCat(key, ": expected a string"));
  return body[key].get<std::string>();
}

// user_metadata: an object of strings (the SDK reads it back as dict[str, str]), or null.
absl::StatusOr<Json> UserMetadata(const Json& body) {
  if (!Present(body, "user_metadata")) return Json(nullptr);
  const Json& m = body["user_metadata"];
  if (!m.is_object()) return absl::InvalidArgumentError("user_metadata: expected an object");
  for (const auto& [key, value] : m.items()) {
    if (!value.is_string()) {
      return absl::InvalidArgumentError(absl::StrCat("user_metadata.", key.substr(0, 64), ": expected a string"));
    }
  }
  return m;
}

// The fields every call on one model names.
absl::Status ModelAndSeq(const Json& body, std::string* model_id, int64_t* seq_id) {
  absl::StatusOr<std::string> id = GetString(body, "model_id");
  if (!id.ok()) return id.status();
  absl::StatusOr<int64_t> seq = GetInt(body, "seq_id", 0);
  if (!seq.ok()) return seq.status();
  *model_id = *std::move(id);
  *seq_id = *seq;
  return absl::OkStatus();
}

// A top-k width: absent or null = 0 (its range is TinkerApi's to check).
absl::StatusOr<int64_t> TopkWidth(const Json& body, const char* key) {
  if (!Present(body, key)) return 0;
  return GetInt(body, key, 0);
}

absl::StatusOr<SamplingParams> DecodeSamplingParams(const Json& body) {
  SamplingParams p;
  const Json sp = body.contains("sampling_params") && body["sampling_params"].is_object() ? body["sampling_params"]
                                                                                         : Json::object();
  absl::StatusOr<int64_t> max_tokens = GetInt(sp, "max_tokens", -1);
  absl::StatusOr<double> temperature = GetDouble(sp, "temperature", 1.0);
  absl::StatusOr<int64_t> top_k = GetInt(sp, "top_k", -1);
  absl::StatusOr<double> top_p = GetDouble(sp, "top_p", 1.0);
  for (const absl::Status& s : {max_tokens.status(), temperature.status(), top_k.status(), top_p.status()}) {
    if (!s.ok()) return s;
  }
  if (*max_tokens >= 0) p.max_tokens = *max_tokens;
  p.temperature = *temperature;
  p.top_k = *top_k;
  p.top_p = *top_p;
  if (Present(sp, "seed")) {
    absl::StatusOr<int64_t> seed = GetInt(sp, "seed", 0);
    if (!seed.ok()) return seed.status();
    p.seed = static_cast<uint64_t>(*seed);
  }
  if (!Present(sp, "stop")) return p;
  const Json& stop = sp["stop"];
  if (stop.is_string()) {
    p.stop_strings = std::vector<std::string>{stop.get<std::string>()};
    return p;
  }
  if (!stop.is_array()) return absl::InvalidArgumentError("sampling_params.stop: expected a string or a list");
  // Both set, even when empty: the SDK's stop=[] disables every stop, EOS included.
  p.stop_strings.emplace();
  p.stop_tokens.emplace();
  for (const Json& v : stop) {
    if (v.is_string()) {
      p.stop_strings->push_back(v.get<std::string>());
    } else if (v.is_number_integer()) {
      p.stop_tokens->push_back(v.get<int64_t>());
    } else {
      return absl::InvalidArgumentError("sampling_params.stop: expected strings or token ids");
    }
  }
  return p;
}

// target_prompt_logprobs (TensorData [len(prompt) - 1, K] of token ids, dense or CSR).
absl::StatusOr<std::optional<TargetPromptTokens>> DecodeTargetPromptTokens(const Json& body, size_t prompt_len) {
  if (!Present(body, "target_prompt_logprobs")) return std::nullopt;
  TargetPromptTokens layout;
  const Json& t = body["target_prompt_logprobs"];
  const char* kField = "target_prompt_logprobs";
  const Json* shape = t.is_object() && t.contains("shape") ? &t["shape"] : nullptr;
  if (!t.is_object() || !t.contains("data") || !t["data"].is_array() || shape == nullptr || !shape->is_array() ||
      shape->size() != 2 || !(*shape)[0].is_number_integer() || !(*shape)[1].is_number_integer()) {
    return absl::InvalidArgumentError(absl::StrCat(kField, ": expected TensorData with data and a 2-D shape"));
  }
  layout.rows = (*shape)[0].get<int64_t>();
  layout.width = (*shape)[1].get<int64_t>();
  const int64_t rows = static_cast<int64_t>(prompt_len) - 1;
  if (layout.rows != rows || layout.width < 1 || layout.width > ipc::kMaxPromptTargets) {
    return absl::InvalidArgumentError(absl::StrCat(kField, ": shape [", layout.rows, ", ", layout.width,
                                                   "] must be [", rows, ", K] (len(prompt) - 1 rows) with 1 <= K <= ",
                                                   ipc::kMaxPromptTargets));
  }
  std::vector<int64_t> values;
  for (const Json& v : t["data"]) {
    if (!v.is_number_integer()) return absl::InvalidArgumentError(absl::StrCat(kField, ".data: not token ids"));
    values.push_back(v.get<int64_t>());
  }
  const size_t cells = static_cast<size_t>(layout.rows * layout.width);
  if (Present(t, "sparse_crow_indices")) {
    layout.sparse = true;
    for (const char* key : {"sparse_crow_indices", "sparse_col_indices"}) {
      if (!t.contains(key) || !t[key].is_array()) {
        return absl::InvalidArgumentError(absl::StrCat(kField, ".", key, ": missing"));
      }
      for (const Json& v : t[key]) {
        if (!v.is_number_integer()) return absl::InvalidArgumentError(absl::StrCat(kField, ".", key, ": not integers"));
        (std::strcmp(key, "sparse_crow_indices") == 0 ? layout.crow : layout.col).push_back(v.get<int64_t>());
      }
    }
    const std::vector<int64_t>& crow = layout.crow;
    if (crow.size() != static_cast<size_t>(layout.rows) + 1 || crow.front() != 0 ||
        crow.back() != static_cast<int64_t>(values.size()) || layout.col.size() != values.size()) {
      return absl::InvalidArgumentError(absl::StrCat(kField, ": inconsistent CSR indices"));
    }
    layout.dense.assign(cells, -1);  // unlisted cells request nothing
    for (int64_t r = 0; r < layout.rows; ++r) {
      if (crow[r] > crow[r + 1]) return absl::InvalidArgumentError(absl::StrCat(kField, ": bad crow_indices"));
      for (int64_t j = crow[r]; j < crow[r + 1]; ++j) {
        if (layout.col[j] < 0 || layout.col[j] >= layout.width) {
          return absl::InvalidArgumentError(absl::StrCat(kField, ": bad col_indices"));
        }
        layout.dense[r * layout.width + layout.col[j]] = values[j];
      }
    }
  } else {
    if (values.size() != cells) {
      return absl::InvalidArgumentError(absl::StrCat(kField, ": ", values.size(), " ids for shape [", layout.rows, ", ",
                                                     layout.width, "]"));
    }
    layout.dense = std::move(values);
  }
  // The SDK's contract: at least one cell names a token id.
  if (std::none_of(layout.dense.begin(), layout.dense.end(), [](int64_t id) { return id != -1; })) {
    return absl::InvalidArgumentError(absl::StrCat(kField, ": names no token id (every cell is -1)"));
  }
  return layout;
}

}  // namespace

absl::StatusOr<CreateSessionRequest> DecodeCreateSession(const Json& body) {
  CreateSessionRequest r;
  if (Present(body, "tags")) {
    const Json& tags = body["tags"];
    if (!tags.is_array()) return absl::InvalidArgumentError("tags: expected a list of strings");
    r.tags.emplace();
    for (size_t i = 0; i < tags.size(); ++i) {
      if (!tags[i].is_string()) return absl::InvalidArgumentError(absl::StrCat("tags[", i, "]: expected a string"));
      r.tags->push_back(tags[i].get<std::string>());
    }
  }
  absl::StatusOr<Json> metadata = UserMetadata(body);
  if (!metadata.ok()) return metadata.status();
  r.user_metadata = *std::move(metadata);
  absl::StatusOr<std::optional<std::string>> project = OptionalString(body, "project_id");
  if (!project.ok()) return project.status();
  r.project_id = *std::move(project);
  absl::StatusOr<std::optional<std::string>> name = OptionalString(body, "display_name");
  if (!name.ok()) return name.status();
  r.display_name = *std::move(name);
  return r;
}

absl::StatusOr<SessionHeartbeatRequest> DecodeSessionHeartbeat(const Json& body) {
  absl::StatusOr<std::string> session = GetString(body, "session_id");
  if (!session.ok()) return session.status();
  return SessionHeartbeatRequest{*std::move(session)};
}

absl::StatusOr<CreateModelRequest> DecodeCreateModel(const Json& body) {
  CreateModelRequest r;
  absl::StatusOr<std::string> session = GetString(body, "session_id");
  if (!session.ok()) return session.status();
  r.session_id = *std::move(session);
  absl::StatusOr<int64_t> model_seq = GetInt(body, "model_seq_id", 0);
  if (!model_seq.ok()) return model_seq.status();
  r.model_seq_id = *model_seq;
  absl::StatusOr<std::string> base = GetString(body, "base_model");
  if (!base.ok()) return base.status();
  r.base_model = *std::move(base);
  const Json lora = body.contains("lora_config") && body["lora_config"].is_object() ? body["lora_config"] : Json::object();
  absl::StatusOr<int64_t> rank = GetInt(lora, "rank", 32);
  absl::StatusOr<int64_t> seed = GetInt(lora, "seed", 0);
  absl::StatusOr<bool> attn = GetBool(lora, "train_attn", true);
  absl::StatusOr<bool> mlp = GetBool(lora, "train_mlp", true);
  absl::StatusOr<bool> unembed = GetBool(lora, "train_unembed", true);
  for (const absl::Status& s : {rank.status(), seed.status(), attn.status(), mlp.status(), unembed.status()}) {
    if (!s.ok()) return s;
  }
  r.lora_config = LoraConfig{*rank, static_cast<uint64_t>(*seed), *attn, *mlp, *unembed};
  // Only the JSON form names an optimizer; Adam is the one there is.
  if (body.contains("optimizer_config") && body["optimizer_config"].is_object()) {
    const Json& opt = body["optimizer_config"];
    if (opt.contains("type") && opt["type"].is_string() && opt["type"] != "adamw" && opt["type"] != "adam") {
      return absl::InvalidArgumentError(absl::StrCat("optimizer_config.type: '", opt["type"].get<std::string>(),
                                                     "' is not supported (adamw)"));
    }
  }
  absl::StatusOr<Json> metadata = UserMetadata(body);
  if (!metadata.ok()) return metadata.status();
  r.user_metadata = *std::move(metadata);
  return r;
}

absl::StatusOr<ModelRequest> DecodeModelRequest(const Json& body) {
  absl::StatusOr<std::string> model_id = GetString(body, "model_id");
  if (!model_id.ok()) return model_id.status();
  return ModelRequest{*std::move(model_id)};
}

absl::StatusOr<OptimStepRequest> DecodeOptimStep(const Json& body) {
  OptimStepRequest r;
  if (absl::Status s = ModelAndSeq(body, &r.model_id, &r.seq_id); !s.ok()) return s;
  const Json* params = nullptr;
  for (const char* key : {"adam_params", "optim_params", "optimizer_params"}) {
    if (body.contains(key) && body[key].is_object()) {
      params = &body[key];
      break;
    }
  }
  if (params == nullptr) return r;
  if (params->contains("type") && (*params)["type"].is_string() && (*params)["type"] != "adam" &&
      (*params)["type"] != "adamw") {
    return absl::InvalidArgumentError(absl::StrCat("optimizer_params.type: '", (*params)["type"].get<std::string>(),
                                                   "' is not supported (adam)"));
  }
  AdamParams& a = r.adam_params;
  for (auto [key, value] : {std::pair{"learning_rate", &a.learning_rate}, std::pair{"beta1", &a.beta1},
                            std::pair{"beta2", &a.beta2}, std::pair{"eps", &a.eps},
                            std::pair{"weight_decay", &a.weight_decay}, std::pair{"grad_clip_norm", &a.grad_clip_norm}}) {
    absl::StatusOr<double> v = GetDouble(*params, key, *value);
    if (!v.ok()) return v.status();
    *value = *v;
  }
  return r;
}

absl::StatusOr<SaveWeightsRequest> DecodeSaveWeights(const Json& body) {
  SaveWeightsRequest r;
  if (absl::Status s = ModelAndSeq(body, &r.model_id, &r.seq_id); !s.ok()) return s;
  absl::StatusOr<std::string> path = GetString(body, "path");
  if (!path.ok()) return path.status();
  r.path = *std::move(path);
  r.overwrite = GetBool(body, "overwrite", false).value_or(false);
  absl::StatusOr<std::optional<int64_t>> ttl = GetTtl(body);
  if (!ttl.ok()) return ttl.status();
  r.ttl_seconds = *ttl;
  return r;
}

absl::StatusOr<LoadWeightsRequest> DecodeLoadWeights(const Json& body) {
  LoadWeightsRequest r;
  if (!Present(body, "model_id")) {
    // create_training_client_from_state: the model to create.
    absl::StatusOr<std::string> session = GetString(body, "session_id");
    if (!session.ok()) return session.status();
    r.session_id = *std::move(session);
    absl::StatusOr<int64_t> model_seq = GetInt(body, "model_seq_id", 0);
    if (!model_seq.ok()) return model_seq.status();
    r.model_seq_id = *model_seq;
  } else {
    r.model_id.emplace();
    if (absl::Status s = ModelAndSeq(body, &*r.model_id, &r.seq_id); !s.ok()) return s;
  }
  absl::StatusOr<std::string> path = GetString(body, "path");
  if (!path.ok()) return path.status();
  r.path = *std::move(path);
  r.optimizer = GetBool(body, "optimizer", false).value_or(false);
  return r;
}

absl::StatusOr<SaveWeightsForSamplerRequest> DecodeSaveWeightsForSampler(const Json& body) {
  SaveWeightsForSamplerRequest r;
  if (absl::Status s = ModelAndSeq(body, &r.model_id, &r.seq_id); !s.ok()) return s;
  absl::StatusOr<std::string> path = GetString(body, "path", "");
  if (!path.ok()) return path.status();
  r.path = *std::move(path);
  if (!r.path.empty()) {  // named: a checkpoint, which may expire
    absl::StatusOr<std::optional<int64_t>> ttl = GetTtl(body);
    if (!ttl.ok()) return ttl.status();
    r.ttl_seconds = *ttl;
    return r;
  }
  absl::StatusOr<int64_t> sampling_seq = GetInt(body, "sampling_session_seq_id", -1);
  if (!sampling_seq.ok()) return sampling_seq.status();
  r.sampling_session_seq_id = *sampling_seq;
  return r;
}

absl::StatusOr<WeightsInfoRequest> DecodeWeightsInfo(const Json& body) {
  absl::StatusOr<std::string> path = GetString(body, "tinker_path");
  if (!path.ok()) return path.status();
  return WeightsInfoRequest{*std::move(path)};
}

absl::StatusOr<CreateSamplingSessionRequest> DecodeCreateSamplingSession(const Json& body) {
  absl::StatusOr<std::string> session = GetString(body, "session_id", "");
  absl::StatusOr<int64_t> seq = GetInt(body, "sampling_session_seq_id", -1);
  absl::StatusOr<std::string> path = GetString(body, "model_path", "");
  absl::StatusOr<std::string> base = GetString(body, "base_model", "");
  for (const absl::Status& s : {session.status(), seq.status(), path.status(), base.status()}) {
    if (!s.ok()) return s;
  }
  return CreateSamplingSessionRequest{*std::move(session), *seq, *std::move(path), *std::move(base)};
}

absl::StatusOr<SampleRequest> DecodeSample(const Json& body) {
  SampleRequest r;
  absl::StatusOr<int64_t> num_samples = GetInt(body, "num_samples", 1);
  if (!num_samples.ok()) return num_samples.status();
  r.num_samples = *num_samples;
  r.prompt_logprobs = GetBool(body, "prompt_logprobs", false).value_or(false);
  absl::StatusOr<int64_t> topk_prompt = TopkWidth(body, "topk_prompt_logprobs");
  if (!topk_prompt.ok()) return topk_prompt.status();
  r.topk_prompt_logprobs = *topk_prompt;
  absl::StatusOr<int64_t> topk_sample = TopkWidth(body, "topk_sample_logprobs");
  if (!topk_sample.ok()) return topk_sample.status();
  r.topk_sample_logprobs = *topk_sample;
  absl::StatusOr<bool> record = GetBool(body, "record_stability_info", false);
  if (!record.ok()) return record.status();
  r.record_stability_info = *record;
  if (!body.contains("prompt")) return absl::InvalidArgumentError("prompt: missing");
  absl::StatusOr<std::vector<int64_t>> prompt = TokensFromModelInput(body["prompt"], "prompt");
  if (!prompt.ok()) return prompt.status();
  r.prompt = *std::move(prompt);
  if (Present(body, "prompt_logprobs_last_n")) {
    absl::StatusOr<int64_t> last_n = GetInt(body, "prompt_logprobs_last_n", 0);
    if (!last_n.ok()) return last_n.status();
    r.prompt_logprobs_last_n = *last_n;
  }
  absl::StatusOr<SamplingParams> params = DecodeSamplingParams(body);
  if (!params.ok()) return params.status();
  r.sampling_params = *std::move(params);
  absl::StatusOr<std::optional<TargetPromptTokens>> target = DecodeTargetPromptTokens(body, r.prompt.size());
  if (!target.ok()) return target.status();
  r.target_prompt_logprobs = *std::move(target);
  absl::StatusOr<int64_t> alt_k = GetInt(body, "prompt_alt_tokens_k", 0);
  if (!alt_k.ok()) return alt_k.status();
  r.prompt_alt_tokens_k = *alt_k;
  absl::StatusOr<std::string> session = GetString(body, "sampling_session_id", "");
  if (!session.ok()) return session.status();
  r.sampling_session_id = *std::move(session);
  if (r.sampling_session_id.empty()) {  // model_path only names the implicit session's model
    absl::StatusOr<std::string> path = GetString(body, "model_path", "");
    if (!path.ok()) return path.status();
    r.model_path = *std::move(path);
    // ... or the base model (several served: which one samples).
    absl::StatusOr<std::string> base = GetString(body, "base_model", "");
    if (!base.ok()) return base.status();
    r.base_model = *std::move(base);
  }
  absl::StatusOr<int64_t> seq = GetInt(body, "seq_id", -1);
  if (!seq.ok()) return seq.status();
  r.seq_id = *seq;
  return r;
}

absl::StatusOr<RetrieveFutureRequest> DecodeRetrieveFuture(const Json& body) {
  absl::StatusOr<std::string> request_id = GetString(body, "request_id");
  if (!request_id.ok()) return request_id.status();
  return RetrieveFutureRequest{*std::move(request_id)};
}

}  // namespace twinkle::tinker
