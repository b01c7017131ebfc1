#include "core/sampling/sampler_coordinator.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "core/common/log.h"
#include "core/ipc/training_messages.h"
#include "core/scheduler/op.h"

namespace twinkle::sampling {
namespace {

constexpr char kLog[] = "sampler";

// A top-k pair from a sample_step reply: int64 ids and float32 logprobs, both [n, k].
absl::StatusOr<TopLogprobs> ReadTop(const std::optional<ipc::TensorDesc>& ids,
                                    const std::optional<ipc::TensorDesc>& lps, int64_t k,
                                    const std::vector<std::string>& buffers) {
  if (!ids || !lps) return absl::InternalError("sample_step reply: top-k logprobs asked for but missing");
  absl::StatusOr<std::vector<int64_t>> token_ids = ipc::ReadVectorFrame<int64_t>(*ids, buffers, "sample_step reply");
  if (!token_ids.ok()) return token_ids.status();
  absl::StatusOr<std::vector<float>> logprobs = ipc::ReadVectorFrame<float>(*lps, buffers, "sample_step reply");
  if (!logprobs.ok()) return logprobs.status();
  if (token_ids->size() != logprobs->size() || token_ids->size() % static_cast<size_t>(k) != 0) {
    return absl::InternalError(absl::StrCat("sample_step reply: top-k of ", token_ids->size(), " ids and ",
                                            logprobs->size(), " logprobs is not [n, ", k, "]"));
  }
  return TopLogprobs{k, *std::move(token_ids), *std::move(logprobs)};
}

std::optional<TokenText> LoadTokenText(const std::string& model_dir) {
  if (model_dir.empty()) return std::nullopt;
  const std::filesystem::path path = std::filesystem::path(model_dir) / "tokenizer.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    LogWarning(kLog, absl::StrCat("no ", path.string(), ": stop strings are refused"));
    return std::nullopt;
  }
  std::stringstream contents;
  contents << in.rdbuf();
  absl::StatusOr<TokenText> text = TokenText::FromTokenizerJson(contents.str());
  if (!text.ok()) {
    LogWarning(kLog, absl::StrCat(path.string(), ": ", text.status().message(), "; stop strings are refused"));
    return std::nullopt;
  }
  return *std::move(text);
}

// The model's end-of-sequence ids: generation_config.json's eos_token_id (what transformers'
// generate stops on), else config.json's; an int or a list.
std::vector<int64_t> LoadEosTokenIds(const std::string& model_dir) {
  for (const char* name : {"generation_config.json", "config.json"}) {
    std::ifstream in(std::filesystem::path(model_dir) / name);
    if (!in) continue;
    nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || !j.contains("eos_token_id")) continue;
    const nlohmann::json& eos = j["eos_token_id"];
    std::vector<int64_t> ids;
    if (eos.is_number_integer()) ids.push_back(eos.get<int64_t>());
    if (eos.is_array()) {
      for (const nlohmann::json& e : eos) {
        if (e.is_number_integer()) ids.push_back(e.get<int64_t>());
      }
    }
    return ids;
  }
  return {};
}

}  // namespace

// An immutable copy of adapter weights, on the engine as adapter `engine_id` once the
// decode thread put it there (again after an engine restart).
struct SamplerCoordinator::Snapshot {
  std::string engine_id;
  std::string tenant;
  std::string source;  // the checkpoint path, or "adapter <name>"
  training::TrainingCoordinator::CapturedWeights weights;
  uint64_t engine_generation = 0;  // decode thread: the engine generation it was created in; 0 = not yet
};

struct SamplerCoordinator::Session {
  std::string id;
  std::string tenant;
  std::string model_path;
  std::shared_ptr<Snapshot> snapshot;  // null: the base model
  absl::Time last_used;
};

// One SubmitSample call: its prompts run as engine rows; the future completes when the last
// row finished (or the first one failed).
struct SamplerCoordinator::Request {
  uint64_t future_id = 0;
  std::string tenant;
  std::shared_ptr<Snapshot> snapshot;
  std::vector<std::vector<int64_t>> prompts;
  SamplingParams params;
  SampleOutput output;
  size_t rows_left = 0;
  bool finished = false;  // guarded by the coordinator's mu_
};

