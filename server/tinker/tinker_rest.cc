// TinkerApi's direct calls that involve no training op: the client configuration
// (ClientConfig, DynamicConfig, Capabilities, Telemetry), sessions (CreateSession,
// SessionHeartbeat, FinishSession; the rest is in tinker_sessions.cc) and the REST listings of training runs and
// checkpoints over the run registry (ListTrainingRuns, GetTrainingRun, ListCheckpoints,
// ListUserCheckpoints, DeleteCheckpoint).
#include "server/tinker/tinker_api.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/sampling/sampler_coordinator.h"
#include "server/tinker/tinker_internal.h"
#include "server/tinker/tinker_json.h"

namespace twinkle::tinker {

// ---- configuration and sessions --------------------------------------------------------------

Json TinkerApi::ClientConfig() const {
  return {{"pjwt_auth_enabled", options_.jwt_auth},
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

Json TinkerApi::Telemetry(const Json&) const { return {{"status", "accepted"}}; }

absl::StatusOr<Json> TinkerApi::FinishSession(const tenancy::Tenant& tenant, const std::string& session_id) {
  const training::TenantContext context = ContextOf(tenant);
  if (!served_.SessionAlive(tenant.id, session_id)) return Json{{"session_id", session_id}};
  for (ModelStack* m : served_.stacks()) m->sampler().CloseOwnedBy(context, session_id);
  {
    absl::MutexLock lock(&mu_);
    if (finished_.insert(absl::StrCat(tenant.id, "\n", session_id)).second) {
      finished_order_.push_back(absl::StrCat(tenant.id, "\n", session_id));
      if (finished_order_.size() > 4096) {
        finished_.erase(finished_order_.front());
        finished_order_.pop_front();
      }
    }
    if (registry_ != nullptr) (void)registry_->FinishSession(session_id, tenant.id, absl::Now());
    for (auto it = models_.begin(); it != models_.end();) {
      auto next = std::next(it);
      if (it->second->tenant == tenant.id && it->second->session_id == session_id) models_.erase(it);
      it = next;
    }
  }
  // Releasing the adapters waits for the engine: not on a transport thread.
  blocking_->Post([this, context, session_id] { (void)served_.EndSession(context, session_id); });
  return Json{{"session_id", session_id}};
}

// ---- REST ------------------------------------------------------------------------------------

std::string IsoTime(absl::Time t) { return absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", t, absl::UTCTimeZone()); }

Json CheckpointJson(const registry::CheckpointRecord& c) {
  return {{"checkpoint_id", c.checkpoint_id},
          {"checkpoint_type", c.kind},
          {"time", IsoTime(c.created)},
          {"tinker_path", TinkerPathOf(c.run_id, c.checkpoint_id)},
          {"size_bytes", c.size_bytes},
          {"public", c.published},
          {"expires_at", c.expires ? Json(IsoTime(*c.expires)) : Json(nullptr)}};
}

Json RunJson(const registry::RunRecord& r, const std::vector<registry::CheckpointRecord>& checkpoints) {
  Json lora = Json::parse(r.lora_config_json, nullptr, false);
  Json run = {{"training_run_id", ModelIdOf(r.run_id)},
              {"base_model", r.base_model},
              {"model_owner", r.tenant},
              {"is_lora", true},
              {"corrupted", false},
              {"lora_rank", lora.is_object() && lora.contains("r") ? lora["r"] : Json(nullptr)},
              {"last_request_time", IsoTime(r.last_request)},
              {"last_checkpoint", nullptr},
              {"last_sampler_checkpoint", nullptr},
              {"user_metadata", nullptr}};
  if (!r.user_metadata_json.empty()) {
    Json metadata = Json::parse(r.user_metadata_json, nullptr, false);
    if (metadata.is_object()) run["user_metadata"] = std::move(metadata);
  }
  for (const registry::CheckpointRecord& c : checkpoints) {  // oldest first: the last one wins
    if (c.kind == "training") run["last_checkpoint"] = CheckpointJson(c);
    if (c.kind == "sampler") run["last_sampler_checkpoint"] = CheckpointJson(c);
  }
  return run;
}

absl::StatusOr<Json> TinkerApi::GetTrainingRun(const tenancy::Tenant& tenant, const std::string& model_id) {
  if (registry_ == nullptr) return NoRegistry();
  const std::string run_id = RunIdOf(model_id);
  absl::StatusOr<registry::RunRecord> r = registry_->GetRun(tenant.id, run_id);
  if (!r.ok()) return r.status();
  absl::StatusOr<std::vector<registry::CheckpointRecord>> cks = registry_->ListCheckpoints(tenant.id, run_id);
  return RunJson(*r, cks.ok() ? *cks : std::vector<registry::CheckpointRecord>{});
}

absl::StatusOr<Json> TinkerApi::ListUserCheckpoints(const tenancy::Tenant& tenant, int32_t limit, int32_t offset) {
  if (registry_ == nullptr) return NoRegistry();
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

}  // namespace twinkle::tinker
