#include "server/tinker/tinker_api.h"

#include <any>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "core/common/log.h"
#include "core/storage/names.h"
#include "server/tinker/tinker_internal.h"
#include "server/tinker/tinker_json.h"

namespace twinkle::tinker {

using training::OpOutput;

namespace {
constexpr char kLog[] = "tinker";
constexpr double kLoraAlpha = 32;

// Transient refusals the SDK should retry with the same ids (nothing was accepted).
bool Transient(const absl::Status& s) {
  return absl::IsResourceExhausted(s) || absl::IsUnavailable(s);
}

// PEFT target modules for Tinker's three switches.
absl::StatusOr<std::vector<std::string>> Targets(bool attn, bool mlp, bool unembed) {
  std::vector<std::string> t;
  if (attn && mlp) {
    t.push_back("all-linear");
  } else if (attn) {
    t = {"q_proj", "k_proj", "v_proj", "o_proj"};
  } else if (mlp) {
    t = {"gate_proj", "up_proj", "down_proj"};
  }
  if (unembed) t.push_back("lm_head");
  if (t.empty()) {
    return absl::InvalidArgumentError(
        "lora_config: train_attn, train_mlp and train_unembed are all false (nothing to train)");
  }
  return t;
}

Switches SwitchesOf(const std::vector<std::string>& targets) {
  Switches s;
  for (const std::string& t : targets) {
    if (t == "all-linear") s.attn = s.mlp = true;
    if (t == "q_proj" || t == "k_proj" || t == "v_proj" || t == "o_proj") s.attn = true;
    if (t == "gate_proj" || t == "up_proj" || t == "down_proj") s.mlp = true;
    if (t == "lm_head") s.unembed = true;
  }
  return s;
}

const std::vector<std::string>& TinkerLosses() {
  static const auto* names =
      new std::vector<std::string>{"cross_entropy", "importance_sampling", "ppo", "cispo", "dro"};
  return *names;
}


// The forward_backward result: one ArrayRecord for all datums (logprobs and the per-token
// loss as float32 BatchedTensors) and the metrics, as protobuf and as ≤0.24 JSON.
Outcome EncodeForwardBackward(const OpOutput& out) {
  Outcome o;
  v1::ForwardBackwardOutput proto;
  proto.set_loss_fn_output_type("ArrayRecord");
  v1::ArrayRecord* record = proto.add_loss_fn_outputs();
  record->set_type_tag("ArrayRecord");
  record->set_num_datums(static_cast<int64_t>(out.sequences.size()));
  Json outputs = Json::array();
  for (const char* field : {"logprobs", "elementwise_loss"}) {
    const bool lp = std::strcmp(field, "logprobs") == 0;
    if (!lp && std::none_of(out.sequences.begin(), out.sequences.end(),
                            [](const training::SequenceResult& s) { return !s.loss.empty(); })) {
      continue;
    }
    v1::BatchedTensor& t = (*record->mutable_fields())[field];
    t.set_dtype(v1::DTYPE_FLOAT32);
    std::string data, offsets;
    int64_t offset = 0;
    offsets.append(reinterpret_cast<const char*>(&offset), sizeof(offset));
    for (const training::SequenceResult& s : out.sequences) {
      std::vector<float> values = lp ? s.logps : s.loss;
      if (!lp && values.size() != s.logps.size()) values.assign(s.logps.size(), 0.f);
      data.append(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
      offset = static_cast<int64_t>(data.size());
      offsets.append(reinterpret_cast<const char*>(&offset), sizeof(offset));
    }
    t.set_data(std::move(data));
    t.set_offsets(std::move(offsets));
  }
  for (const training::SequenceResult& s : out.sequences) {
    Json d;
    d["logprobs"] = {{"data", FiniteOrNull(s.logps)}, {"dtype", "float32"}, {"shape", {s.logps.size()}}};
    if (!s.loss.empty()) {
      d["elementwise_loss"] = {{"data", FiniteOrNull(s.loss)}, {"dtype", "float32"}, {"shape", {s.loss.size()}}};
    }
    outputs.push_back(std::move(d));
  }
  Json metrics = Json::object();
  // The SDK merges chunks by "name:reduction" keys: exactly one colon.
  for (const auto& [key, value] : out.metrics) {
    if (std::count(key.begin(), key.end(), ':') != 1 || !std::isfinite(value)) continue;
    (*proto.mutable_metrics())[key] = value;
    metrics[key] = value;
  }
  if (!metrics.contains("loss:sum") && std::isfinite(out.loss)) {
    (*proto.mutable_metrics())["loss:sum"] = out.loss;
    metrics["loss:sum"] = out.loss;
  }
  o.json = {{"loss_fn_output_type", "ArrayRecord"}, {"loss_fn_outputs", std::move(outputs)}, {"metrics", metrics}};
  o.proto = proto.SerializeAsString();
  return o;
}

}  // namespace

std::string ModelIdFor(const std::string& session_id, int64_t model_seq_id) {
  return absl::StrCat(session_id, ":train:", model_seq_id);
}

std::string AdapterNameFor(const std::string& session_id, int64_t model_seq_id) {
  return absl::StrCat(session_id, ".t", model_seq_id);
}

std::string RunIdOf(const std::string& model_id) {
  const size_t at = model_id.find(":train:");
  if (at == std::string::npos) return model_id;
  const std::string session = model_id.substr(0, at);
  int64_t seq = 0;
  if (!absl::SimpleAtoi(model_id.substr(at + 7), &seq) || seq < 0) return model_id;
  return absl::StrCat(session, "-", AdapterNameFor(session, seq));
}

std::string ModelIdOf(const std::string& run_id) {
  // "{S}-{S}.t{N}" with both S equal.
  const size_t dot = run_id.rfind(".t");
  if (dot == std::string::npos) return run_id;
  int64_t seq = 0;
  if (!absl::SimpleAtoi(run_id.substr(dot + 2), &seq) || seq < 0) return run_id;
  const std::string head = run_id.substr(0, dot);  // "{S}-{S}"
  if (head.size() % 2 == 0) return run_id;
  const size_t half = head.size() / 2;
  if (head[half] != '-' || head.compare(0, half, head, half + 1, half) != 0) return run_id;
  return ModelIdFor(head.substr(0, half), seq);
}

std::string InternalPath(const std::string& path) {
  const size_t scheme = path.find("://");
  if (scheme == std::string::npos) return path;
  const size_t start = scheme + 3;
  const size_t slash = path.find('/', start);
  const std::string id = path.substr(start, slash == std::string::npos ? std::string::npos : slash - start);
  return absl::StrCat(path.substr(0, start), RunIdOf(id), slash == std::string::npos ? "" : path.substr(slash));
}

std::string TinkerPathOf(const std::string& run_id, const std::string& checkpoint_id) {
  return absl::StrCat("tinker://", ModelIdOf(run_id), "/", checkpoint_id);
}

const char* ErrorCategory(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kCancelled:
      return "user";
    default:
      return "server";
  }
}

int HttpStatusFor(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk: return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kCancelled:
      return 400;
    case absl::StatusCode::kUnauthenticated: return 401;
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kFailedPrecondition:
      return 403;
    case absl::StatusCode::kNotFound: return 404;
    case absl::StatusCode::kResourceExhausted: return 429;
    case absl::StatusCode::kUnimplemented: return 501;
    case absl::StatusCode::kUnavailable: return 503;
    case absl::StatusCode::kDeadlineExceeded: return 504;
    default: return 500;
  }
}