struct SamplerCoordinator::Row {
  std::shared_ptr<Request> request;
  size_t prompt_index = 0;
  uint64_t engine_id = 0;
  // Rows with stop strings (decode thread only): each sample's tokens so far, from the
  // engine's progress reports, and whether it has been told to stop.
  std::vector<std::vector<int64_t>> partial;
  std::vector<bool> stop_sent;
};

SamplerCoordinator::SamplerCoordinator(SamplerOptions options, training::EngineLink& engine,
                                       training::TrainingCoordinator& training,
                                       training::CheckpointStore* checkpoints, FutureStore& futures,
                                       const Clock& clock)
    : options_(std::move(options)),
      engine_(engine),
      training_(training),
      checkpoints_(checkpoints),
      futures_(futures),
      clock_(clock),
      token_text_(LoadTokenText(options_.model_dir)),
      eos_token_ids_(options_.model_dir.empty() ? std::vector<int64_t>{} : LoadEosTokenIds(options_.model_dir)) {}

SamplerCoordinator::~SamplerCoordinator() { Stop(); }

void SamplerCoordinator::Start() {
  absl::MutexLock lock(&mu_);
  if (decode_thread_.joinable()) return;
  stop_ = false;
  decode_thread_ = std::thread([this] { DecodeLoop(); });
}

void SamplerCoordinator::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    wake_.SignalAll();
  }
  if (decode_thread_.joinable()) decode_thread_.join();
}

// ---- sessions and snapshots ------------------------------------------------------------------

absl::Status SamplerCoordinator::CheckSnapshotRoom() const {
  absl::MutexLock lock(&graveyard_->mu);
  if (graveyard_->live >= options_.max_snapshots) {
    return absl::ResourceExhaustedError(absl::StrCat("the server holds its maximum of ", options_.max_snapshots,
                                                     " sampler snapshots; close unused sampling sessions"));
  }
  return absl::OkStatus();
}

std::shared_ptr<SamplerCoordinator::Snapshot> SamplerCoordinator::NewSnapshot(
    const std::string& tenant, const std::string& source, training::TrainingCoordinator::CapturedWeights weights) {
  auto* snapshot = new Snapshot;
  snapshot->engine_id = absl::StrCat("snap:", next_snapshot_++);
  snapshot->tenant = tenant;
  snapshot->source = source;
  snapshot->weights = std::move(weights);
  snapshot->weights.config.adapter_id = snapshot->engine_id;
  snapshot->weights.config.dropout = 0;
  {
    absl::MutexLock lock(&graveyard_->mu);
    ++graveyard_->live;
  }
  // The last holder may let go on any thread, under any lock: only the graveyard is touched.
  return std::shared_ptr<Snapshot>(snapshot, [graveyard = graveyard_](Snapshot* s) {
    {
      absl::MutexLock lock(&graveyard->mu);
      --graveyard->live;
      if (s->engine_generation != 0) graveyard->engine_ids.push_back(s->engine_id);
    }
    delete s;
  });
}

absl::Status SamplerCoordinator::CheckSessionRoom(const std::string& tenant) const {
  int64_t mine = 0;
  for (const auto& [id, s] : sessions_) mine += s->tenant == tenant;
  if (mine >= options_.max_sessions_per_tenant) {
    return absl::FailedPreconditionError(absl::StrCat("you have ", mine, " sampling sessions, the limit is ",
                                                      options_.max_sessions_per_tenant, "; close some first"));
  }
  return absl::OkStatus();
}

std::string SamplerCoordinator::AddSession(const std::string& tenant, const std::string& model_path,
                                           std::shared_ptr<Snapshot> snapshot) {
  auto session = std::make_shared<Session>();
  session->id = absl::StrCat("sampler-", next_session_++);
  session->tenant = tenant;
  session->model_path = model_path;
  session->snapshot = std::move(snapshot);
  session->last_used = clock_.Now();
  sessions_[session->id] = session;
  return session->id;
}

