// SamplerCoordinator: sampling sessions (on the base model, a checkpoint path, or a live
// adapter snapshot), the snapshots they pin, SubmitSample's checks and the spreading of its
// rows over the lanes. The lanes' decode threads, which run the rows, are in sampler_decode.cc.
#include "core/sampling/sampler_coordinator.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/common/log.h"
#include "core/ipc/training_messages.h"
#include "core/scheduler/op.h"
#include "core/sampling/sampler_state.h"

namespace twinkle::sampling {
namespace {

using sampler_internal::kLog;

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

// The lanes are made before model_ binds to the first one's link.
std::vector<std::unique_ptr<SamplerCoordinator::Lane>> SamplerCoordinator::MakeLanes(
    const std::vector<training::EngineLink*>& engines) {
  std::vector<std::unique_ptr<Lane>> lanes;
  for (training::EngineLink* engine : engines) {
    auto lane = std::make_unique<Lane>();
    lane->index = lanes.size();
    lane->engine = engine;
    lanes.push_back(std::move(lane));
  }
  return lanes;
}

SamplerCoordinator::SamplerCoordinator(SamplerOptions options, std::vector<training::EngineLink*> engines,
                                       training::TrainingCoordinator& training,
                                       training::CheckpointStore* checkpoints, FutureStore& futures,
                                       const Clock& clock)
    : options_(std::move(options)),
      lanes_(MakeLanes(engines)),
      model_(*lanes_.at(0)->engine),
      training_(training),
      checkpoints_(checkpoints),
      futures_(futures),
      clock_(clock),
      token_text_(LoadTokenText(options_.model_dir)),
      eos_token_ids_(options_.model_dir.empty() ? std::vector<int64_t>{} : LoadEosTokenIds(options_.model_dir)),
      boot_tag_(absl::StrCat(absl::Hex(absl::Uniform<uint32_t>(absl::BitGen()), absl::kZeroPad8))) {
  absl::MutexLock lock(&graveyard_->mu);
  graveyard_->engine_ids.resize(lanes_.size());
}

SamplerCoordinator::~SamplerCoordinator() { Stop(); }

void SamplerCoordinator::Start() {
  // The sessions the last boot left open wait for their first use.
  std::vector<registry::SamplingSessionRecord> journaled;
  if (options_.registry != nullptr) {
    absl::StatusOr<std::vector<registry::SamplingSessionRecord>> rows = options_.registry->ListSamplingSessions();
    if (rows.ok()) {
      journaled = *std::move(rows);
    } else {
      LogWarning(kLog, absl::StrCat("sampling sessions of the last run not restored: ", rows.status().message()));
    }
  }
  // This model's rows wait for their first use; the default model drops those of a model no
  // longer served (never reopened on another one).
  std::vector<registry::SamplingSessionRecord> ours;
  for (registry::SamplingSessionRecord& row : journaled) {
    if (row.base_model == options_.base_model || (row.base_model.empty() && options_.default_model)) {
      ours.push_back(std::move(row));
    } else if (options_.default_model && std::find(options_.other_models.begin(), options_.other_models.end(),
                                                   row.base_model) == options_.other_models.end()) {
      LogInfo(kLog, absl::StrCat("tenant ", row.tenant, ": sampling session ", row.id, " of base model '",
                                 row.base_model, "', no longer served, is not reopened"));
      (void)options_.registry->DeleteSamplingSession(row.id, row.tenant);
    }
  }
  absl::MutexLock lock(&mu_);
  if (started_) return;
  for (registry::SamplingSessionRecord& row : ours) {
    if (sessions_.count(row.id) == 0) dormant_.emplace(row.id, std::move(row));
  }
  if (!dormant_.empty()) {
    dormant_until_ = clock_.Now() + options_.session_timeout;
    LogInfo(kLog, absl::StrCat(dormant_.size(), " sampling sessions of the last run can be reopened"));
  }
  started_ = true;
  stop_ = false;
  for (const std::unique_ptr<Lane>& lane : lanes_) {
    lane->thread = std::thread([this, l = lane.get()] { DecodeLoop(*l); });
  }
}

void SamplerCoordinator::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    WakeAllLanes();
  }
  for (const std::unique_ptr<Lane>& lane : lanes_) {
    if (lane->thread.joinable()) lane->thread.join();
  }
}