Json Outcome::ToJson() const {
  if (!error.ok()) return {{"error", std::string(error.message())}, {"category", ErrorCategory(error)}};
  return json;
}

// ---- a thread for blocking calls and timers --------------------------------------------------

class TinkerApi::Worker {
 public:
  Worker() : thread_([this] { Loop(); }) {}
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void After(absl::Duration delay, std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.emplace(absl::Now() + delay, std::move(fn));
    }
    cv_.notify_all();
  }
  void Post(std::function<void()> fn) { After(absl::ZeroDuration(), std::move(fn)); }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      if (jobs_.empty()) {
        cv_.wait(lock);
        continue;
      }
      const absl::Time when = jobs_.begin()->first;
      const absl::Time now = absl::Now();
      if (when > now) {
        cv_.wait_for(lock, absl::ToChronoNanoseconds(when - now));
        continue;
      }
      std::function<void()> fn = std::move(jobs_.begin()->second);
      jobs_.erase(jobs_.begin());
      lock.unlock();
      fn();
      lock.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::multimap<absl::Time, std::function<void()>> jobs_;
  bool stop_ = false;
  std::thread thread_;
};

// ---- state -----------------------------------------------------------------------------------

TinkerApi::TinkerApi(TinkerOptions options, training::TrainingCoordinator& coordinator, FutureStore& futures,
                     registry::Registry* registry, training::CheckpointStore* checkpoints,
                     tenancy::TokenRateLimiter* rate_limiter, sampling::SamplerCoordinator* sampler)
    : options_(std::move(options)),
      coordinator_(coordinator),
      futures_(futures),
      registry_(registry),
      checkpoints_(checkpoints),
      rate_limiter_(rate_limiter),
      sampler_(sampler),
      blocking_(std::make_unique<Worker>()),
      timers_(std::make_unique<Worker>()),
      boot_([] {
        std::random_device rd;
        char buf[9];
        std::snprintf(buf, sizeof(buf), "%08x", rd());
        return std::string(buf);
      }()) {
  timers_->After(absl::Seconds(60), [this] { Housekeep(); });
}

TinkerApi::~TinkerApi() {
  // Workers first: their jobs touch the maps.
  timers_.reset();
  blocking_.reset();
}