absl::StatusOr<std::string> SamplerCoordinator::CreateSession(const TenantContext& tenant,
                                                              const std::string& model_path) {
  if (model_path.empty()) {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = CheckSessionRoom(tenant.id); !s.ok()) return s;
    return AddSession(tenant.id, "", nullptr);
  }
  if (checkpoints_ == nullptr) return absl::UnimplementedError("checkpoints are not configured");
  if (model_path.find("://") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model_path: '", model_path, "' is not a checkpoint path (twinkle://<run>/sampler_weights/<name>)"));
  }
  absl::StatusOr<registry::CheckpointRecord> record = checkpoints_->Resolve(tenant.id, model_path, "");
  if (!record.ok()) return record.status();
  const std::string source_key = absl::StrCat(tenant.id, "\n", record->path);
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = CheckSessionRoom(tenant.id); !s.ok()) return s;
    if (auto it = snapshots_by_source_.find(source_key); it != snapshots_by_source_.end()) {
      if (std::shared_ptr<Snapshot> shared = it->second.lock()) return AddSession(tenant.id, model_path, shared);
    }
  }
  if (absl::Status s = CheckSnapshotRoom(); !s.ok()) return s;
  // Read and verify the files outside the lock.
  absl::StatusOr<training::LoadedCheckpoint> loaded = checkpoints_->Load(*record, /*with_optimizer=*/false);
  if (!loaded.ok()) return loaded.status();
  training::TrainingCoordinator::CapturedWeights weights;
  weights.config.rank = loaded->lora.rank;
  weights.config.alpha = loaded->lora.alpha;
  weights.config.use_rslora = loaded->lora.use_rslora;
  weights.config.targets = loaded->lora.targets;
  weights.weights = std::move(loaded->weights);
  weights.buffers = std::move(loaded->buffers);
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckSessionRoom(tenant.id); !s.ok()) return s;
  std::shared_ptr<Snapshot> snapshot;
  if (auto it = snapshots_by_source_.find(source_key); it != snapshots_by_source_.end()) snapshot = it->second.lock();
  if (snapshot == nullptr) {
    snapshot = NewSnapshot(tenant.id, model_path, std::move(weights));
    snapshots_by_source_[source_key] = snapshot;
  }
  LogInfo(kLog, absl::StrCat("tenant ", tenant.id, ": sampling session on ", model_path));
  return AddSession(tenant.id, model_path, std::move(snapshot));
}

absl::StatusOr<uint64_t> SamplerCoordinator::SubmitSnapshotSession(const TenantContext& tenant,
                                                                   const std::string& adapter_name,
                                                                   const SubmitOptions& options) {
  if (absl::Status s = CheckSnapshotRoom(); !s.ok()) return s;
  const std::string tenant_id = tenant.id;
  return training_.SubmitWithWeights(
      tenant, adapter_name,
      [this, tenant_id, adapter_name](training::TrainingCoordinator::CapturedWeights weights)
          -> FutureResult {
        if (absl::Status s = CheckSnapshotRoom(); !s.ok()) return s;
        absl::MutexLock lock(&mu_);
        if (absl::Status s = CheckSessionRoom(tenant_id); !s.ok()) return s;
        std::shared_ptr<Snapshot> snapshot =
            NewSnapshot(tenant_id, absl::StrCat("adapter ", adapter_name), std::move(weights));
        return std::any(SnapshotSession{AddSession(tenant_id, "", std::move(snapshot))});
      },
      options);
}

absl::StatusOr<std::shared_ptr<SamplerCoordinator::Session>> SamplerCoordinator::FindSession(
    const TenantContext& tenant, const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second->tenant != tenant.id) {
    return absl::NotFoundError(absl::StrCat("sampling session '", id, "' not found"));
  }
  it->second->last_used = clock_.Now();
  return it->second;
}

absl::StatusOr<SamplingSessionInfo> SamplerCoordinator::GetSession(const TenantContext& tenant,
                                                                   const std::string& session_id) {
  absl::StatusOr<std::shared_ptr<Session>> session = FindSession(tenant, session_id);
  if (!session.ok()) return session.status();
  SamplingSessionInfo info;
  info.id = (*session)->id;
  info.base_model = options_.base_model;
  info.model_path = (*session)->model_path;
  return info;
}

absl::Status SamplerCoordinator::CloseSession(const TenantContext& tenant, const std::string& session_id) {
  std::shared_ptr<Session> closed;  // released after the lock
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end() || it->second->tenant != tenant.id) {
      return absl::NotFoundError(absl::StrCat("sampling session '", session_id, "' not found"));
    }
    closed = std::move(it->second);
    sessions_.erase(it);
    wake_.Signal();  // its snapshot may be freed now
  }
  // Its queue goes too (requests already handed to the decode thread still finish).
  training_.scheduler().DropAdapter(training::TrainingCoordinator::TaskQueue(tenant.id, "sampler/" + session_id),
                                    absl::CancelledError("the sampling session was closed"));
  return absl::OkStatus();
}