void SamplerCoordinator::WakeAllLanes() {
  for (const std::unique_ptr<Lane>& lane : lanes_) lane->wake.Signal();
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
  snapshot->engine_generation.assign(lanes_.size(), 0);
  {
    absl::MutexLock lock(&graveyard_->mu);
    ++graveyard_->live;
  }
  // The last holder may let go on any thread, under any lock: only the graveyard is touched.
  return std::shared_ptr<Snapshot>(snapshot, [graveyard = graveyard_](Snapshot* s) {
    {
      absl::MutexLock lock(&graveyard->mu);
      --graveyard->live;
      for (size_t lane = 0; lane < s->engine_generation.size(); ++lane) {
        if (s->engine_generation[lane] != 0) graveyard->engine_ids[lane].push_back(s->engine_id);
      }
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
                                           std::shared_ptr<Snapshot> snapshot, const std::string& owner, bool live,
                                           const std::string& id) {
  auto session = std::make_shared<Session>();
  session->id = id.empty() ? absl::StrCat("sampler-", boot_tag_, "-", next_session_++) : id;
  session->tenant = tenant;
  session->model_path = model_path;
  session->snapshot = std::move(snapshot);
  session->owner = owner;
  session->live = live;
  session->last_used = clock_.Now();
  sessions_[session->id] = session;
  return session->id;
}

std::string SamplerCoordinator::ReleaseLocked(std::map<std::string, std::shared_ptr<Session>>::iterator it,
                                              const std::string& why, std::vector<std::shared_ptr<Session>>* keep) {
  const std::string id = it->first;
  const std::string tenant = it->second->tenant;
  LogInfo(kLog, absl::StrCat("tenant ", tenant, ": sampling session ", id, " released: ", why));
  keep->push_back(std::move(it->second));  // its snapshot is let go after mu_
  sessions_.erase(it);
  if (released_.emplace(id, std::make_pair(tenant, why)).second) released_order_.push_back(id);
  while (static_cast<int64_t>(released_order_.size()) > std::max(options_.released_sessions_remembered, 0)) {
    released_.erase(released_order_.front());
    released_order_.pop_front();
  }
  WakeAllLanes();  // its snapshot may be freed now
  return training::TrainingCoordinator::TaskQueue(tenant, "sampler/" + id);
}

void SamplerCoordinator::DropQueues(const std::string& tenant, const std::vector<std::string>& queues,
                                    const std::string& why) {
  // Requests already handed to a decode thread still finish; queued ones are refused.
  for (const std::string& queue : queues) {
    training_.scheduler().DropAdapter(queue, absl::FailedPreconditionError(why));
  }
  (void)tenant;
}

void SamplerCoordinator::MakeRoomForLiveSnapshotLocked(const std::string& tenant, std::vector<std::string>* queues,
                                                       std::vector<std::shared_ptr<Session>>* keep) {
  for (;;) {
    int64_t live = 0, mine = 0;
    auto lru = sessions_.end();
    for (auto it = sessions_.begin(); it != sessions_.end(); ++it) {
      if (it->second->tenant != tenant) continue;
      ++mine;
      if (!it->second->live) continue;
      ++live;
      if (lru == sessions_.end() || it->second->last_used < lru->second->last_used) lru = it;
    }
    if (lru == sessions_.end()) return;  // nothing of its own to evict
    int64_t server_wide = 0;
    {
      absl::MutexLock dead(&graveyard_->mu);
      server_wide = graveyard_->live;
    }
    const bool over = live >= options_.max_snapshots_per_tenant || mine >= options_.max_sessions_per_tenant ||
                      server_wide >= options_.max_snapshots;
    if (!over) return;
    queues->push_back(ReleaseLocked(
        lru,
        absl::StrCat("its snapshot was evicted as the least recently used of your ", live,
                     " unnamed sampler snapshots (limit sampler.max_snapshots_per_tenant = ",
                     options_.max_snapshots_per_tenant, "); save the weights for sampling again"),
        keep));
    // A snapshot still held by a running request is freed when it finishes: the server-wide
    // figure may not drop at once, so evict at most what the per-tenant caps ask beyond one.
    if (live < options_.max_snapshots_per_tenant && mine < options_.max_sessions_per_tenant) return;
  }
}

absl::StatusOr<std::string> SamplerCoordinator::ImplicitSession(const TenantContext& tenant,
                                                                const std::string& model_path) {
  const std::string key = absl::StrCat(tenant.id, "\n", model_path);
  {
    absl::MutexLock lock(&mu_);
    auto it = implicit_.find(key);
    if (it != implicit_.end()) {
      auto s = sessions_.find(it->second);
      if (s != sessions_.end() && s->second->tenant == tenant.id) {
        s->second->last_used = clock_.Now();
        return it->second;
      }
      implicit_.erase(it);
    }
  }
  absl::StatusOr<std::string> id = CreateSession(tenant, model_path);
  if (!id.ok()) return id.status();
  std::shared_ptr<Session> duplicate;  // unjournaled after the lock
  std::string kept;
  {
    absl::MutexLock lock(&mu_);
    auto [it, inserted] = implicit_.emplace(key, *id);
    if (!inserted && it->second != *id && sessions_.count(it->second)) {
      // Another request made one meanwhile: keep that one, close ours.
      kept = it->second;
      auto ours = sessions_.find(*id);
      if (ours != sessions_.end()) {
        duplicate = std::move(ours->second);
        sessions_.erase(ours);
      }
      WakeAllLanes();
    } else {
      it->second = *id;
    }
  }
  if (kept.empty()) return *id;
  Unjournal({duplicate});
  return kept;
}

std::vector<std::string> SamplerCoordinator::SessionsOwnedBy(const std::string& tenant,
                                                             const std::string& owner) const {
  std::vector<std::string> out;
  if (owner.empty()) return out;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, session] : sessions_) {
    if (session->tenant == tenant && session->owner == owner) out.push_back(id);
  }
  return out;
}

int64_t SamplerCoordinator::CloseOwnedBy(const TenantContext& tenant, const std::string& owner) {
  if (owner.empty()) return 0;
  std::vector<std::shared_ptr<Session>> keep;
  std::vector<std::string> queues;
  const std::string why = absl::StrCat("its session ", owner, " finished");
  {
    absl::MutexLock lock(&mu_);
    for (auto it = sessions_.begin(); it != sessions_.end();) {
      auto next = std::next(it);
      if (it->second->tenant == tenant.id && it->second->owner == owner) queues.push_back(ReleaseLocked(it, why, &keep));
      it = next;
    }
  }
  Unjournal(keep);
  DropQueues(tenant.id, queues, absl::StrCat("the sampling session was released: ", why));
  return static_cast<int64_t>(queues.size());
}

absl::StatusOr<std::string> SamplerCoordinator::CreateSession(const TenantContext& tenant,
                                                              const std::string& model_path, const std::string& owner) {
  absl::StatusOr<std::string> id = OpenSession(tenant, model_path, owner, "");
  if (id.ok()) Journal(tenant.id, *id, model_path, owner);
  return id;
}

void SamplerCoordinator::Journal(const std::string& tenant, const std::string& id, const std::string& model_path,
                                 const std::string& owner) {
  if (options_.registry == nullptr) return;
  registry::SamplingSessionRecord row;
  row.id = id;
  row.tenant = tenant;
  row.model_path = model_path;
  row.owner = owner;
  row.created = clock_.Now();
  row.base_model = options_.base_model;
  // Without its row the session still works; it is only not reopened after a restart.
  if (absl::Status s = options_.registry->PutSamplingSession(row); !s.ok()) {
    LogWarning(kLog, absl::StrCat("tenant ", tenant, ": sampling session ", id, " not journaled: ", s.message()));
  }
}

void SamplerCoordinator::Unjournal(const std::vector<std::shared_ptr<Session>>& released) {
  if (options_.registry == nullptr) return;
  for (const std::shared_ptr<Session>& session : released) {
    if (session == nullptr || session->live) continue;  // live sessions have no row
    if (absl::Status s = options_.registry->DeleteSamplingSession(session->id, session->tenant); !s.ok()) {
      LogWarning(kLog, absl::StrCat("tenant ", session->tenant, ": sampling session ", session->id,
                                    " still journaled: ", s.message()));
    }
  }
}

absl::StatusOr<std::string> SamplerCoordinator::OpenSession(const TenantContext& tenant,
                                                            const std::string& model_path, const std::string& owner,
                                                            const std::string& id) {
  if (model_path.empty()) {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = CheckSessionRoom(tenant.id); !s.ok()) return s;
    return AddSession(tenant.id, "", nullptr, owner, false, id);
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
      if (std::shared_ptr<Snapshot> shared = it->second.lock()) {
        return AddSession(tenant.id, model_path, shared, owner, false, id);
      }
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
  return AddSession(tenant.id, model_path, std::move(snapshot), owner, false, id);
}

absl::StatusOr<uint64_t> SamplerCoordinator::SubmitSnapshotSession(const TenantContext& tenant,
                                                                   const std::string& adapter_name,
                                                                   const SubmitOptions& options,
                                                                   const std::string& owner) {
  {
    // Server-wide full: refused only when the tenant has no live snapshot of its own to evict.
    absl::MutexLock lock(&mu_);
    bool has_live = false;
    for (const auto& [id, s] : sessions_) has_live |= s->tenant == tenant.id && s->live;
    if (!has_live) {
      if (absl::Status s = CheckSnapshotRoom(); !s.ok()) return s;
    }
  }
  const std::string tenant_id = tenant.id;
  return training_.SubmitWithWeights(
      tenant, adapter_name,
      [this, tenant_id, adapter_name, owner](training::TrainingCoordinator::CapturedWeights weights)
          -> FutureResult {
        std::vector<std::shared_ptr<Session>> keep;  // evicted sessions, let go after mu_
        std::vector<std::string> queues;
        FutureResult result = absl::InternalError("unset");
        {
          absl::MutexLock lock(&mu_);
          MakeRoomForLiveSnapshotLocked(tenant_id, &queues, &keep);
          if (absl::Status s = CheckSessionRoom(tenant_id); !s.ok()) {
            result = s;
          } else if (absl::Status room = CheckSnapshotRoom(); !room.ok()) {
            result = room;
          } else {
            std::shared_ptr<Snapshot> snapshot =
                NewSnapshot(tenant_id, absl::StrCat("adapter ", adapter_name), std::move(weights));
            result = FutureValue(SnapshotSession{AddSession(tenant_id, "", std::move(snapshot), owner, true)});
          }
        }
        keep.clear();
        DropQueues(tenant_id, queues, "the sampling session was released: its snapshot was evicted");
        return result;
      },
      options);
}

absl::StatusOr<std::shared_ptr<SamplerCoordinator::Session>> SamplerCoordinator::FindSession(
    const TenantContext& tenant, const std::string& id) {
  for (int attempt = 0;; ++attempt) {
    {
      absl::MutexLock lock(&mu_);
      auto it = sessions_.find(id);
      if (it != sessions_.end() && it->second->tenant == tenant.id) {
        it->second->last_used = clock_.Now();
        return it->second;
      }
      auto released = released_.find(id);
      if (released != released_.end() && released->second.first == tenant.id) {
        // Not a retryable condition: the session and its weights are gone for good.
        return absl::FailedPreconditionError(
            absl::StrCat("sampling session '", id, "' was released: ", released->second.second));
      }
    }
    if (attempt > 0) break;
    if (absl::Status s = ReopenAfterRestart(tenant, id); !s.ok()) return s;
  }
  return absl::NotFoundError(absl::StrCat("sampling session '", id, "' not found"));
}

absl::Status SamplerCoordinator::ReopenAfterRestart(const TenantContext& tenant, const std::string& id) {
  registry::SamplingSessionRecord row;
  {
    absl::MutexLock lock(&mu_);
    auto it = dormant_.find(id);
    if (it == dormant_.end() || it->second.tenant != tenant.id) {
      // "sampler-<boot>-<n>" of another boot: a session that was not kept (a live snapshot's,
      // or one closed since); anything else is an id this server never issued. Another
      // tenant's id gets the same answer as an unknown id of its boot: it reveals nothing.
      const std::vector<std::string> parts = absl::StrSplit(id, '-');
      if (parts.size() == 3 && parts[0] == "sampler" && parts[1].size() == 8 && parts[1] != boot_tag_) {
        return absl::FailedPreconditionError(absl::StrCat(
            "sampling session '", id,
            "' was lost in a server restart: it was closed before it, or it sampled an unnamed snapshot of a "
            "training client's weights (save_weights_and_get_sampling_client), which lives in memory only; "
            "make a new sampling client"));
      }
      return absl::NotFoundError(absl::StrCat("sampling session '", id, "' not found"));
    }
    row = std::move(it->second);
    dormant_.erase(it);
  }
  // Its owner (a training session of the last run) is kept only if it is alive again.
  const std::string owner = training_.SessionAlive(tenant.id, row.owner) ? row.owner : "";
  absl::StatusOr<std::string> reopened = OpenSession(tenant, row.model_path, owner, row.id);
  if (!reopened.ok()) {
    // Only a checkpoint that is gone for good (deleted, expired, unreadable, no longer
    // shared) ends the session. Anything else (no room now among the tenant's sampling
    // sessions or in the snapshot pool, the engine busy) leaves it dormant, and the error
    // says what to do; a later call may reopen it.
    const absl::StatusCode code = reopened.status().code();
    const bool gone = code == absl::StatusCode::kNotFound || code == absl::StatusCode::kInvalidArgument ||
                      code == absl::StatusCode::kPermissionDenied || code == absl::StatusCode::kDataLoss;
    if (!gone) {
      absl::MutexLock lock(&mu_);
      dormant_.emplace(row.id, std::move(row));
      return reopened.status();
    }
    // Its checkpoint may be gone (deleted, expired): the session cannot come back.
    if (options_.registry != nullptr) (void)options_.registry->DeleteSamplingSession(row.id, row.tenant);
    return absl::FailedPreconditionError(absl::StrCat("sampling session '", id,
                                                      "' could not be reopened after a server restart: ",
                                                      reopened.status().message()));
  }
  LogInfo(kLog, absl::StrCat("tenant ", tenant.id, ": sampling session ", id, " reopened after a restart"));
  if (owner != row.owner) Journal(row.tenant, row.id, row.model_path, owner);
  return absl::OkStatus();
}

absl::StatusOr<SamplingSessionInfo> SamplerCoordinator::GetSession(const TenantContext& tenant,
                                                                   const std::string& session_id) {
  absl::StatusOr<std::shared_ptr<Session>> session = FindSession(tenant, session_id);
  if (!session.ok()) return session.status();
  SamplingSessionInfo info;
  info.id = (*session)->id;
  info.base_model = options_.base_model;
  info.model_path = (*session)->model_path;
  info.owner = (*session)->owner;
  return info;
}

bool SamplerCoordinator::HoldsSession(const std::string& tenant, const std::string& session_id) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it != sessions_.end()) return it->second->tenant == tenant;
  auto dormant = dormant_.find(session_id);
  return dormant != dormant_.end() && dormant->second.tenant == tenant;
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
    WakeAllLanes();  // its snapshot may be freed now
  }
  Unjournal({closed});
  // Its queue goes too (requests already handed to the decode thread still finish).
  training_.scheduler().DropAdapter(training::TrainingCoordinator::TaskQueue(tenant.id, "sampler/" + session_id),
                                    absl::CancelledError("the sampling session was closed"));
  return absl::OkStatus();
}