void TinkerApi::Housekeep() {
  const absl::Time cutoff = absl::Now() - options_.retention;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = entries_.begin(); it != entries_.end();) {
      Entry& e = *it->second;
      absl::MutexLock entry_lock(&e.mu);
      if (e.outcome != nullptr && e.completed < cutoff) {
        entries_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  timers_->After(absl::Seconds(60), [this] { Housekeep(); });
}

std::shared_ptr<TinkerApi::Entry> TinkerApi::NewEntry(const std::string& tenant, const std::string& model_id) {
  auto e = std::make_shared<Entry>();
  e->request_id = absl::StrCat("tk-", boot_, "-", next_request_.fetch_add(1));
  e->tenant = tenant;
  e->model_id = model_id;
  absl::MutexLock lock(&mu_);
  entries_[e->request_id] = e;
  return e;
}

void TinkerApi::Complete(const std::shared_ptr<Entry>& entry, Outcome outcome) {
  auto shared = std::make_shared<const Outcome>(std::move(outcome));
  std::vector<std::function<void(std::shared_ptr<const Outcome>)>> waiters;
  {
    absl::MutexLock lock(&entry->mu);
    if (entry->outcome != nullptr) return;
    entry->outcome = shared;
    entry->completed = absl::Now();
    waiters.swap(entry->waiters);
  }
  for (auto& w : waiters) w(shared);
}

void TinkerApi::Attach(const std::shared_ptr<Entry>& entry, uint64_t future_id, Encoder encode) {
  absl::Status s = futures_.OnComplete(
      future_id, entry->tenant, [entry, encode = std::move(encode)](const FutureResult& result) {
        if (!result.ok()) {
          Complete(entry, Outcome::Failed(result.status()));
          return;
        }
        Complete(entry, encode(*result));
      });
  if (!s.ok()) Complete(entry, Outcome::Failed(s));
}

Json TinkerApi::Promise(const Entry& entry) const {
  Json j = {{"request_id", entry.request_id}};
  j["model_id"] = entry.model_id.empty() ? Json(nullptr) : Json(entry.model_id);
  if (!entry.sample_sequence_ids.empty()) j["sample_sequence_ids"] = entry.sample_sequence_ids;
  return j;
}

absl::StatusOr<std::shared_ptr<TinkerApi::Model>> TinkerApi::FindModel(const tenancy::Tenant& tenant,
                                                                       const std::string& model_id) {
  absl::MutexLock lock(&mu_);
  auto it = models_.find(model_id);
  if (it == models_.end() || it->second->tenant != tenant.id) {
    return absl::NotFoundError(absl::StrCat("model_id: no model '", model_id, "'"));
  }
  return it->second;
}

// ---- configuration and sessions --------------------------------------------------------------

Json TinkerApi::ClientConfig() const {
  return {{"pjwt_auth_enabled", false},
          {"credential_default_source", "api_key"},
          {"use_pyqwest_transport", false},
          {"proto_compress_fwdbwd", false},
          {"parallel_fwdbwd_chunks", true},
          {"fwdbwd_max_chunk_len", options_.fwdbwd_max_chunk_len},
          {"fwdbwd_max_chunk_bytes_count", 5000000},
          {"create_model_via_load_weights", false},
          {"sample_no_retries", false},
          {"sample_enable_stuck_detection", true},
          {"sample_max_concurrent_requests", options_.sample_max_concurrent_requests},
          {"sample_use_retrieve_futures", false},
          {"sample_join_sampling_session", false}};
}

Json TinkerApi::DynamicConfig() const { return {{"refresh_interval_sec", 300}}; }

Json TinkerApi::Capabilities() const {
  Json model = {{"model_name", options_.base_model}, {"trainable", true}, {"sampleable", sampler_ != nullptr}};
  const int64_t context = options_.max_context_length ? options_.max_context_length() : 0;
  if (context > 0) model["max_context_length"] = context;
  return {{"supported_models", Json::array({model})}};
}

Json TinkerApi::Telemetry(const Json&) const { return {{"status", "accepted"}}; }

absl::StatusOr<Json> TinkerApi::CreateSession(const tenancy::Tenant& tenant, const Json&) {
  const std::string id = coordinator_.CreateSession(ContextOf(tenant));
  return Json{{"session_id", id}, {"type", "create_session"}};
}

absl::StatusOr<Json> TinkerApi::SessionHeartbeat(const tenancy::Tenant& tenant, const Json& body) {
  absl::StatusOr<std::string> session = GetString(body, "session_id");
  if (!session.ok()) return session.status();
  if (absl::Status s = coordinator_.Heartbeat(ContextOf(tenant), *session); !s.ok()) return s;
  return Json{{"type", "session_heartbeat"}};
}

// ---- create / unload ------------------------------------------------------------------------

absl::StatusOr<Json> TinkerApi::CreateModel(const tenancy::Tenant& tenant, const Json& body) {
  absl::StatusOr<std::string> session = GetString(body, "session_id");
  if (!session.ok()) return session.status();
  absl::StatusOr<int64_t> model_seq = GetInt(body, "model_seq_id", 0);
  if (!model_seq.ok()) return model_seq.status();
  absl::StatusOr<std::string> base = GetString(body, "base_model");
  if (!base.ok()) return base.status();
  if (*base != options_.base_model && *base != options_.model_dir) {
    return absl::InvalidArgumentError(absl::StrCat("base_model: '", *base, "' is not served here (supported: ",
                                                   options_.base_model, ")"));
  }
  const Json lora = body.contains("lora_config") && body["lora_config"].is_object() ? body["lora_config"] : Json::object();
  absl::StatusOr<int64_t> rank = GetInt(lora, "rank", 32);
  if (!rank.ok()) return rank.status();
  if (*rank <= 0) return absl::InvalidArgumentError(absl::StrCat("lora_config.rank: ", *rank, " must be positive"));
  if (*rank > options_.max_lora_rank) {
    return absl::InvalidArgumentError(absl::StrCat("lora_config.rank: ", *rank, " above the server's limit of ",
                                                   options_.max_lora_rank));
  }
  if (*rank > tenant.quotas.max_lora_rank) {
    return absl::PermissionDeniedError(absl::StrCat("lora_config.rank: ", *rank, " above your quota of ",
                                                    tenant.quotas.max_lora_rank));
  }
  absl::StatusOr<int64_t> seed = GetInt(lora, "seed", 0);
  absl::StatusOr<bool> attn = GetBool(lora, "train_attn", true);
  absl::StatusOr<bool> mlp = GetBool(lora, "train_mlp", true);
  absl::StatusOr<bool> unembed = GetBool(lora, "train_unembed", true);
  for (const absl::Status& s : {seed.status(), attn.status(), mlp.status(), unembed.status()}) {
    if (!s.ok()) return s;
  }
  if (body.contains("optimizer_config") && body["optimizer_config"].is_object()) {
    const Json& opt = body["optimizer_config"];
    if (opt.contains("type") && opt["type"].is_string() && opt["type"] != "adamw" && opt["type"] != "adam") {
      return absl::InvalidArgumentError(absl::StrCat("optimizer_config.type: '", opt["type"].get<std::string>(),
                                                     "' is not supported (adamw)"));
    }
  }
  absl::StatusOr<std::vector<std::string>> targets = Targets(*attn, *mlp, *unembed);
  if (!targets.ok()) return targets.status();

  ModelSpec spec{*session, *model_seq, *rank, static_cast<uint64_t>(*seed), *attn, *mlp, *unembed, *targets};
  return StartModel(tenant, std::move(spec), [](const std::shared_ptr<Model>& model, const std::shared_ptr<Entry>& entry) {
    Outcome o;
    o.json = {{"model_id", model->model_id}, {"type", "create_model"}};
    Complete(entry, std::move(o));
  });
}

absl::StatusOr<Json> TinkerApi::StartModel(const tenancy::Tenant& tenant, ModelSpec spec, ModelThen then) {
  const std::string key = absl::StrCat("create_model\n", tenant.id, "\n", spec.session, "\n", spec.model_seq);
  const std::string model_id = ModelIdFor(spec.session, spec.model_seq);
  std::shared_ptr<Entry> entry;
  {
    absl::MutexLock lock(&mu_);
    auto d = dedupe_.find(key);
    if (d != dedupe_.end()) {
      auto e = entries_.find(d->second);
      if (e != entries_.end()) return Promise(*e->second);
    }
  }
  // A lasting limit: 403 at once (the SDK does not retry it), not a failed future.
  const size_t live = coordinator_.ListRuns(ContextOf(tenant)).size();
  if (live >= static_cast<size_t>(tenant.quotas.max_adapters)) {
    return absl::PermissionDeniedError(absl::StrCat("you have ", live, " models, your quota (max_adapters) is ",
                                                    tenant.quotas.max_adapters, "; unload one first"));
  }
  entry = NewEntry(tenant.id, model_id);
  {
    absl::MutexLock lock(&mu_);
    dedupe_[key] = entry->request_id;
  }
  training::AddAdapterArgs args;
  args.name = AdapterNameFor(spec.session, spec.model_seq);
  args.session_id = spec.session;
  args.lora.rank = spec.rank;
  args.lora.alpha = kLoraAlpha;
  args.lora.use_rslora = false;
  args.lora.targets = spec.targets;
  args.lora.seed = spec.seed;
  const training::TenantContext context = ContextOf(tenant);
  // AddAdapter waits for the engine: not on a transport thread.
  blocking_->Post([this, entry, args, context, spec, key, model_id, then = std::move(then)] {
    absl::StatusOr<training::AddAdapterResult> r = coordinator_.AddAdapter(context, args);
    if (!r.ok()) {
      LogInfo(kLog, absl::StrCat("tenant ", context.id, ": create_model failed: ", r.status().message()));
      {
        absl::MutexLock lock(&mu_);
        dedupe_.erase(key);
      }
      Complete(entry, Outcome::Failed(r.status()));
      return;
    }
    auto model = std::make_shared<Model>();
    model->model_id = model_id;
    model->run_id = r->run_id;
    model->tenant = context.id;
    model->adapter = r->name;
    model->session_id = args.session_id;
    model->base_model = options_.base_model;
    model->rank = args.lora.rank;
    model->seed = args.lora.seed;
    model->switches = Switches{spec.attn, spec.mlp, spec.unembed};
    {
      absl::MutexLock lock(&mu_);
      models_[model->model_id] = model;
    }
    then(model, entry);
  });
  return Promise(*entry);
}

// The SDK's create_training_client_from_state: one load_weights with session_id and
// model_seq_id instead of a model_id. The model takes the checkpoint's LoRA shape; the load
// is its first op (seq_id 0), so its later ops start at 1 as after create_model.
absl::StatusOr<Json> TinkerApi::CreateViaLoad(const tenancy::Tenant& tenant, const Json& body) {
  absl::StatusOr<std::string> session = GetString(body, "session_id");
  if (!session.ok()) return session.status();
  absl::StatusOr<int64_t> model_seq = GetInt(body, "model_seq_id", 0);
  if (!model_seq.ok()) return model_seq.status();
  absl::StatusOr<std::string> path = GetString(body, "path");
  if (!path.ok()) return path.status();
  const bool optimizer = GetBool(body, "optimizer", false).value_or(false);
  absl::StatusOr<Json> info = WeightsInfo(tenant, Json{{"tinker_path", *path}});
  if (!info.ok()) return info.status();
  const int64_t rank = (*info)["lora_rank"].get<int64_t>();
  const bool attn = (*info)["train_attn"].get<bool>(), mlp = (*info)["train_mlp"].get<bool>(),
             unembed = (*info)["train_unembed"].get<bool>();
  absl::StatusOr<std::vector<std::string>> targets = Targets(attn, mlp, unembed);
  if (!targets.ok()) return targets.status();
  ModelSpec spec{*session, *model_seq, rank, 0, attn, mlp, unembed, *targets};
  const training::TenantContext context = ContextOf(tenant);
  const std::string tinker_path = *path;
  return StartModel(tenant, std::move(spec),
                    [this, context, tinker_path, optimizer](const std::shared_ptr<Model>& model,
                                                           const std::shared_ptr<Entry>& entry) {
                      absl::StatusOr<uint64_t> id = coordinator_.SubmitLoad(
                          context, model->adapter, InternalPath(tinker_path),
                          optimizer ? training::LoadMode::kWeightsAndOptimizer
                                    : training::LoadMode::kWeightsFreshOptimizer);
                      if (!id.ok()) return Complete(entry, Outcome::Failed(id.status()));
                      Attach(entry, *id, [tinker_path, model_id = model->model_id](const std::any&) {
                        Outcome o;
                        o.json = {{"path", tinker_path}, {"model_id", model_id}, {"type", "load_weights"}};
                        return o;
                      });
                    });
}

absl::StatusOr<Json> TinkerApi::UnloadModel(const tenancy::Tenant& tenant, const Json& body) {
  absl::StatusOr<std::string> model_id = GetString(body, "model_id");
  if (!model_id.ok()) return model_id.status();
  absl::StatusOr<std::shared_ptr<Model>> model = FindModel(tenant, *model_id);
  if (!model.ok()) return model.status();
  std::shared_ptr<Entry> entry = NewEntry(tenant.id, *model_id);
  const training::TenantContext context = ContextOf(tenant);
  blocking_->Post([this, entry, context, m = *model] {
    absl::Status s = coordinator_.RemoveAdapter(context, m->adapter);
    {
      absl::MutexLock lock(&mu_);
      models_.erase(m->model_id);
    }
    Outcome o = Outcome::Failed(s);
    if (s.ok()) o.json = {{"model_id", m->model_id}, {"type", "unload_model"}};
    Complete(entry, std::move(o));
  });
  return Promise(*entry);
}

// ---- seq_id ordering -----------------------------------------------------------------------

absl::StatusOr<Json> TinkerApi::Sequenced(const std::shared_ptr<Model>& model, int64_t seq_id, Submit submit,
                                          Encoder encode) {
  absl::MutexLock lock(&model->mu);
  if (seq_id > 0) {
    auto seen = model->by_seq.find(seq_id);
    if (seen != model->by_seq.end()) {
      absl::MutexLock map_lock(&mu_);
      auto e = entries_.find(seen->second);
      if (e != entries_.end()) return Promise(*e->second);
    }
  }
  if (seq_id > model->next_seq) {
    // Ahead of its turn: wait for the gap to fill (or time out).
    std::shared_ptr<Entry> entry = NewEntry(model->tenant, model->model_id);
    model->by_seq[seq_id] = entry->request_id;
    model->buffered[seq_id] = Model::Waiting{entry, std::move(submit), std::move(encode)};
    ArmGapTimer(model);
    return Promise(*entry);
  }
  // In order (or unordered: no seq_id, or one whose turn was skipped): submit now, so a
  // refusal is the direct answer.
  absl::StatusOr<uint64_t> id = submit();
  if (!id.ok() && Transient(id.status())) return id.status();  // not accepted: the SDK retries it
  std::shared_ptr<Entry> entry = NewEntry(model->tenant, model->model_id);
  if (id.ok()) {
    Attach(entry, *id, std::move(encode));
  } else {
    Complete(entry, Outcome::Failed(id.status()));
  }
  if (seq_id > 0) model->by_seq[seq_id] = entry->request_id;
  if (seq_id == model->next_seq) {
    model->next_seq = seq_id + 1;
    ++model->progress;
    DrainLocked(*model);
  }
  // Bound the dedupe table.
  while (model->by_seq.size() > 4096) model->by_seq.erase(model->by_seq.begin());
  return Promise(*entry);
}

void TinkerApi::DrainLocked(Model& model) {
  while (!model.buffered.empty() && model.buffered.begin()->first <= model.next_seq) {
    auto node = model.buffered.extract(model.buffered.begin());
    Model::Waiting& w = node.mapped();
    absl::StatusOr<uint64_t> id = w.submit();
    if (id.ok()) {
      Attach(w.entry, *id, std::move(w.encode));
    } else {
      Complete(w.entry, Outcome::Failed(id.status()));
    }
    model.next_seq = std::max(model.next_seq, node.key() + 1);
    ++model.progress;
  }
}

void TinkerApi::ArmGapTimer(const std::shared_ptr<Model>& model) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const uint64_t progress = model->progress;
  std::weak_ptr<Model> weak = model;
  timers_->After(options_.seq_gap_timeout, [this, weak, progress] {
    std::shared_ptr<Model> m = weak.lock();
    if (m == nullptr) return;
    absl::MutexLock lock(&m->mu);
    if (m->progress != progress || m->buffered.empty()) return;
    LogWarning(kLog, absl::StrCat("model ", m->model_id, ": seq_id ", m->next_seq, " did not arrive within ",
                                  absl::FormatDuration(options_.seq_gap_timeout), "; continuing with seq_id ",
                                  m->buffered.begin()->first));
    m->next_seq = m->buffered.begin()->first;
    DrainLocked(*m);
  });
}