void SamplerCoordinator::Housekeep() {
  std::vector<std::shared_ptr<Session>> expired;
  absl::MutexLock lock(&mu_);
  const absl::Time cutoff = clock_.Now() - options_.session_timeout;
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    if (it->second->last_used < cutoff) {
      LogInfo(kLog, absl::StrCat("tenant ", it->second->tenant, ": sampling session ", it->first, " expired"));
      expired.push_back(std::move(it->second));
      it = sessions_.erase(it);
    } else {
      ++it;
    }
  }
  if (!expired.empty()) wake_.Signal();
}

SamplerStats SamplerCoordinator::stats() const {
  absl::MutexLock lock(&mu_);
  SamplerStats s = engine_stats_;
  s.sessions = static_cast<int64_t>(sessions_.size());
  s.waiting = static_cast<int64_t>(waiting_.size());
  s.running = static_cast<int64_t>(running_.size());
  absl::MutexLock dead(&graveyard_->mu);
  s.snapshots = graveyard_->live;
  return s;
}

// ---- submission ------------------------------------------------------------------------------

absl::StatusOr<uint64_t> SamplerCoordinator::SubmitSample(const TenantContext& tenant, const std::string& session_id,
                                                          std::vector<std::vector<int64_t>> prompts,
                                                          const SamplingParams& given, const SubmitOptions& options) {
  absl::StatusOr<std::shared_ptr<Session>> session = FindSession(tenant, session_id);
  if (!session.ok()) return session.status();
  SamplingParams params = given;
  if (params.max_tokens == 0) params.max_tokens = options_.default_max_tokens;
  if (params.max_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens: ", params.max_tokens, " must be at least 1"));
  }
  if (!std::isfinite(params.temperature) || params.temperature < 0) {
    return absl::InvalidArgumentError(absl::StrCat("temperature: ", params.temperature, " must be >= 0"));
  }
  if (params.top_p == 0) params.top_p = 1;
  if (!(params.top_p > 0 && params.top_p <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p: ", params.top_p, " must be in (0, 1]"));
  }
  if (params.num_samples == 0) params.num_samples = 1;
  if (params.num_samples < 0 || params.num_samples > options_.max_num_samples) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_samples: ", params.num_samples, " must be in [1, ", options_.max_num_samples, "]"));
  }
  if (prompts.empty()) return absl::InvalidArgumentError("prompts: empty; give at least one prompt");
  const int64_t vocab = engine_.vocab_size();
  const int64_t max_top = vocab > 0 ? std::min(vocab, ipc::kMaxTopLogprobs) : ipc::kMaxTopLogprobs;
  if (params.top_logprobs < 0 || params.top_logprobs > max_top) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_logprobs: ", params.top_logprobs, " must be in [0, ", max_top, "]"));
  }
  if (params.prompt_top_logprobs < 0 || params.prompt_top_logprobs > max_top) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt_top_logprobs: ", params.prompt_top_logprobs, " must be in [0, ", max_top, "]"));
  }
  const int64_t max_positions = engine_.max_position_embeddings();
  int64_t total_tokens = 0;
  for (size_t p = 0; p < prompts.size(); ++p) {
    const std::vector<int64_t>& prompt = prompts[p];
    if (prompt.empty()) return absl::InvalidArgumentError(absl::StrCat("prompts[", p, "]: empty"));
    for (size_t i = 0; i < prompt.size(); ++i) {
      if (prompt[i] < 0 || (vocab > 0 && prompt[i] >= vocab)) {
        return absl::InvalidArgumentError(
            absl::StrCat("prompts[", p, "].tokens[", i, "]: token id ", prompt[i], " outside [0, ", vocab, ")"));
      }
    }
    const int64_t length = static_cast<int64_t>(prompt.size()) + params.max_tokens;
    if (max_positions > 0 && length > max_positions) {
      return absl::InvalidArgumentError(absl::StrCat("prompts[", p, "]: ", prompt.size(), " prompt tokens + max_tokens ",
                                                     params.max_tokens, " = ", length,
                                                     " exceeds the model's max_position_embeddings ", max_positions));
    }
    total_tokens += length * params.num_samples;
  }
  if (total_tokens > tenant.max_tokens_per_request) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the request needs ", total_tokens, " tokens ((prompt + max_tokens) x num_samples, summed over prompts); "
        "the limit (max_tokens_per_request) is ", tenant.max_tokens_per_request));
  }
  for (size_t i = 0; i < params.stop_token_ids.size(); ++i) {
    if (params.stop_token_ids[i] < 0 || (vocab > 0 && params.stop_token_ids[i] >= vocab)) {
      return absl::InvalidArgumentError(absl::StrCat("stop_token_ids[", i, "]: token id ", params.stop_token_ids[i],
                                                     " outside [0, ", vocab, ")"));
    }
  }
  for (size_t i = 0; i < params.stop_strings.size(); ++i) {
    if (params.stop_strings[i].empty()) return absl::InvalidArgumentError(absl::StrCat("stop[", i, "]: empty string"));
  }
  if (!params.stop_strings.empty() && !token_text_) {
    return absl::FailedPreconditionError("stop: the model has no tokenizer.json, so stop strings cannot be matched; "
                                         "use stop token ids");
  }
  // An unseeded request gets its seed now, so a replay after an engine restart is exact.
  if (!params.seed) params.seed = absl::Uniform<uint64_t>(absl::BitGen());
  {
    absl::MutexLock lock(&mu_);
    const int64_t in_flight = in_flight_by_tenant_[tenant.id];
    if (in_flight + training_.scheduler().queued_for_tenant(tenant.id) >= tenant.max_pending_ops) {
      return absl::ResourceExhaustedError(absl::StrCat("you have ", in_flight,
                                                       " sampling requests in flight; your quota (max_pending_ops) is ",
                                                       tenant.max_pending_ops, "; wait for some to finish"));
    }
  }
  auto request = std::make_shared<Request>();
  request->tenant = tenant.id;
  request->snapshot = (*session)->snapshot;
  request->prompts = std::move(prompts);
  request->params = std::move(params);
  request->output.prompts.resize(request->prompts.size());
  request->rows_left = request->prompts.size();
  // A queue per session: requests of one session keep their order; sessions interleave.
  return training_.SubmitTask(tenant, "sampler/" + session_id, total_tokens,
                              [this, request](uint64_t op_id) -> FutureResult {
                                request->future_id = op_id;
                                Enqueue(request);
                                return std::any(sched::Deferred{});
                              },
                              options);
}