void SamplerCoordinator::Housekeep() {
  std::vector<std::shared_ptr<Session>> expired;
  std::vector<std::pair<std::string, std::string>> queues;  // (tenant, queue)
  std::vector<registry::SamplingSessionRecord> never_reopened;
  {
    absl::MutexLock lock(&mu_);
    if (!dormant_.empty() && clock_.Now() >= dormant_until_) {
      for (auto& [id, row] : dormant_) never_reopened.push_back(std::move(row));
      dormant_.clear();
    }
    const absl::Time cutoff = clock_.Now() - options_.session_timeout;
    for (auto it = sessions_.begin(); it != sessions_.end();) {
      auto next = std::next(it);
      const Session& s = *it->second;
      std::string why;
      if (s.last_used < cutoff) {
        why = "unused for sessions.adapter_timeout_s";
      } else if (!s.owner.empty() && !training_.SessionAlive(s.tenant, s.owner)) {
        why = absl::StrCat("its session ", s.owner, " ended (finished or stopped heartbeating)");
      }
      if (!why.empty()) {
        const std::string tenant = s.tenant;
        queues.emplace_back(tenant, ReleaseLocked(it, why, &expired));
      }
      it = next;
    }
  }
  Unjournal(expired);
  expired.clear();
  if (options_.registry != nullptr) {
    for (const registry::SamplingSessionRecord& row : never_reopened) {
      (void)options_.registry->DeleteSamplingSession(row.id, row.tenant);
    }
  }
  for (const auto& [tenant, queue] : queues) DropQueues(tenant, {queue}, "the sampling session was released");
}