// ---- forward_backward ------------------------------------------------------------------------

absl::StatusOr<Json> TinkerApi::ForwardBackwardArgs(const tenancy::Tenant& tenant, const std::string& model_id,
                                                    int64_t seq_id, training::ForwardArgs args, bool forward_only) {
  absl::StatusOr<std::shared_ptr<Model>> model = FindModel(tenant, model_id);
  if (!model.ok()) return model.status();
  const training::TenantContext context = ContextOf(tenant);
  // A bad loss name or config fails the future (category user), like any bad input that is
  // found once the op is queued.
  absl::Status bad;
  if (std::find(TinkerLosses().begin(), TinkerLosses().end(), args.loss->name) == TinkerLosses().end()) {
    bad = absl::InvalidArgumentError(absl::StrCat("loss_fn: unknown loss '", args.loss->name, "' (supported: ",
                                                  absl::StrJoin(TinkerLosses(), ", "), ")"));
  }
  int64_t tokens = 0;
  for (const training::TokenDatum& d : args.datums) tokens += static_cast<int64_t>(d.input_tokens.size());
  auto shared_args = std::make_shared<training::ForwardArgs>(std::move(args));
  Submit submit = [this, context, tenant, adapter = (*model)->adapter, shared_args, forward_only, bad, tokens,
                   seq_id]() -> absl::StatusOr<uint64_t> {
    if (!bad.ok()) return bad;
    if (rate_limiter_ != nullptr) {
      if (absl::Status s = rate_limiter_->Acquire(tenant, tokens); !s.ok()) return s;
    }
    training::SubmitOptions options;
    options.idempotency_key = seq_id > 0 ? absl::StrCat("tinker-seq-", seq_id) : "";
    absl::StatusOr<uint64_t> id = coordinator_.SubmitForward(
        context, adapter,
        forward_only ? training::ForwardMode::kForward : training::ForwardMode::kForwardBackward, *shared_args,
        false, options);
    if (!id.ok() && rate_limiter_ != nullptr) rate_limiter_->Refund(tenant, tokens);
    return id;
  };
  Encoder encode = [](const std::any& value) { return EncodeForwardBackward(std::any_cast<const OpOutput&>(value)); };
  return Sequenced(*model, seq_id, std::move(submit), std::move(encode));
}