void SamplerCoordinator::Enqueue(std::shared_ptr<Request> request) {
  absl::MutexLock lock(&mu_);
  ++in_flight_by_tenant_[request->tenant];
  for (size_t i = 0; i < request->prompts.size(); ++i) {
    auto row = std::make_shared<Row>();
    row->request = request;
    row->prompt_index = i;
    row->engine_id = next_row_++;
    waiting_.push_back(std::move(row));
  }
  wake_.Signal();
}

// ---- the decode thread -----------------------------------------------------------------------

void SamplerCoordinator::Finish(Request& request, FutureResult result) {
  {
    absl::MutexLock lock(&mu_);
    if (request.finished) return;
    request.finished = true;
    if (--in_flight_by_tenant_[request.tenant] <= 0) in_flight_by_tenant_.erase(request.tenant);
    // Its other rows leave the engine's batch and the waiting line.
    for (auto it = running_.begin(); it != running_.end();) {
      if (it->second->request.get() == &request) {
        cancel_.push_back(it->first);
        it = running_.erase(it);
      } else {
        ++it;
      }
    }
    std::erase_if(waiting_, [&](const std::shared_ptr<Row>& r) { return r->request.get() == &request; });
  }
  request.snapshot.reset();
  futures_.Complete(request.future_id, std::move(result));
}

