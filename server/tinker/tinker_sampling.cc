// TinkerApi: sampler saves, sampling sessions and asample, over core/sampling's
// SamplerCoordinator (sessions on the base model, on a checkpoint path, or on a live snapshot
// of a training adapter).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/storage/names.h"
#include "server/tinker/stored_result.h"
#include "server/tinker/tinker_api.h"
#include "server/tinker/tinker_internal.h"
#include "server/tinker/tinker_json.h"
#include "core/ipc/training_messages.h"
#include "core/sampling/sampler_coordinator.h"

namespace twinkle::tinker {
namespace {

}  // namespace

absl::StatusOr<FuturePromise> TinkerApi::SaveWeightsForSampler(const tenancy::Tenant& tenant,
                                                               const SaveWeightsForSamplerRequest& r) {
  absl::StatusOr<ModelCall> call = ModelCallOf(tenant, r.model_id, r.seq_id, r.path, /*path_required=*/false);
  if (!call.ok()) return call.status();
  const training::TenantContext context = ContextOf(tenant);
  const std::string run_id = call->model_id;
  if (!call->name.empty()) {
    // Named: a sampler_weights checkpoint (adapter weights only).
    Submit submit = [context, stack = call->model->stack, adapter = call->model->adapter, name = call->name,
                     ttl = r.ttl_seconds]() {
      training::SaveArgs args;
      args.name = name;
      args.save_optimizer = false;
      args.is_sampler = true;
      args.ttl_seconds = ttl;
      return stack->coordinator().SubmitSave(context, adapter, args);
    };
    Encoder encode = [run_id, name = call->name](const FutureValue&) {
      return Outcome::Of(OpResult::OfPath("save_weights_for_sampler",
                                          absl::StrCat("tinker://", run_id, "/sampler_weights/", name)));
    };
    return Sequenced(tenant, call->model, call->seq, {"save_weights_for_sampler", FingerprintOf(call->name)},
                     std::move(submit), std::move(encode));
  }
  // Unnamed: a live snapshot in the adapter's queue and a sampling session on it. Its
  // fingerprint is the (empty) name: the SDK changes sampling_session_seq_id on each retry of
  // one call, so that is not part of it.
  const uint64_t fingerprint = FingerprintOf(std::string_view());
  // The sampling session belongs to the model's session: released when that one finishes.
  Submit submit = [context, stack = call->model->stack, adapter = call->model->adapter,
                   owner = call->model->session_id, seq = call->seq, fingerprint]() {
    training::SubmitOptions options;
    options.idempotency_key = seq > 0 ? absl::StrCat("tinker-seq-", seq) : "";
    options.fingerprint = fingerprint;
    return stack->sampler().SubmitSnapshotSession(context, adapter, options, owner);
  };
  Encoder encode = [](const FutureValue& value) {
    absl::StatusOr<const sampling::SnapshotSession*> session = ValueAs<sampling::SnapshotSession>(value, "sampling session");
    if (!session.ok()) return Outcome::Failed(session.status());
    return Outcome::Of(OpResult::OfSamplingSession("save_weights_for_sampler", (*session)->sampling_session_id));
  };
  return Sequenced(tenant, call->model, call->seq, {"save_weights_for_sampler", fingerprint}, std::move(submit),
                   std::move(encode));
}

absl::StatusOr<CreateSamplingSessionResult> TinkerApi::CreateSamplingSession(const tenancy::Tenant& tenant,
                                                                             const CreateSamplingSessionRequest& r) {
  absl::StatusOr<ModelStack*> stack = SamplingStack(tenant, r.base_model, r.model_path);
  if (!stack.ok()) return stack.status();
  const int64_t seq = r.sampling_session_seq_id;
  const std::string key = absl::StrCat("sampling_session\n", tenant.id, "\n", r.session_id, "\n", seq);
  if (seq >= 0) {
    absl::MutexLock lock(&mu_);
    auto it = direct_dedupe_.find(key);
    if (it != direct_dedupe_.end()) return it->second.reply;
  }
  // Owned by the caller's session when it names a live one: released when that one finishes.
  const std::string owner = served_.SessionAlive(tenant.id, r.session_id) ? r.session_id : "";
  absl::StatusOr<std::string> id =
      (*stack)->sampler().CreateSession(ContextOf(tenant), InternalPath(r.model_path), owner);
  if (!id.ok()) return id.status();
  CreateSamplingSessionResult reply{*id};
  if (seq >= 0) {
    absl::MutexLock lock(&mu_);
    direct_dedupe_[key] = DirectAnswer{tenant, *id, reply};
  }
  return reply;
}

absl::StatusOr<Json> TinkerApi::GetSampler(const tenancy::Tenant& tenant, const std::string& sampler_id) {
  ModelStack* stack = served_.OfSamplingSession(tenant.id, sampler_id);
  if (stack == nullptr) stack = &served_.primary();  // its sampler says why the session is not there
  absl::StatusOr<sampling::SamplingSessionInfo> info = stack->sampler().GetSession(ContextOf(tenant), sampler_id);
  if (!info.ok()) return info.status();
  Json path = nullptr;
  if (absl::StartsWith(info->model_path, "tinker://") || absl::StartsWith(info->model_path, "twinkle://")) {
    // Back to the caller's form: tinker://<model_id>/...
    const size_t start = info->model_path.find("://") + 3;
    const size_t slash = info->model_path.find('/', start);
    path = slash == std::string::npos ? info->model_path
                                      : TinkerPathOf(info->model_path.substr(start, slash - start),
                                                     info->model_path.substr(slash + 1));
  }
  return Json{{"sampler_id", info->id}, {"base_model", info->base_model.empty() ? stack->name() : info->base_model},
              {"model_path", path}};
}

namespace {

// A float32 tensor in the layout the request used (dense [rows, width], or CSR with its
// indices), as protobuf and as JSON TensorData.
void EncodeTargetLogprobs(const std::vector<float>& dense, const TargetPromptTokens& layout, v1::Tensor* proto,
                          Json* json) {
  proto->set_dtype(v1::DTYPE_FLOAT32);
  proto->add_shape(layout.rows);
  proto->add_shape(layout.width);
  *json = {{"dtype", "float32"}, {"shape", {layout.rows, layout.width}}};
  if (!layout.sparse) {
    proto->set_dense(std::string(reinterpret_cast<const char*>(dense.data()), dense.size() * sizeof(float)));
    (*json)["data"] = FiniteOrNull(dense);
    return;
  }
  std::vector<float> values;
  for (int64_t r = 0; r < layout.rows; ++r) {
    for (int64_t j = layout.crow[r]; j < layout.crow[r + 1]; ++j) values.push_back(dense[r * layout.width + layout.col[j]]);
  }
  v1::SparseCsr* csr = proto->mutable_sparse_csr();
  csr->set_values(std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float)));
  csr->set_crow_indices(std::string(reinterpret_cast<const char*>(layout.crow.data()), layout.crow.size() * 8));
  csr->set_col_indices(std::string(reinterpret_cast<const char*>(layout.col.data()), layout.col.size() * 8));
  (*json)["data"] = FiniteOrNull(values);
  (*json)["sparse_crow_indices"] = layout.crow;
  (*json)["sparse_col_indices"] = layout.col;
}

