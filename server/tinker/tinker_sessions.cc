// TinkerApi's session calls over the registry: CreateSession (tags, user_metadata,
// project_id, display_name stored), ListSessions, GetSession (its training runs and
// samplers), SearchSessions and SetSessionProject.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/sampling/sampler_coordinator.h"
#include "server/auth/audit.h"
#include "server/tinker/tinker_api.h"
#include "server/tinker/tinker_internal.h"
#include "server/tinker/tinker_json.h"

namespace twinkle::tinker {
namespace {


absl::Status CheckProjectId(const std::string& id, const char* field) {
  if (id.empty() || id.size() > kMaxProjectIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", id.size(), " bytes; a project id has 1 to ", kMaxProjectIdBytes));
  }
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
                    c == '-' || c == '.' || c == ':';
    if (!ok) return absl::InvalidArgumentError(absl::StrCat(field, ": only A-Z, a-z, 0-9, _ - . : are allowed"));
  }
  return absl::OkStatus();
}

Json MetadataJson(const std::string& stored) {
  if (stored.empty()) return nullptr;
  Json m = Json::parse(stored, nullptr, false);
  return m.is_object() ? m : Json(nullptr);
}

Json OptionalString(const std::string& s) { return s.empty() ? Json(nullptr) : Json(s); }

}  // namespace

absl::StatusOr<std::string> StoredMetadata(const Json& metadata) {
  if (metadata.is_null()) return std::string();
  std::string dumped = metadata.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (dumped.size() > kMaxUserMetadataBytes) {
    return absl::InvalidArgumentError(absl::StrCat("user_metadata: ", dumped.size(),
                                                   " bytes of JSON exceed the limit of ", kMaxUserMetadataBytes));
  }
  return dumped;
}

absl::StatusOr<CreateSessionResult> TinkerApi::CreateSession(const tenancy::Tenant& tenant,
                                                             const CreateSessionRequest& r) {
  // Everything is checked before the session exists.
  registry::SessionRecord meta;
  if (r.tags) {
    const std::vector<std::string>& tags = *r.tags;
    if (tags.size() > kMaxSessionTags) {
      return absl::InvalidArgumentError(
          absl::StrCat("tags: ", tags.size(), " tags, more than the limit of ", kMaxSessionTags));
    }
    for (size_t i = 0; i < tags.size(); ++i) {
      if (tags[i].size() > kMaxTagBytes) {
        return absl::InvalidArgumentError(
            absl::StrCat("tags[", i, "]: ", tags[i].size(), " bytes, more than the limit of ", kMaxTagBytes));
      }
    }
    meta.tags_json = Json(tags).dump(-1, ' ', false, Json::error_handler_t::replace);
  }
  absl::StatusOr<std::string> metadata = StoredMetadata(r.user_metadata);
  if (!metadata.ok()) return metadata.status();
  meta.user_metadata_json = *metadata;
  if (r.project_id) {
    meta.project_id = *r.project_id;
    if (absl::Status s = CheckProjectId(meta.project_id, "project_id"); !s.ok()) return s;
  }
  if (r.display_name) {
    meta.display_name = *r.display_name;
    if (meta.display_name.size() > kMaxDisplayNameBytes) {
      return absl::InvalidArgumentError(absl::StrCat("display_name: ", meta.display_name.size(),
                                                     " bytes, more than the limit of ", kMaxDisplayNameBytes));
    }
  }
  absl::StatusOr<std::string> created = served_.CreateSession(ContextOf(tenant));
  if (!created.ok()) return created.status();
  const std::string& id = *created;
  if (registry_ != nullptr) {
    meta.id = id;
    meta.tenant = tenant.id;
    meta.key_id = tenant.key_id;
    if (absl::Status s = registry_->SetSessionMetadata(meta); !s.ok()) return s;
    if (!meta.project_id.empty()) {
      if (absl::Status s = registry_->PutProject(tenant.id, meta.project_id, absl::Now()); !s.ok()) return s;
    }
  }
  return CreateSessionResult{id};
}

absl::StatusOr<Json> TinkerApi::ListSessions(const tenancy::Tenant& tenant, int32_t limit, int32_t offset) {
  if (registry_ == nullptr) return NoRegistry();
  int32_t total = 0;
  absl::StatusOr<std::vector<registry::SessionRecord>> rows =
      registry_->ListSessions(tenant.id, {std::min(limit, 1000), offset}, &total);
  if (!rows.ok()) return rows.status();
  std::vector<std::string> ids;
  for (const registry::SessionRecord& r : *rows) ids.push_back(r.id);
  return Json{{"sessions", ids}};
}