int64_t SamplerCoordinator::TokensOf(const std::vector<std::vector<int64_t>>& prompts,
                                     const SamplingParams& params) const {
  const int64_t max_tokens = params.max_tokens == 0 ? options_.default_max_tokens : std::max<int64_t>(params.max_tokens, 0);
  const int64_t samples = params.num_samples == 0 ? 1 : std::max<int64_t>(params.num_samples, 0);
  int64_t total = 0;
  for (const std::vector<int64_t>& prompt : prompts) {
    total += (static_cast<int64_t>(prompt.size()) + max_tokens) * samples;
  }
  return total;
}

SamplerStats SamplerCoordinator::stats() const {
  absl::MutexLock lock(&mu_);
  SamplerStats s;
  s.sessions = static_cast<int64_t>(sessions_.size());
  for (const std::unique_ptr<Lane>& lane : lanes_) {
    SamplerLaneStats l{static_cast<int64_t>(lane->waiting.size()), static_cast<int64_t>(lane->running.size()),
                       lane->blocks_in_use, lane->blocks_total, lane->tokens_generated,
                       lane->states_in_use, lane->states_total};
    s.waiting += l.waiting;
    s.states_in_use += l.states_in_use;
    s.states_total += l.states_total;
    s.running += l.running;
    s.blocks_in_use += l.blocks_in_use;
    s.blocks_total += l.blocks_total;
    s.tokens_generated += l.tokens_generated;
    if (lane->block_size != 0) s.block_size = lane->block_size;
    s.lanes.push_back(l);
  }
  absl::MutexLock dead(&graveyard_->mu);
  s.snapshots = graveyard_->live;
  return s;
}