// What the SDK reads as an empty top-k cell (tinker.types.topk_logprobs.MASK_LOGPROB).
constexpr int32_t kMaskTokenId = 0;
constexpr float kMaskLogprob = -99999.0f;

// Tinker's TopkLogprobs (row-major positions x k, int32 ids, float32 logprobs) and its JSON
// form (per position a list of [token_id, logprob], null for a position without one). The
// positions before `first_scored` (a prompt's first, which nothing predicts, and those
// prompt_logprobs_last_n leaves out) are all mask cells, which the SDK turns into None.
void EncodeTop(const sampling::TopLogprobs& top, v1::TopkLogprobs* proto, Json* json, size_t first_scored = 0) {
  const size_t k = static_cast<size_t>(top.k), n = top.positions();
  std::vector<int32_t> ids(n * k, kMaskTokenId);
  std::vector<float> lps(n * k, kMaskLogprob);
  *json = Json::array();
  for (size_t i = 0; i < n; ++i) {
    if (i < first_scored) {
      json->push_back(nullptr);
      continue;
    }
    Json row = Json::array();
    for (size_t j = i * k; j < (i + 1) * k; ++j) {
      ids[j] = static_cast<int32_t>(top.token_ids[j]);
      lps[j] = top.logprobs[j];
      row.push_back({top.token_ids[j], std::isfinite(top.logprobs[j]) ? Json(top.logprobs[j]) : Json(nullptr)});
    }
    json->push_back(std::move(row));
  }
  proto->set_token_ids(std::string(reinterpret_cast<const char*>(ids.data()), ids.size() * sizeof(int32_t)));
  proto->set_logprobs(std::string(reinterpret_cast<const char*>(lps.data()), lps.size() * sizeof(float)));
  proto->set_k(static_cast<uint32_t>(k));
  proto->set_length(static_cast<uint32_t>(n));
}

