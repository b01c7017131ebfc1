// TinkerApi's typed direct calls over the run registry and the served model: the server's
// capabilities, session heartbeats and the REST listings of training runs and checkpoints
// (with access_scope), and checkpoint deletion. Their results are encoded by the
// transports' codecs (tinker_codec.h, server/grpc/tinker_service.cc).
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/tinker/tinker_api.h"
#include "server/tinker/tinker_internal.h"

namespace twinkle::tinker {
namespace {

// One of the tenant's own runs, with its newest checkpoints.
absl::StatusOr<TrainingRunInfo> OwnRun(registry::Registry& store, const std::string& tenant,
                                       const std::string& run_id) {
  absl::StatusOr<registry::RunRecord> r = store.GetRun(tenant, run_id);
  if (!r.ok()) return r.status();
  absl::StatusOr<std::vector<registry::CheckpointRecord>> cks = store.ListCheckpoints(tenant, run_id);
  return RunOf(*r, cks.ok() ? *cks : std::vector<registry::CheckpointRecord>{});
}

// The caller's runs, then every other tenant's run that has a published checkpoint.
absl::StatusOr<std::vector<TrainingRunInfo>> AccessibleRuns(registry::Registry& store, const std::string& tenant) {
  int32_t total = 0;
  absl::StatusOr<std::vector<registry::RunRecord>> runs = store.ListRuns(tenant, {1 << 20, 0}, &total);
  if (!runs.ok()) return runs.status();
  std::vector<TrainingRunInfo> all;
  for (const registry::RunRecord& r : *runs) {
    absl::StatusOr<TrainingRunInfo> run = OwnRun(store, tenant, RunIdOf(ModelIdOf(r.run_id)));
    if (run.ok()) all.push_back(*std::move(run));
  }
  absl::StatusOr<std::vector<registry::CheckpointRecord>> shared = store.PublishedCheckpointsOfOthers(tenant);
  if (!shared.ok()) return shared.status();
  for (size_t i = 0; i < shared->size();) {
    size_t j = i;
    std::vector<registry::CheckpointRecord> of_run;
    while (j < shared->size() && (*shared)[j].tenant == (*shared)[i].tenant && (*shared)[j].run_id == (*shared)[i].run_id) {
      of_run.push_back((*shared)[j++]);
    }
    absl::StatusOr<registry::RunRecord> run = store.GetRun((*shared)[i].tenant, (*shared)[i].run_id);
    if (run.ok()) all.push_back(RunOf(*run, of_run));
    i = j;
  }
  return all;
}

}  // namespace

CheckpointInfo CheckpointOf(const registry::CheckpointRecord& c) {
  CheckpointInfo info;
  info.checkpoint_id = c.checkpoint_id;
  info.checkpoint_type = c.kind;
  info.time = IsoTime(c.created);
  info.tinker_path = TinkerPathOf(c.run_id, c.checkpoint_id);
  info.size_bytes = c.size_bytes;
  info.published = c.published;
  if (c.expires) info.expires_at = IsoTime(*c.expires);
  return info;
}

TrainingRunInfo RunOf(const registry::RunRecord& r, const std::vector<registry::CheckpointRecord>& checkpoints) {
  TrainingRunInfo run;
  run.training_run_id = ModelIdOf(r.run_id);
  run.base_model = r.base_model;
  run.model_owner = r.tenant;
  run.last_request_time = IsoTime(r.last_request);
  const Json lora = Json::parse(r.lora_config_json, nullptr, false);
  if (lora.is_object() && lora.contains("r") && lora["r"].is_number_integer()) run.lora_rank = lora["r"].get<int64_t>();
  if (!r.user_metadata_json.empty()) {
    Json metadata = Json::parse(r.user_metadata_json, nullptr, false);
    if (metadata.is_object()) run.user_metadata = std::move(metadata);
  }
  for (const registry::CheckpointRecord& c : checkpoints) {  // oldest first: the last one wins
    if (c.kind == "training") run.last_checkpoint = CheckpointOf(c);
    if (c.kind == "sampler") run.last_sampler_checkpoint = CheckpointOf(c);
  }
  return run;
}

// Every served base model, in config order (the first is the default).
ServerCapabilities TinkerApi::GetServerCapabilities() const {
  ServerCapabilities capabilities;
  for (const ModelStack* stack : served_.stacks()) {
    SupportedModel model;
    model.model_name = stack->name();
    model.sampleable = true;
    const std::optional<ModelInfo> loaded = stack->supervisor().model_info();
    const int64_t context = loaded ? loaded->max_position_embeddings : 0;
    if (context > 0) model.max_context_length = context;
    capabilities.supported_models.push_back(std::move(model));
  }
  return capabilities;
}

absl::StatusOr<SessionHeartbeatResult> TinkerApi::SessionHeartbeat(const tenancy::Tenant& tenant,
                                                                   const SessionHeartbeatRequest& request) {
  const std::string& session = request.session_id;
  if (absl::Status s = served_.Heartbeat(ContextOf(tenant), session); !s.ok()) {
    absl::MutexLock lock(&mu_);
    if (finished_.contains(absl::StrCat(tenant.id, "\n", session))) {
      return Gone(absl::StrCat("session_id: session '", session, "' has finished"));
    }
    return s;
  }
  return SessionHeartbeatResult{};
}

absl::StatusOr<TrainingRunsResult> TinkerApi::ListTrainingRuns(const tenancy::Tenant& tenant,
                                                               const ListTrainingRunsRequest& request) {
  if (absl::Status s = CheckScope(request.access_scope); !s.ok()) return s;
  if (registry_ == nullptr) return NoRegistry();
  TrainingRunsResult result;
  result.cursor = {request.offset, request.limit, 0};
  if (request.access_scope != "accessible") {
    int32_t total = 0;
    absl::StatusOr<std::vector<registry::RunRecord>> runs =
        registry_->ListRuns(tenant.id, {request.limit, request.offset}, &total);
    if (!runs.ok()) return runs.status();
    for (const registry::RunRecord& r : *runs) {
      absl::StatusOr<TrainingRunInfo> run = OwnRun(*registry_, tenant.id, RunIdOf(ModelIdOf(r.run_id)));
      if (run.ok()) result.training_runs.push_back(*std::move(run));
    }
    result.cursor.total_count = total;
    return result;
  }
  absl::StatusOr<std::vector<TrainingRunInfo>> all = AccessibleRuns(*registry_, tenant.id);
  if (!all.ok()) return all.status();
  for (size_t i = static_cast<size_t>(request.offset);
       i < all->size() && result.training_runs.size() < static_cast<size_t>(request.limit); ++i) {
    result.training_runs.push_back(std::move((*all)[i]));
  }
  result.cursor.total_count = static_cast<int64_t>(all->size());
  return result;
}

absl::StatusOr<CheckpointsResult> TinkerApi::ListCheckpoints(const tenancy::Tenant& tenant,
                                                             const ListCheckpointsRequest& request) {
  if (absl::Status s = CheckScope(request.access_scope); !s.ok()) return s;
  if (registry_ == nullptr) return NoRegistry();
  const std::string run_id = RunIdOf(request.training_run_id);
  CheckpointsResult result;
  absl::StatusOr<std::vector<registry::CheckpointRecord>> own = registry_->ListCheckpoints(tenant.id, run_id);
  if (own.ok()) {
    for (const registry::CheckpointRecord& c : *own) result.checkpoints.push_back(CheckpointOf(c));
    return result;
  }
  if (request.access_scope != "accessible" || !absl::IsNotFound(own.status())) return own.status();
  absl::StatusOr<std::vector<registry::CheckpointRecord>> shared = registry_->PublishedCheckpointsOfOthers(tenant.id);
  if (!shared.ok()) return shared.status();
  for (const registry::CheckpointRecord& c : *shared) {
    if (c.run_id == run_id) result.checkpoints.push_back(CheckpointOf(c));
  }
  if (result.checkpoints.empty()) return own.status();  // the same NotFound as an unknown run
  return result;
}

absl::StatusOr<DeleteCheckpointResult> TinkerApi::DeleteCheckpoint(const tenancy::Tenant& tenant,
                                                                   const DeleteCheckpointRequest& request) {
  if (checkpoints_ == nullptr) return NoCheckpoints();
  if (absl::Status s = checkpoints_->Delete(tenant.id, RunIdOf(request.training_run_id), request.checkpoint_id);
      !s.ok()) {
    return s;
  }
  return DeleteCheckpointResult{};
}

}  // namespace twinkle::tinker