absl::StatusOr<Json> TinkerApi::ForwardBackward(const tenancy::Tenant& tenant, const v1::ForwardBackwardRequest& r) {
  training::ForwardArgs args;
  absl::StatusOr<training::LossOverride> loss = LossFromProto(r);
  if (!loss.ok()) return loss.status();
  args.loss = *std::move(loss);
  for (int i = 0; i < r.data_size(); ++i) {
    absl::StatusOr<training::TokenDatum> d = DatumFromProto(r.data(i), absl::StrCat("data[", i, "]"));
    if (!d.ok()) return d.status();
    args.datums.push_back(*std::move(d));
  }
  if (args.datums.empty()) return absl::InvalidArgumentError("data: empty batch (no datums)");
  return ForwardBackwardArgs(tenant, r.model_id(), r.seq_id(), std::move(args), r.forward_only());
}

absl::StatusOr<Json> TinkerApi::ForwardBackwardJson(const tenancy::Tenant& tenant, const Json& body,
                                                    bool forward_only) {
  const char* input_key = body.contains("forward_backward_input") ? "forward_backward_input" : "forward_input";
  if (!body.contains(input_key) || !body[input_key].is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(input_key, ": missing"));
  }
  const Json& input = body[input_key];
  absl::StatusOr<std::string> model_id = GetString(body, "model_id");
  if (!model_id.ok()) return model_id.status();
  absl::StatusOr<int64_t> seq = GetInt(body, "seq_id", 0);
  if (!seq.ok()) return seq.status();
  training::ForwardArgs args;
  absl::StatusOr<training::LossOverride> loss = LossFromJson(input);
  if (!loss.ok()) return loss.status();
  args.loss = *std::move(loss);
  if (!input.contains("data") || !input["data"].is_array()) return absl::InvalidArgumentError("data: missing");
  for (size_t i = 0; i < input["data"].size(); ++i) {
    absl::StatusOr<training::TokenDatum> d = DatumFromJson(input["data"][i], absl::StrCat("data[", i, "]"));
    if (!d.ok()) return d.status();
    args.datums.push_back(*std::move(d));
  }
  if (args.datums.empty()) return absl::InvalidArgumentError("data: empty batch (no datums)");
  const bool fwd_only = forward_only || GetBool(body, "forward_only", false).value_or(false) ||
                        GetBool(input, "forward_only", false).value_or(false);
  return ForwardBackwardArgs(tenant, *model_id, *seq, std::move(args), fwd_only);
}