// SampleResponse for one prompt, as protobuf and as JSON. Prompt positions before
// `first_scored` (>= 1: position 0 has no context) get no prompt log-probs.
Outcome EncodeSample(const sampling::PromptOutput& p, bool want_prompt_logprobs, size_t first_scored,
                     const TargetPromptTokens* target, int64_t alt_k) {
  Outcome o;
  v1::SampleResponse proto;
  Json sequences = Json::array();
  for (const sampling::SampledSequence& s : p.sequences) {
    v1::SampledSequence* seq = proto.add_sequences();
    seq->set_stop_reason(s.stop_reason == "stop" ? v1::STOP_REASON_STOP : v1::STOP_REASON_LENGTH);
    std::vector<int32_t> tokens(s.tokens.begin(), s.tokens.end());
    seq->set_tokens(std::string(reinterpret_cast<const char*>(tokens.data()), tokens.size() * sizeof(int32_t)));
    seq->set_logprobs(
        std::string(reinterpret_cast<const char*>(s.logprobs.data()), s.logprobs.size() * sizeof(float)));
    Json json = {{"tokens", s.tokens}, {"logprobs", FiniteOrNull(s.logprobs)}, {"stop_reason", s.stop_reason}};
    if (s.top_logprobs.k > 0) EncodeTop(s.top_logprobs, seq->mutable_topk_sampled_logprobs(), &json["topk_logprobs"]);
    sequences.push_back(std::move(json));
  }
  Json prompt_logprobs = nullptr;
  if (want_prompt_logprobs) {
    std::vector<float> lp = p.prompt_logprobs;
    std::fill(lp.begin(), lp.begin() + static_cast<std::ptrdiff_t>(std::min(first_scored, lp.size())),
              std::numeric_limits<float>::quiet_NaN());
    proto.set_prompt_logprobs(std::string(reinterpret_cast<const char*>(lp.data()), lp.size() * sizeof(float)));
    prompt_logprobs = FiniteOrNull(lp);
  }
  Json topk_prompt_logprobs = nullptr;
  if (p.prompt_top_logprobs.k > 0) {
    EncodeTop(p.prompt_top_logprobs, proto.mutable_topk_prompt_logprobs(), &topk_prompt_logprobs, first_scored);
  }
  Json target_prompt_logprobs = nullptr;
  if (target != nullptr) {
    EncodeTargetLogprobs(p.target_prompt_logprobs, *target, proto.mutable_target_prompt_logprobs(),
                         &target_prompt_logprobs);
  }
  Json prompt_alt_tokens = nullptr;
  if (alt_k > 0) {
    const int64_t rows = static_cast<int64_t>(p.prompt_alt_token_ids.size()) / alt_k;
    v1::PromptAltTokens* alt = proto.mutable_prompt_alt_tokens();
    v1::Tensor* ids = alt->mutable_tokens();
    ids->set_dtype(v1::DTYPE_INT64);
    ids->add_shape(rows);
    ids->add_shape(alt_k);
    ids->set_dense(std::string(reinterpret_cast<const char*>(p.prompt_alt_token_ids.data()),
                               p.prompt_alt_token_ids.size() * sizeof(int64_t)));
    v1::Tensor* lps = alt->mutable_logprobs();
    lps->set_dtype(v1::DTYPE_FLOAT32);
    lps->add_shape(rows);
    lps->add_shape(alt_k);
    lps->set_dense(std::string(reinterpret_cast<const char*>(p.prompt_alt_logprobs.data()),
                               p.prompt_alt_logprobs.size() * sizeof(float)));
    prompt_alt_tokens = {
        {"tokens", {{"data", p.prompt_alt_token_ids}, {"dtype", "int64"}, {"shape", {rows, alt_k}}}},
        {"logprobs", {{"data", FiniteOrNull(p.prompt_alt_logprobs)}, {"dtype", "float32"}, {"shape", {rows, alt_k}}}}};
  }
  o.proto = StoredProto(std::move(proto));
  o.json = {{"type", "sample"},
            {"sequences", std::move(sequences)},
            {"prompt_logprobs", std::move(prompt_logprobs)},
            {"topk_prompt_logprobs", std::move(topk_prompt_logprobs)},
            {"target_prompt_logprobs", std::move(target_prompt_logprobs)},
            {"prompt_alt_tokens", std::move(prompt_alt_tokens)}};
  return o;
}