void SamplerCoordinator::Collect(Row& row, const ipc::SampleRowResultMsg& result,
                                 const std::vector<std::string>& buffers) {
  Request& request = *row.request;
  PromptOutput& out = request.output.prompts[row.prompt_index];
  for (const ipc::SampledSequenceMsg& s : result.samples) {
    absl::StatusOr<std::vector<int64_t>> tokens = ipc::ReadVectorFrame<int64_t>(s.tokens, buffers, "sample_step reply");
    absl::StatusOr<std::vector<float>> logprobs = ipc::ReadVectorFrame<float>(s.logprobs, buffers, "sample_step reply");
    if (!tokens.ok() || !logprobs.ok()) {
      Finish(request, tokens.ok() ? logprobs.status() : tokens.status());
      return;
    }
    SampledSequence seq{*std::move(tokens), *std::move(logprobs), s.stop_reason, {}};
    if (const int64_t k = request.params.top_logprobs; k > 0) {
      absl::StatusOr<TopLogprobs> top = ReadTop(s.top_token_ids, s.top_logprobs, k, buffers);
      if (!top.ok()) {
        Finish(request, top.status());
        return;
      }
      seq.top_logprobs = *std::move(top);
    }
    if (!request.params.stop_strings.empty() && token_text_) {
      if (std::optional<size_t> n = token_text_->TokensThroughFirstStop(seq.tokens, request.params.stop_strings)) {
        seq.tokens.resize(*n);
        seq.logprobs.resize(std::min(seq.logprobs.size(), *n));
        TopLogprobs& top = seq.top_logprobs;
        const size_t cells = std::min(top.token_ids.size(), *n * static_cast<size_t>(top.k));
        top.token_ids.resize(cells);
        top.logprobs.resize(cells);
        seq.stop_reason = "stop";
      }
    }
    out.sequences.push_back(std::move(seq));
  }
  if (request.params.prompt_logprobs) {
    out.prompt_logprobs.assign(1, std::numeric_limits<float>::quiet_NaN());
    if (result.prompt_logprobs) {
      absl::StatusOr<std::vector<float>> lp = ipc::ReadVectorFrame<float>(*result.prompt_logprobs, buffers, "sample_step reply");
      if (!lp.ok()) {
        Finish(request, lp.status());
        return;
      }
      out.prompt_logprobs.insert(out.prompt_logprobs.end(), lp->begin(), lp->end());
    }
  }
  if (const int64_t k = request.params.prompt_top_logprobs; k > 0) {
    absl::StatusOr<TopLogprobs> top = ReadTop(result.prompt_top_token_ids, result.prompt_top_logprobs, k, buffers);
    if (!top.ok()) {
      Finish(request, top.status());
      return;
    }
    // Position 0 has no distribution: it gets placeholder cells, so position i is prompt[i]'s.
    TopLogprobs& aligned = out.prompt_top_logprobs;
    aligned.k = k;
    aligned.token_ids.assign(k, -1);
    aligned.logprobs.assign(k, std::numeric_limits<float>::quiet_NaN());
    aligned.token_ids.insert(aligned.token_ids.end(), top->token_ids.begin(), top->token_ids.end());
    aligned.logprobs.insert(aligned.logprobs.end(), top->logprobs.begin(), top->logprobs.end());
  }
  bool done = false;
  {
    absl::MutexLock lock(&mu_);
    done = --request.rows_left == 0;
  }
  if (done) Finish(request, std::any(std::move(request.output)));
}

absl::Status SamplerCoordinator::EnsureOnEngine(Snapshot& snapshot) {
  if (snapshot.engine_generation != 0 && snapshot.engine_generation == generation_) return absl::OkStatus();
  absl::StatusOr<ipc::Message> created =
      engine_.Call(ipc::MakeRequest(ipc::kMethodCreateAdapter, ipc::Pack(snapshot.weights.config)));
  if (!created.ok()) return created.status();
  ipc::SetAdapterStateRequest set;
  set.adapter_id = snapshot.engine_id;
  set.weights = snapshot.weights.weights;
  absl::StatusOr<ipc::Message> r =
      engine_.Call(ipc::MakeRequest(ipc::kMethodSetAdapterState, ipc::Pack(set), snapshot.weights.buffers));
  if (!r.ok()) {
    (void)engine_.Call(ipc::MakeRequest(ipc::kMethodRemoveAdapter, ipc::Pack(ipc::AdapterRequest{snapshot.engine_id})));
    return r.status();
  }
  snapshot.engine_generation = generation_;
  return absl::OkStatus();
}

void SamplerCoordinator::RemoveDeadSnapshots() {
  std::vector<std::string> dead;
  {
    absl::MutexLock lock(&graveyard_->mu);
    dead.swap(graveyard_->engine_ids);
  }
  for (const std::string& id : dead) {
    absl::StatusOr<ipc::Message> r = engine_.Call(ipc::MakeRequest(ipc::kMethodRemoveAdapter, ipc::Pack(ipc::AdapterRequest{id})));
    if (!r.ok()) LogWarning(kLog, absl::StrCat("removing snapshot ", id, ": ", r.status().message()));
  }
}