absl::StatusOr<Json> TinkerApi::GetSession(const tenancy::Tenant& tenant, const std::string& session_id) {
  if (registry_ == nullptr) return NoRegistry();
  absl::StatusOr<registry::SessionRecord> r = registry_->GetSession(session_id, tenant.id);
  if (!r.ok()) return r.status();
  std::vector<std::string> runs;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, m] : models_) {
      if (m->tenant == tenant.id && m->session_id == session_id) runs.push_back(m->model_id);
    }
  }
  std::sort(runs.begin(), runs.end());
  std::vector<std::string> samplers;
  for (ModelStack* m : served_.stacks()) {
    for (std::string& id : m->sampler().SessionsOwnedBy(tenant.id, session_id)) samplers.push_back(std::move(id));
  }
  Json tags = Json::parse(r->tags_json, nullptr, false);
  return Json{{"training_run_ids", runs},
              {"sampler_ids", samplers},
              {"user_metadata", MetadataJson(r->user_metadata_json)},
              {"display_name", OptionalString(r->display_name)},
              {"tags", tags.is_array() ? tags : Json::array()},
              {"project_id", OptionalString(r->project_id)}};
}

absl::StatusOr<Json> TinkerApi::SearchSessions(const tenancy::Tenant& tenant, const Json& body) {
  if (registry_ == nullptr) return NoRegistry();
  if (!body.is_object()) return absl::InvalidArgumentError("body: expected a SessionSearchRequest object");
  registry::SessionFilter filter;
  absl::StatusOr<int64_t> limit = GetInt(body, "limit", 50);
  if (!limit.ok()) return limit.status();
  if (*limit < 1 || *limit > kMaxSearchLimit) {
    return absl::InvalidArgumentError(absl::StrCat("limit: ", *limit, " is outside [1, ", kMaxSearchLimit, "]"));
  }
  absl::StatusOr<std::string> session = GetString(body, "session_id", "");
  if (!session.ok()) return session.status();
  filter.session_id = *session;
  absl::StatusOr<std::string> name = GetString(body, "display_name", "");
  if (!name.ok()) return name.status();
  if (name->size() > kMaxDisplayNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("display_name: more than ", kMaxDisplayNameBytes, " bytes"));
  }
  filter.display_name = *name;
  if (body.contains("project_ids") && !body["project_ids"].is_null()) {
    if (!body["project_ids"].is_array()) return absl::InvalidArgumentError("project_ids: expected a list");
    for (const Json& p : body["project_ids"]) {
      if (!p.is_string()) return absl::InvalidArgumentError("project_ids: expected strings");
      filter.project_ids.push_back(p.get<std::string>());
    }
  }
  if (body.contains("user_metadata") && !body["user_metadata"].is_null()) {
    if (!body["user_metadata"].is_object()) return absl::InvalidArgumentError("user_metadata: expected an object");
    for (const auto& [k, v] : body["user_metadata"].items()) {
      if (!v.is_string()) return absl::InvalidArgumentError(absl::StrCat("user_metadata.", k.substr(0, 64), ": expected a string"));
      filter.user_metadata.emplace_back(k, v.get<std::string>());
    }
  }
  if (body.contains("owner") && body["owner"].is_object()) {
    const std::string owner = body["owner"].value("type", "own");
    if (owner != "own" && owner != "accessible") {
      return absl::InvalidArgumentError(absl::StrCat("owner.type: '", owner.substr(0, 32), "' is not own or accessible"));
    }
  }
  if (body.contains("statuses") && !body["statuses"].is_null()) {
    if (!body["statuses"].is_array() || body["statuses"].empty()) {
      return absl::InvalidArgumentError("statuses: expected a non-empty list");
    }
    for (const Json& s : body["statuses"]) {
      const std::string type = s.is_object() ? s.value("type", "") : "";
      if (type != "active" && type != "client_finished" && type != "cancelled" && type != "failed") {
        return absl::InvalidArgumentError(absl::StrCat("statuses: unknown status type '", type.substr(0, 32), "'"));
      }
      filter.statuses.push_back(type);
    }
  }
  if (body.contains("cursor") && !body["cursor"].is_null()) {
    const Json& c = body["cursor"];
    if (!c.is_object() || !c.contains("last_created_at") || !c.contains("last_session_id") ||
        !c["last_created_at"].is_string() || !c["last_session_id"].is_string()) {
      return absl::InvalidArgumentError("cursor: expected {last_created_at, last_session_id} from next_cursor");
    }
    absl::Time at;
    std::string err;
    if (!absl::ParseTime(absl::RFC3339_full, c["last_created_at"].get<std::string>(), &at, &err)) {
      return absl::InvalidArgumentError(absl::StrCat("cursor.last_created_at: not an RFC 3339 time (", err, ")"));
    }
    filter.after = std::make_pair(at, c["last_session_id"].get<std::string>());
  }
  // One more than the page: whether a next page exists.
  absl::StatusOr<std::vector<registry::SessionRecord>> rows =
      registry_->SearchSessions(tenant.id, filter, static_cast<int32_t>(*limit) + 1);
  if (!rows.ok()) return rows.status();
  const bool more = static_cast<int64_t>(rows->size()) > *limit;
  if (more) rows->pop_back();
  Json sessions = Json::array();
  absl::StatusOr<std::vector<registry::RunRecord>> runs = registry_->ListRuns(tenant.id, {1 << 20, 0}, nullptr);
  for (const registry::SessionRecord& r : *rows) {
    int64_t checkpoints = 0, bytes = 0;
    if (runs.ok()) {
      const std::string prefix = absl::StrCat(r.id, "-");
      for (const registry::RunRecord& run : *runs) {
        if (run.run_id.rfind(prefix, 0) != 0) continue;
        absl::StatusOr<std::vector<registry::CheckpointRecord>> cks = registry_->ListCheckpoints(tenant.id, run.run_id);
        if (!cks.ok()) continue;
        for (const registry::CheckpointRecord& c : *cks) {
          ++checkpoints;
          bytes += c.size_bytes;
        }
      }
    }
    Json status = r.finished == absl::InfinitePast()
                      ? Json{{"type", "active"}}
                      : Json{{"type", "client_finished"}, {"reason", {{"type", "success"}}}};
    sessions.push_back({{"session_id", r.id},
                        {"created_at", IsoTime(r.created)},
                        {"owner", tenant.id},
                        {"project_id", r.project_id},
                        {"status", status},
                        {"checkpoints_count", checkpoints},
                        {"checkpoint_storage_bytes", bytes},
                        {"display_name", OptionalString(r.display_name)},
                        {"user_metadata", MetadataJson(r.user_metadata_json)}});
  }
  Json next = nullptr;
  if (more && !rows->empty()) {
    next = {{"last_created_at", IsoTime(rows->back().created)}, {"last_session_id", rows->back().id}};
  }
  return Json{{"sessions", std::move(sessions)}, {"next_cursor", std::move(next)}};
}