// ---- optim_step, save, load -----------------------------------------------------------------

absl::StatusOr<Json> TinkerApi::OptimStep(const tenancy::Tenant& tenant, const Json& body) {
  absl::StatusOr<std::string> model_id = GetString(body, "model_id");
  if (!model_id.ok()) return model_id.status();
  absl::StatusOr<int64_t> seq = GetInt(body, "seq_id", 0);
  if (!seq.ok()) return seq.status();
  absl::StatusOr<std::shared_ptr<Model>> model = FindModel(tenant, *model_id);
  if (!model.ok()) return model.status();
  const Json* params = nullptr;
  for (const char* key : {"adam_params", "optim_params", "optimizer_params"}) {
    if (body.contains(key) && body[key].is_object()) {
      params = &body[key];
      break;
    }
  }
  std::map<std::string, double> hyper = {{"learning_rate", 1e-4}, {"beta1", 0.9},         {"beta2", 0.95},
                                         {"eps", 1e-12},          {"weight_decay", 0.0}, {"grad_clip_norm", 0.0}};
  if (params != nullptr) {
    if (params->contains("type") && (*params)["type"].is_string() && (*params)["type"] != "adam" &&
        (*params)["type"] != "adamw") {
      return absl::InvalidArgumentError(absl::StrCat("optimizer_params.type: '", (*params)["type"].get<std::string>(),
                                                     "' is not supported (adam)"));
    }
    for (auto& [key, value] : hyper) {
      absl::StatusOr<double> v = GetDouble(*params, key.c_str(), value);
      if (!v.ok()) return v.status();
      value = *v;
    }
  }
  const training::TenantContext context = ContextOf(tenant);
  Submit submit = [this, context, adapter = (*model)->adapter, hyper, seq = *seq]() {
    training::SubmitOptions options;
    options.idempotency_key = seq > 0 ? absl::StrCat("tinker-seq-", seq) : "";
    return coordinator_.SubmitOptimStep(context, adapter, hyper, options);
  };
  Encoder encode = [](const std::any& value) {
    const OpOutput& out = std::any_cast<const OpOutput&>(value);
    Json metrics = Json::object();
    for (const auto& [k, v] : out.metrics) {
      if (std::isfinite(v)) metrics[k] = v;
    }
    Outcome o;
    o.json = {{"metrics", metrics}, {"type", "optim_step"}};
    return o;
  };
  return Sequenced(*model, *seq, std::move(submit), std::move(encode));
}

absl::StatusOr<Json> TinkerApi::SaveWeights(const tenancy::Tenant& tenant, const Json& body) {
  absl::StatusOr<std::string> model_id = GetString(body, "model_id");
  if (!model_id.ok()) return model_id.status();
  absl::StatusOr<int64_t> seq = GetInt(body, "seq_id", 0);
  if (!seq.ok()) return seq.status();
  absl::StatusOr<std::shared_ptr<Model>> model = FindModel(tenant, *model_id);
  if (!model.ok()) return model.status();
  absl::StatusOr<std::string> name = GetString(body, "path");
  if (!name.ok()) return name.status();
  if (absl::Status s = storage::ValidatePathName(*name, "path"); !s.ok()) return s;
  const bool overwrite = GetBool(body, "overwrite", false).value_or(false);
  const training::TenantContext context = ContextOf(tenant);
  const std::string run_id = (*model)->run_id;
  Submit submit = [this, context, adapter = (*model)->adapter, name = *name, overwrite,
                   run_id]() -> absl::StatusOr<uint64_t> {
    if (!overwrite && registry_ != nullptr &&
        registry_->GetCheckpoint(context.id, run_id, absl::StrCat("weights/", name)).ok()) {
      return absl::AlreadyExistsError(absl::StrCat("path: checkpoint weights/", name, " of ", run_id,
                                                   " exists (save_state(..., overwrite=True) replaces it)"));
    }
    training::SaveArgs args;
    args.name = name;
    args.save_optimizer = true;
    return coordinator_.SubmitSave(context, adapter, args);
  };
  Encoder encode = [model_id = *model_id, name = *name](const std::any&) {
    Outcome o;
    o.json = {{"path", absl::StrCat("tinker://", model_id, "/weights/", name)}, {"type", "save_weights"}};
    return o;
  };
  return Sequenced(*model, *seq, std::move(submit), std::move(encode));
}