// ---- submission ------------------------------------------------------------------------------

absl::StatusOr<uint64_t> SamplerCoordinator::SubmitSample(const TenantContext& tenant, const std::string& session_id,
                                                          std::vector<std::vector<int64_t>> prompts,
                                                          const SamplingParams& given, const SubmitOptions& options,
                                                          std::shared_ptr<SampleStream> stream) {
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
  if (!(params.repetition_penalty > 0) || std::isinf(params.repetition_penalty)) {
    return absl::InvalidArgumentError(
        absl::StrCat("repetition_penalty: ", params.repetition_penalty, " must be finite and > 0"));
  }
  for (const auto& [name, value] : {std::pair<const char*, double>{"presence_penalty", params.presence_penalty},
                                    std::pair<const char*, double>{"frequency_penalty", params.frequency_penalty}}) {
    if (!(std::fabs(value) <= ipc::kMaxPenalty)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": ", value, " must be in [", -ipc::kMaxPenalty, ", ", ipc::kMaxPenalty, "]"));
    }
  }
  if (!(params.min_p >= 0 && params.min_p <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("min_p: ", params.min_p, " must be in [0, 1]"));
  }
  if (params.num_samples == 0) params.num_samples = 1;
  if (params.num_samples < 0 || params.num_samples > options_.max_num_samples) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_samples: ", params.num_samples, " must be in [1, ", options_.max_num_samples, "]"));
  }
  if (const int64_t slots = model_.state_slots(); slots > 0 && params.num_samples > slots) {
    return absl::InvalidArgumentError(absl::StrCat("num_samples: ", params.num_samples, " exceeds the ", slots,
                                                   " recurrent state slots of a sampler worker (sequences of this "
                                                   "hybrid model that can run at once: sampler.state_slots)"));
  }
  if (prompts.empty()) return absl::InvalidArgumentError("prompts: empty; give at least one prompt");
  const int64_t vocab = model_.vocab_size();
  const int64_t max_top = vocab > 0 ? std::min(vocab, ipc::kMaxTopLogprobs) : ipc::kMaxTopLogprobs;
  if (params.top_logprobs < 0 || params.top_logprobs > max_top) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_logprobs: ", params.top_logprobs, " must be in [0, ", max_top, "]"));
  }
  if (params.prompt_top_logprobs < 0 || params.prompt_top_logprobs > max_top) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt_top_logprobs: ", params.prompt_top_logprobs, " must be in [0, ", max_top, "]"));
  }
  if (params.prompt_alt_tokens_k < 0 || params.prompt_alt_tokens_k > ipc::kMaxPromptTargets) {
    return absl::InvalidArgumentError(absl::StrCat("prompt_alt_tokens_k: ", params.prompt_alt_tokens_k,
                                                   " must be in [0, ", ipc::kMaxPromptTargets, "]"));
  }
  if (params.target_prompt_width != 0 || !params.target_prompt_tokens.empty()) {
    const int64_t width = params.target_prompt_width;
    if (prompts.size() != 1) {
      return absl::InvalidArgumentError("target_prompt_logprobs: applies to a request with one prompt");
    }
    const int64_t rows = static_cast<int64_t>(prompts[0].size()) - 1;
    if (width < 1 || width > ipc::kMaxPromptTargets ||
        static_cast<int64_t>(params.target_prompt_tokens.size()) != rows * width) {
      return absl::InvalidArgumentError(absl::StrCat("target_prompt_logprobs: expected shape [", rows,
                                                     ", K] (len(prompt) - 1 rows) with 1 <= K <= ",
                                                     ipc::kMaxPromptTargets, ", got ", params.target_prompt_tokens.size(),
                                                     " ids of width ", width));
    }
    for (size_t i = 0; i < params.target_prompt_tokens.size(); ++i) {
      const int64_t id = params.target_prompt_tokens[i];
      if (id < -1 || (vocab > 0 && id >= vocab)) {
        return absl::InvalidArgumentError(absl::StrCat("target_prompt_logprobs[", i / width, ", ", i % width,
                                                       "]: token id ", id, " is neither -1 nor in [0, ", vocab, ")"));
      }
    }
  }
  const int64_t max_positions = model_.max_position_embeddings();
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
  request->key_id = tenant.key_id;
  request->usage_session = (*session)->owner.empty() ? session_id : (*session)->owner;
  request->snapshot = (*session)->snapshot;
  request->prompts = std::move(prompts);
  request->params = std::move(params);
  request->stream = std::move(stream);
  request->output.prompts.resize(request->prompts.size());
  request->rows_left = request->prompts.size();
  // A queue per session: requests of one session keep their order; sessions interleave.
  return training_.SubmitTask(tenant, "sampler/" + session_id, "sample", total_tokens,
                              [this, request](uint64_t op_id) -> FutureResult {
                                request->future_id = op_id;
                                Enqueue(request);
                                return FutureValue(sched::Deferred{});
                              },
                              options);
}