// The encoder of an asample result (both encodings). With record_stability_info, each
// sequence is also kept under its sequence id, for stable_reinforce.
std::function<Outcome(const FutureValue&)> SampleEncoder(std::shared_ptr<StabilityStore> store,
                                                         const SampleRequest& r, size_t first_scored,
                                                         std::string tenant_id,
                                                         std::vector<std::string> sequence_ids) {
  std::shared_ptr<const std::vector<int64_t>> recorded_prompt;
  if (r.record_stability_info) recorded_prompt = std::make_shared<const std::vector<int64_t>>(r.prompt);
  return [store = std::move(store), want_prompt_lp = r.prompt_logprobs, first_scored, recorded_prompt,
          target = r.target_prompt_logprobs, alt_k = r.prompt_alt_tokens_k, tenant_id = std::move(tenant_id),
          sequence_ids = std::move(sequence_ids)](const FutureValue& value) {
    absl::StatusOr<const sampling::SampleOutput*> out = ValueAs<sampling::SampleOutput>(value, "sampling result");
    if (!out.ok()) return Outcome::Failed(out.status());
    if ((*out)->prompts.empty()) return Outcome::Failed(absl::InternalError("sampler returned no result"));
    const sampling::PromptOutput& p = (*out)->prompts[0];
    if (recorded_prompt != nullptr) {
      const absl::Time now = absl::Now();
      for (size_t i = 0; i < p.sequences.size() && i < sequence_ids.size(); ++i) {
        store->Record(tenant_id, sequence_ids[i], recorded_prompt, p.sequences[i].tokens, p.sequences[i].logprobs,
                      now);
      }
    }
    return EncodeSample(p, want_prompt_lp, first_scored, target ? &*target : nullptr, alt_k);
  };
}

// A top-k width: in [0, ipc::kMaxTopLogprobs]. (The sampler also caps it at the vocabulary,
// which only matters for toy models.)
absl::Status CheckTopk(int64_t k, const char* field) {
  if (k < 0 || k > ipc::kMaxTopLogprobs) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", k, " must be in [0, ", ipc::kMaxTopLogprobs, "]"));
  }
  return absl::OkStatus();
}

// The sampler's parameters for a request whose values have been checked.
sampling::SamplingParams ParamsOf(const SampleRequest& r) {
  sampling::SamplingParams p;
  const SamplingParams& sp = r.sampling_params;
  if (sp.max_tokens && *sp.max_tokens >= 0) p.max_tokens = *sp.max_tokens;
  p.temperature = sp.temperature;
  p.top_k = sp.top_k < 0 ? 0 : sp.top_k;
  p.top_p = sp.top_p;
  if (sp.seed) p.seed = *sp.seed;
  // The SDK (0.38 SamplingParams.stop): None keeps the implicit EOS stop, [] disables every
  // stop token including EOS (generation runs to max_tokens); a non-empty list adds its
  // strings or token ids to EOS.
  if (sp.stop_strings) p.stop_strings = *sp.stop_strings;
  if (sp.stop_tokens) p.stop_token_ids = *sp.stop_tokens;
  if ((sp.stop_strings || sp.stop_tokens) && p.stop_strings.empty() && p.stop_token_ids.empty()) p.ignore_eos = true;
  p.num_samples = r.num_samples;
  p.prompt_logprobs = r.prompt_logprobs;
  p.prompt_top_logprobs = r.topk_prompt_logprobs;
  p.top_logprobs = r.topk_sample_logprobs;
  if (r.target_prompt_logprobs) {
    p.target_prompt_tokens = r.target_prompt_logprobs->dense;
    p.target_prompt_width = r.target_prompt_logprobs->width;
  }
  p.prompt_alt_tokens_k = r.prompt_alt_tokens_k;
  return p;
}

// The values of an asample request: counts and widths in range. Returns the first prompt
// position that is scored (>= 1: position 0 has no context).
absl::StatusOr<size_t> CheckSample(const SampleRequest& r) {
  if (r.num_samples < 1) return absl::InvalidArgumentError("num_samples: must be at least 1");
  if (absl::Status s = CheckTopk(r.topk_prompt_logprobs, "topk_prompt_logprobs"); !s.ok()) return s;
  if (absl::Status s = CheckTopk(r.topk_sample_logprobs, "topk_sample_logprobs"); !s.ok()) return s;
  // prompt_logprobs_last_n: only the last n prompt positions are scored (1 <= n <= P - 1).
  size_t first_scored = 1;
  if (r.prompt_logprobs_last_n) {
    const int64_t last_n = *r.prompt_logprobs_last_n;
    const int64_t scorable = static_cast<int64_t>(r.prompt.size()) - 1;
    if (!r.prompt_logprobs && r.topk_prompt_logprobs == 0) {
      return absl::InvalidArgumentError("prompt_logprobs_last_n: applies to prompt logprobs; set prompt_logprobs");
    }
    if (last_n < 1 || last_n > scorable) {
      return absl::InvalidArgumentError(absl::StrCat("prompt_logprobs_last_n: ", last_n, " must be in [1, ", scorable,
                                                     "] (the prompt has ", r.prompt.size(), " tokens)"));
    }
    first_scored = static_cast<size_t>(scorable - last_n + 1);
  }
  if (r.prompt_alt_tokens_k < 0 || r.prompt_alt_tokens_k > ipc::kMaxPromptTargets) {
    return absl::InvalidArgumentError(absl::StrCat("prompt_alt_tokens_k: ", r.prompt_alt_tokens_k, " must be in [0, ",
                                                   ipc::kMaxPromptTargets, "]"));
  }
  return first_scored;
}

}  // namespace