absl::StatusOr<Json> TinkerApi::SetSessionProject(const tenancy::Tenant& tenant, const std::string& session_id,
                                                  const Json& body, const std::string& peer) {
  if (registry_ == nullptr) return NoRegistry();
  if (!body.is_object() || !body.contains("project_id") || !body["project_id"].is_string()) {
    return absl::InvalidArgumentError("project_id: required (a string)");
  }
  const std::string project = body["project_id"].get<std::string>();
  if (absl::Status s = CheckProjectId(project, "project_id"); !s.ok()) return s;
  if (absl::Status s = registry_->SetSessionProject(session_id, tenant.id, project); !s.ok()) return s;
  if (absl::Status s = registry_->PutProject(tenant.id, project, absl::Now()); !s.ok()) return s;
  if (absl::Status s = Audit(*registry_, tenant, "session_project_set", absl::StrCat("session:", session_id), peer,
                             {{"project_id", project}});
      !s.ok()) {
    return s;
  }
  return Json::object();
}

std::string TinkerApi::TraceSessionOf(const tenancy::Tenant& tenant, const Json& body) {
  if (!body.is_object()) return std::string();
  if (auto it = body.find("session_id"); it != body.end() && it->is_string()) return it->get<std::string>();
  if (auto it = body.find("model_id"); it != body.end() && it->is_string()) {
    const std::string& model = it->get_ref<const std::string&>();
    const size_t colon = model.find(":train:");
    if (colon != std::string::npos) return model.substr(0, colon);
  }
  if (auto it = body.find("sampling_session_id"); it != body.end() && it->is_string()) {
    if (ModelStack* m = served_.OfSamplingSession(tenant.id, it->get<std::string>())) {
      absl::StatusOr<sampling::SamplingSessionInfo> info = m->sampler().GetSession(ContextOf(tenant), it->get<std::string>());
      if (info.ok()) return info->owner;
    }
  }
  return std::string();
}

absl::StatusOr<Json> TinkerApi::TraceExport(const tenancy::Tenant& tenant, const std::string& session_id) {
  if (registry_ == nullptr) return NoRegistry();
  if (absl::StatusOr<registry::SessionRecord> r = registry_->GetSession(session_id, tenant.id); !r.ok()) {
    return r.status();
  }
  Json events = Json::array();
  for (const TraceEvent& e : traces_.Events(tenant.id, session_id)) {
    events.push_back({{"name", e.route},
                      {"ph", "X"},
                      {"ts", absl::ToUnixMicros(e.start)},
                      {"dur", absl::ToInt64Microseconds(e.duration)},
                      {"pid", 1},
                      {"tid", 1},
                      {"args", {{"request_bytes", e.request_bytes}, {"response_bytes", e.response_bytes},
                                {"status", e.status}}}});
  }
  const Json trace = {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"},
                      {"otherData", {{"session_id", session_id}}}};
  return Json{{"status", "ready"},
              {"url", absl::StrCat("data:application/json;base64,",
                                   absl::Base64Escape(trace.dump(-1, ' ', false, Json::error_handler_t::replace)))}};
}

}  // namespace twinkle::tinker