absl::StatusOr<Json> TinkerApi::LoadWeights(const tenancy::Tenant& tenant, const Json& body) {
  if (!body.contains("model_id") || body["model_id"].is_null()) return CreateViaLoad(tenant, body);
  absl::StatusOr<std::string> model_id = GetString(body, "model_id");
  if (!model_id.ok()) return model_id.status();
  absl::StatusOr<int64_t> seq = GetInt(body, "seq_id", 0);
  if (!seq.ok()) return seq.status();
  absl::StatusOr<std::shared_ptr<Model>> model = FindModel(tenant, *model_id);
  if (!model.ok()) return model.status();
  absl::StatusOr<std::string> path = GetString(body, "path");
  if (!path.ok()) return path.status();
  const bool optimizer = GetBool(body, "optimizer", false).value_or(false);
  const training::TenantContext context = ContextOf(tenant);
  Submit submit = [this, context, adapter = (*model)->adapter, path = InternalPath(*path), optimizer]() {
    return coordinator_.SubmitLoad(context, adapter, path,
                                   optimizer ? training::LoadMode::kWeightsAndOptimizer
                                    : training::LoadMode::kWeightsFreshOptimizer);
  };
  Encoder encode = [path = *path, model_id = *model_id](const std::any&) {
    Outcome o;
    o.json = {{"path", path}, {"model_id", model_id}, {"type", "load_weights"}};
    return o;
  };
  return Sequenced(*model, *seq, std::move(submit), std::move(encode));
}

// ---- direct training calls ------------------------------------------------------------------

absl::StatusOr<Json> TinkerApi::GetInfo(const tenancy::Tenant& tenant, const Json& body) {
  absl::StatusOr<std::string> model_id = GetString(body, "model_id");
  if (!model_id.ok()) return model_id.status();
  absl::StatusOr<std::shared_ptr<Model>> model = FindModel(tenant, *model_id);
  if (!model.ok()) return model.status();
  if (absl::StatusOr<training::RunInfo> run = coordinator_.GetRun(ContextOf(tenant), (*model)->run_id); !run.ok()) {
    return absl::NotFoundError(absl::StrCat("model_id: model '", *model_id, "' is no longer loaded"));
  }
  const Model& m = **model;
  return Json{{"type", "get_info"},
              {"model_id", m.model_id},
              {"model_data",
               {{"arch", options_.architecture ? options_.architecture() : ""}, {"model_name", m.base_model}, {"tokenizer_id", options_.model_dir}}},
              {"is_lora", true},
              {"lora_rank", m.rank},
              {"model_name", m.base_model}};
}

absl::StatusOr<Json> TinkerApi::WeightsInfo(const tenancy::Tenant& tenant, const Json& body) {
  absl::StatusOr<std::string> path = GetString(body, "tinker_path");
  if (!path.ok()) return path.status();
  if (checkpoints_ == nullptr || registry_ == nullptr) return absl::UnimplementedError("checkpoints are not configured");
  const std::string internal = InternalPath(*path);
  absl::StatusOr<training::CheckpointPath> parsed = training::ParseCheckpointPath(internal, "tinker_path");
  if (!parsed.ok()) return parsed.status();
  absl::StatusOr<registry::CheckpointRecord> record = checkpoints_->Resolve(tenant.id, internal, "");
  if (!record.ok()) return record.status();
  absl::StatusOr<registry::RunRecord> run = registry_->GetRun(tenant.id, record->run_id);
  if (!run.ok()) return run.status();
  Json lora = Json::parse(run->lora_config_json, nullptr, false);
  std::vector<std::string> targets;
  int64_t rank = 0;
  if (lora.is_object()) {
    if (lora.contains("target_modules") && lora["target_modules"].is_array()) {
      for (const Json& t : lora["target_modules"]) {
        if (t.is_string()) targets.push_back(t.get<std::string>());
      }
    }
    if (lora.contains("r") && lora["r"].is_number_integer()) rank = lora["r"].get<int64_t>();
  }
  const Switches s = SwitchesOf(targets);
  return Json{{"base_model", run->base_model}, {"is_lora", true},     {"lora_rank", rank},
              {"train_unembed", s.unembed},    {"train_mlp", s.mlp}, {"train_attn", s.attn}};
}

// ---- futures ----------------------------------------------------------------------------------

void TinkerApi::RetrieveFuture(const tenancy::Tenant& tenant, const Json& body,
                               std::function<void(absl::StatusOr<Poll>)> done) {
  absl::StatusOr<std::string> request_id = GetString(body, "request_id");
  if (!request_id.ok()) return done(request_id.status());
  std::shared_ptr<Entry> entry;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(*request_id);
    if (it != entries_.end() && it->second->tenant == tenant.id) entry = it->second;
  }
  if (entry == nullptr) {
    return done(absl::NotFoundError(absl::StrCat("request_id: no future '", *request_id, "'")));
  }
  // Whichever comes first answers: the completion or the long-poll timer.
  auto answered = std::make_shared<std::atomic<bool>>(false);
  auto shared_done = std::make_shared<std::function<void(absl::StatusOr<Poll>)>>(std::move(done));
  const std::string id = *request_id;
  auto on_outcome = [answered, shared_done, id](std::shared_ptr<const Outcome> outcome) {
    if (answered->exchange(true)) return;
    Poll p;
    p.outcome = std::move(outcome);
    p.request_id = id;
    (*shared_done)(std::move(p));
  };
  std::shared_ptr<const Outcome> ready;
  {
    absl::MutexLock lock(&entry->mu);
    if (entry->outcome != nullptr) {
      ready = entry->outcome;
    } else {
      entry->waiters.push_back(on_outcome);
    }
  }
  if (ready != nullptr) return on_outcome(std::move(ready));
  timers_->After(options_.long_poll, [answered, shared_done, id] {
    if (answered->exchange(true)) return;
    Poll p;
    p.request_id = id;
    (*shared_done)(std::move(p));
  });
}