void SamplerCoordinator::CancelStream(SampleStream& stream) {
  stream.cancelled_ = true;
  absl::MutexLock lock(&mu_);
  WakeAllLanes();  // a lane with nothing else to do still drops the rows now
}

SamplerCoordinator::Lane& SamplerCoordinator::LeastLoadedLane() {
  if (lanes_.size() == 1) return *lanes_[0];  // colocated, or one dedicated worker: nothing to weigh
  Lane* best = nullptr;
  int64_t best_tokens = 0;
  for (const std::unique_ptr<Lane>& lane : lanes_) {
    int64_t tokens = 0;
    for (const std::shared_ptr<Row>& row : lane->waiting) tokens += row->tokens;
    for (const auto& [id, row] : lane->running) tokens += row->tokens;
    if (best == nullptr || tokens < best_tokens) {
      best = lane.get();
      best_tokens = tokens;
    }
  }
  return *best;
}

void SamplerCoordinator::Enqueue(std::shared_ptr<Request> request) {
  absl::MutexLock lock(&mu_);
  ++in_flight_by_tenant_[request->tenant];
  for (size_t i = 0; i < request->prompts.size(); ++i) {
    auto row = std::make_shared<Row>();
    row->request = request;
    row->prompt_index = i;
    row->engine_id = next_row_++;
    row->tokens = (static_cast<int64_t>(request->prompts[i].size()) + request->params.max_tokens) *
                  request->params.num_samples;
    Lane& lane = LeastLoadedLane();
    lane.waiting.push_back(std::move(row));
    lane.wake.Signal();
  }
}

// ---- the decode thread -----------------------------------------------------------------------

}  // namespace twinkle::sampling