absl::StatusOr<FuturePromise> TinkerApi::Sample(const tenancy::Tenant& tenant, const SampleRequest& r) {
  absl::StatusOr<size_t> first_scored = CheckSample(r);
  if (!first_scored.ok()) return first_scored.status();
  const sampling::SamplingParams params = ParamsOf(r);
  const training::TenantContext context = ContextOf(tenant);
  // seq_ids are per sampling client: only a named session dedupes by them (the implicit
  // session is shared by every session-less caller of the tenant).
  std::string session = r.sampling_session_id;
  int64_t seq = r.seq_id;
  // A named session samples on the model it was opened on; a session-less call on the base
  // model it names (or the model path's).
  ModelStack* stack = session.empty() ? nullptr : served_.OfSamplingSession(tenant.id, session);
  if (session.empty()) {
    absl::StatusOr<ModelStack*> named = SamplingStack(tenant, r.base_model, r.model_path);
    if (!named.ok()) return named.status();
    stack = *named;
  } else if (stack == nullptr) {
    stack = &served_.primary();  // its sampler says why the session is not there
  }
  sampling::SamplerCoordinator* const sampler = &stack->sampler();
  if (session.empty()) {
    // Session-less: the tenant's one implicit session on model_path (or the base model).
    absl::StatusOr<std::string> id = sampler->ImplicitSession(context, InternalPath(r.model_path));
    if (!id.ok()) return id.status();
    session = *id;
    seq = -1;
  }
  const std::string key = absl::StrCat("asample\n", tenant.id, "\n", session, "\n", seq);
  if (seq >= 0) {
    absl::MutexLock lock(&mu_);
    auto d = dedupe_.find(key);
    if (d != dedupe_.end()) {
      auto e = entries_.find(d->second);
      if (e != entries_.end()) return Promise(*e->second);
    }
  }
  // Sampling is charged to the tenant's token rate like training (429 with Retry-After).
  const int64_t tokens = sampler->TokensOf({r.prompt}, params);
  if (rate_limiter_ != nullptr) {
    if (absl::Status s = rate_limiter_->Acquire(tenant, tokens); !s.ok()) return s;
  }
  training::SubmitOptions options;
  absl::StatusOr<uint64_t> id = sampler->SubmitSample(context, session, {r.prompt}, params, options);
  if (!id.ok() && rate_limiter_ != nullptr) rate_limiter_->Refund(tenant, tokens);
  if (!id.ok()) return id.status();  // 429 on overload: only accepted submissions are remembered
  std::shared_ptr<Entry> entry = NewEntry(tenant.id, "");
  for (int64_t i = 0; i < r.num_samples; ++i) {
    entry->sample_sequence_ids.push_back(absl::StrCat(entry->request_id, ":", i));
  }
  Attach(entry, *id, SampleEncoder(stability_, r, *first_scored, tenant.id, entry->sample_sequence_ids));
  if (seq >= 0) {
    absl::MutexLock lock(&mu_);
    dedupe_[key] = entry->request_id;
  }
  return Promise(*entry);
}

}  // namespace twinkle::tinker

namespace twinkle::tinker {

absl::StatusOr<ModelStack*> TinkerApi::SamplingStack(const tenancy::Tenant& tenant, const std::string& base_model,
                                                     const std::string& model_path) {
  if (!model_path.empty()) {
    // A checkpoint samples on the model its run was trained on.
    return &served_.ForCheckpoint(tenant.id, InternalPath(model_path));
  }
  return served_.ForBaseModel(base_model);
}

int64_t TinkerApi::QueuedFor(const std::string& tenant) const {
  int64_t queued = 0;
  for (ModelStack* stack : served_.stacks()) queued += stack->coordinator().scheduler().queued_for_tenant(tenant);
  return queued;
}

}  // namespace twinkle::tinker