// ---- REST ------------------------------------------------------------------------------------

namespace {

std::string IsoTime(absl::Time t) { return absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", t, absl::UTCTimeZone()); }

Json CheckpointJson(const registry::CheckpointRecord& c) {
  return {{"checkpoint_id", c.checkpoint_id},
          {"checkpoint_type", c.kind},
          {"time", IsoTime(c.created)},
          {"tinker_path", TinkerPathOf(c.run_id, c.checkpoint_id)},
          {"size_bytes", c.size_bytes},
          {"public", false},
          {"expires_at", nullptr}};
}

}  // namespace

absl::StatusOr<Json> TinkerApi::ListTrainingRuns(const tenancy::Tenant& tenant, int32_t limit, int32_t offset) {
  if (registry_ == nullptr) return absl::UnimplementedError("the run registry is not configured");
  int32_t total = 0;
  absl::StatusOr<std::vector<registry::RunRecord>> runs = registry_->ListRuns(tenant.id, {limit, offset}, &total);
  if (!runs.ok()) return runs.status();
  Json list = Json::array();
  for (const registry::RunRecord& r : *runs) {
    absl::StatusOr<Json> run = GetTrainingRun(tenant, ModelIdOf(r.run_id));
    if (run.ok()) list.push_back(*std::move(run));
  }
  return Json{{"training_runs", std::move(list)}, {"cursor", {{"offset", offset}, {"limit", limit}, {"total_count", total}}}};
}

absl::StatusOr<Json> TinkerApi::GetTrainingRun(const tenancy::Tenant& tenant, const std::string& model_id) {
  if (registry_ == nullptr) return absl::UnimplementedError("the run registry is not configured");
  const std::string run_id = RunIdOf(model_id);
  absl::StatusOr<registry::RunRecord> r = registry_->GetRun(tenant.id, run_id);
  if (!r.ok()) return r.status();
  Json lora = Json::parse(r->lora_config_json, nullptr, false);
  Json run = {{"training_run_id", ModelIdOf(r->run_id)},
              {"base_model", r->base_model},
              {"model_owner", tenant.id},
              {"is_lora", true},
              {"corrupted", false},
              {"lora_rank", lora.is_object() && lora.contains("r") ? lora["r"] : Json(nullptr)},
              {"last_request_time", IsoTime(r->last_request)},
              {"last_checkpoint", nullptr},
              {"last_sampler_checkpoint", nullptr},
              {"user_metadata", nullptr}};
  absl::StatusOr<std::vector<registry::CheckpointRecord>> cks = registry_->ListCheckpoints(tenant.id, run_id);
  if (cks.ok()) {
    for (const registry::CheckpointRecord& c : *cks) {  // oldest first: the last one wins
      run[c.kind == "sampler" ? "last_sampler_checkpoint" : "last_checkpoint"] = CheckpointJson(c);
    }
  }
  return run;
}

absl::StatusOr<Json> TinkerApi::ListCheckpoints(const tenancy::Tenant& tenant, const std::string& model_id) {
  if (registry_ == nullptr) return absl::UnimplementedError("the run registry is not configured");
  absl::StatusOr<std::vector<registry::CheckpointRecord>> cks =
      registry_->ListCheckpoints(tenant.id, RunIdOf(model_id));
  if (!cks.ok()) return cks.status();
  Json list = Json::array();
  for (const registry::CheckpointRecord& c : *cks) list.push_back(CheckpointJson(c));
  return Json{{"checkpoints", std::move(list)}, {"cursor", nullptr}};
}

absl::StatusOr<Json> TinkerApi::ListUserCheckpoints(const tenancy::Tenant& tenant, int32_t limit, int32_t offset) {
  if (registry_ == nullptr) return absl::UnimplementedError("the run registry is not configured");
  int32_t total = 0;
  absl::StatusOr<std::vector<registry::RunRecord>> runs = registry_->ListRuns(tenant.id, {1 << 20, 0}, &total);
  if (!runs.ok()) return runs.status();
  std::vector<Json> all;
  for (const registry::RunRecord& r : *runs) {
    absl::StatusOr<std::vector<registry::CheckpointRecord>> cks = registry_->ListCheckpoints(tenant.id, r.run_id);
    if (!cks.ok()) continue;
    for (const registry::CheckpointRecord& c : *cks) all.push_back(CheckpointJson(c));
  }
  Json list = Json::array();
  for (size_t i = static_cast<size_t>(std::max(offset, 0)); i < all.size() && list.size() < static_cast<size_t>(limit);
       ++i) {
    list.push_back(all[i]);
  }
  return Json{{"checkpoints", std::move(list)},
              {"cursor", {{"offset", offset}, {"limit", limit}, {"total_count", all.size()}}}};
}

absl::StatusOr<Json> TinkerApi::DeleteCheckpoint(const tenancy::Tenant& tenant, const std::string& run_id,
                                                 const std::string& checkpoint_id) {
  if (checkpoints_ == nullptr) return absl::UnimplementedError("checkpoints are not configured");
  if (absl::Status s = checkpoints_->Delete(tenant.id, RunIdOf(run_id), checkpoint_id); !s.ok()) return s;
  return Json::object();
}

absl::StatusOr<Json> TinkerApi::ListSessions(const tenancy::Tenant& tenant) {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> sessions;
  for (const auto& [id, m] : models_) {
    if (m->tenant == tenant.id &&
        std::find(sessions.begin(), sessions.end(), m->session_id) == sessions.end()) {
      sessions.push_back(m->session_id);
    }
  }
  return Json{{"sessions", sessions}};
}

absl::StatusOr<Json> TinkerApi::GetSession(const tenancy::Tenant& tenant, const std::string& session_id) {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> runs;
  for (const auto& [id, m] : models_) {
    if (m->tenant == tenant.id && m->session_id == session_id) runs.push_back(id);
  }
  return Json{{"training_run_ids", runs}, {"sampler_ids", Json::array()}};
}

}  // namespace twinkle::tinker