void SamplerCoordinator::DecodeLoop() {
  while (true) {
    std::vector<std::shared_ptr<Row>> admit;
    std::vector<uint64_t> cancel;
    bool have_running = false;
    {
      absl::MutexLock lock(&mu_);
      while (!stop_ && waiting_.empty() && running_.empty() && cancel_.empty()) {
        // Wake now and then to free snapshots whose last session closed.
        wake_.WaitWithTimeout(&mu_, absl::Milliseconds(500));
        absl::MutexLock dead(&graveyard_->mu);
        if (!graveyard_->engine_ids.empty()) break;
      }
      if (stop_) break;
      admit.assign(waiting_.begin(), waiting_.end());
      cancel.swap(cancel_);
      have_running = !running_.empty();
    }
    // A new engine process holds neither snapshots nor running rows: rebuild, replay.
    const uint64_t gen = engine_.generation();
    if (gen != generation_) {
      if (generation_ != 0) LogWarning(kLog, "engine restarted: replaying the running sampling requests");
      generation_ = gen;
      reset_engine_ = true;
      early_stops_.clear();  // the replayed rows start over
      absl::MutexLock lock(&mu_);
      std::vector<std::shared_ptr<Row>> replay;
      for (auto& [id, row] : running_) replay.push_back(row);  // by engine id = arrival order
      running_.clear();
      waiting_.insert(waiting_.begin(), replay.begin(), replay.end());
      admit.assign(waiting_.begin(), waiting_.end());
      cancel.clear();
      have_running = false;
    }
    RemoveDeadSnapshots();
    if (admit.empty() && !have_running && cancel.empty()) continue;

    ipc::SampleStepRequest step;
    std::vector<std::string> buffers;
    step.reset = reset_engine_;
    step.cancel = std::move(cancel);
    for (const auto& [id, sample] : early_stops_) step.stop.push_back({id, sample});
    early_stops_.clear();
    step.max_decode_steps = options_.max_decode_steps_per_call;
    std::map<uint64_t, std::shared_ptr<Row>> admitted;
    for (const std::shared_ptr<Row>& row : admit) {
      Request& request = *row->request;
      if (request.snapshot != nullptr) {
        if (absl::Status s = EnsureOnEngine(*request.snapshot); !s.ok()) {
          Finish(request, absl::Status(s.code(), absl::StrCat("loading the sampler weights of ",
                                                              request.snapshot->source, ": ", s.message())));
          continue;
        }
      }
      {
        absl::MutexLock lock(&mu_);
        if (request.finished) continue;
      }
      ipc::SampleAdmitMsg msg;
      msg.request_id = row->engine_id;
      ipc::SampleRowMsg& r = msg.row;
      r.adapter_id = request.snapshot != nullptr ? request.snapshot->engine_id : "";
      r.prompt_tokens = ipc::AppendVectorFrame(request.prompts[row->prompt_index], buffers);
      r.max_tokens = request.params.max_tokens;
      r.temperature = request.params.temperature;
      r.top_p = request.params.top_p;
      r.top_k = request.params.top_k;
      r.stop_token_ids = request.params.stop_token_ids;
      if (!request.params.ignore_eos) {
        r.stop_token_ids.insert(r.stop_token_ids.end(), eos_token_ids_.begin(), eos_token_ids_.end());
      }
      r.seed = *request.params.seed + row->prompt_index;  // prompts of one request draw independently
      r.num_samples = request.params.num_samples;
      r.want_prompt_logprobs = request.params.prompt_logprobs;
      r.top_logprobs = request.params.top_logprobs;
      r.prompt_top_logprobs = request.params.prompt_top_logprobs;
      // Stop strings are matched on the decoded text as tokens arrive (the progress loop below);
      // the final result is cut again in Collect, so the early stop only saves decoding.
      r.report_tokens = !request.params.stop_strings.empty() && token_text_.has_value();
      if (r.report_tokens) {
        row->partial.assign(request.params.num_samples, {});
        row->stop_sent.assign(request.params.num_samples, false);
      }
      step.admit.push_back(std::move(msg));
      admitted.emplace(row->engine_id, row);
    }
    absl::StatusOr<ipc::Message> reply =
        engine_.Call(ipc::MakeRequest(ipc::kMethodSampleStep, ipc::Pack(step), std::move(buffers)));
    if (!reply.ok()) {
      if (engine_.generation() != generation_) continue;  // restarted under us: replay
      // The worker refused the call itself: fail what it carried, keep the rest.
      // While a worker is down every retry fails alike; log each distinct error once.
      if (reply.status().message() != last_step_error_) {
        last_step_error_ = std::string(reply.status().message());
        LogError(kLog, absl::StrCat("sample_step failed: ", last_step_error_));
      }
      for (auto& [id, row] : admitted) Finish(*row->request, reply.status());
      absl::SleepFor(absl::Milliseconds(50));
      continue;
    }
    reset_engine_ = false;
    last_step_error_.clear();
    absl::StatusOr<ipc::SampleStepReply> body = ipc::Unpack<ipc::SampleStepReply>(reply->envelope.body, "sample_step reply");
    if (!body.ok()) {
      LogError(kLog, std::string(body.status().message()));
      for (auto& [id, row] : admitted) Finish(*row->request, body.status());
      continue;
    }
    std::set<uint64_t> deferred(body->deferred.begin(), body->deferred.end());
    std::vector<std::pair<std::shared_ptr<Row>, std::string>> rejected;
    std::vector<std::pair<std::shared_ptr<Row>, const ipc::SampleRowResultMsg*>> finished;
    std::vector<std::pair<std::shared_ptr<Row>, const ipc::SampleProgressMsg*>> progress;
    {
      absl::MutexLock lock(&mu_);
      // Admitted rows leave the waiting line (deferred ones stay, in order).
      std::erase_if(waiting_, [&](const std::shared_ptr<Row>& r) {
        return admitted.count(r->engine_id) != 0 && deferred.count(r->engine_id) == 0;
      });
      for (const auto& [id, row] : admitted) {
        if (deferred.count(id) == 0 && !row->request->finished) running_[id] = row;
      }
      for (const ipc::SampleRejectedMsg& r : body->rejected) {
        if (auto it = running_.find(r.request_id); it != running_.end()) {
          rejected.emplace_back(it->second, r.error);
          running_.erase(it);
        }
      }
      for (const ipc::SampleFinishedMsg& f : body->finished) {
        if (auto it = running_.find(f.request_id); it != running_.end()) {
          finished.emplace_back(it->second, &f.result);
          running_.erase(it);
        }
      }
      for (const ipc::SampleProgressMsg& m : body->progress) {
        if (auto it = running_.find(m.request_id); it != running_.end()) progress.emplace_back(it->second, &m);
      }
      engine_stats_.blocks_in_use = body->blocks_in_use;
      engine_stats_.blocks_total = body->blocks_total;
      engine_stats_.block_size = body->block_size;
    }
    for (auto& [row, m] : progress) {
      const size_t sample = static_cast<size_t>(m->sample);
      if (sample >= row->partial.size() || row->stop_sent[sample]) continue;
      std::vector<int64_t>& tokens = row->partial[sample];
      tokens.insert(tokens.end(), m->tokens.begin(), m->tokens.end());
      if (token_text_->TokensThroughFirstStop(tokens, row->request->params.stop_strings)) {
        row->stop_sent[sample] = true;
        early_stops_.emplace_back(row->engine_id, m->sample);
      }
    }
    for (auto& [row, error] : rejected) Finish(*row->request, absl::InvalidArgumentError(error));
    int64_t generated = 0;
    for (auto& [row, result] : finished) {
      for (const ipc::SampledSequenceMsg& s : result->samples) {
        generated += s.tokens.shape.empty() ? 0 : s.tokens.shape[0];
      }
    }
    {
      // Counted before the futures complete, so a caller who has its result sees it counted.
      absl::MutexLock lock(&mu_);
      engine_stats_.tokens_generated += generated;
    }
    for (auto& [row, result] : finished) Collect(*row, *result, reply->buffers);
  }
  // Shutting down: nothing more will run.
  std::vector<std::shared_ptr<Request>> pending;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& row : waiting_) pending.push_back(row->request);
    for (const auto& [id, row] : running_) pending.push_back(row->request);
  }
  for (const auto& r : pending) Finish(*r, absl::UnavailableError("the server is shutting down"));
}

}  // namespace twinkle::sampling
