// Registry's sessions table: PutSession, TouchSession, GetSession, DeleteSession and (v3) the
// session metadata: SetSessionMetadata, SetSessionProject, FinishSession, ListSessions,
// SearchSessions; (v5) the open sampling sessions: PutSamplingSession, DeleteSamplingSession,
// ListSamplingSessions.
#include "core/registry/registry.h"

#include <sqlite3.h>

#include <algorithm>

#include <nlohmann/json.hpp>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "core/registry/registry_internal.h"

namespace twinkle::registry {

using registry_internal::FromMicros;
using registry_internal::Micros;
using registry_internal::NonEmpty;
using registry_internal::Stmt;

namespace {

absl::Status SessionNotFound(const std::string& id) {
  return absl::NotFoundError(absl::StrCat("session '", id, "' not found"));
}

constexpr char kSessionColumns[] =
    "id, tenant, created_us, last_heartbeat_us, tags_json, user_metadata_json, project_id, display_name, key_id, "
    "finished_us";

SessionRecord ReadSession(const Stmt& st) {
  SessionRecord r;
  r.id = st.Text(0);
  r.tenant = st.Text(1);
  r.created = FromMicros(st.Int(2));
  r.last_heartbeat = FromMicros(st.Int(3));
  r.tags_json = st.Text(4);
  r.user_metadata_json = st.Text(5);
  r.project_id = st.Text(6);
  r.display_name = st.Text(7);
  r.key_id = st.Int(8);
  const int64_t finished = st.Int(9);
  r.finished = finished == 0 ? absl::InfinitePast() : FromMicros(finished);
  return r;
}

// user_metadata pairs must be string members of the stored object, equal byte for byte.
bool MatchesFilter(const SessionRecord& r, const SessionFilter& f) {
  const bool want_id = !f.session_id.empty(), want_name = !f.display_name.empty();
  if (want_id || want_name) {
    bool hit = want_id && r.id == f.session_id;
    if (!hit && want_name) {
      const std::string name = absl::AsciiStrToLower(r.display_name);
      hit = !name.empty();
      for (absl::string_view word : absl::StrSplit(absl::AsciiStrToLower(f.display_name), ' ', absl::SkipEmpty())) {
        hit = hit && absl::StrContains(name, word);
      }
    }
    if (!hit) return false;
  }
  if (!f.project_ids.empty() &&
      std::find(f.project_ids.begin(), f.project_ids.end(), r.project_id) == f.project_ids.end()) {
    return false;
  }
  if (!f.user_metadata.empty()) {
    const nlohmann::json meta = nlohmann::json::parse(r.user_metadata_json, nullptr, /*allow_exceptions=*/false);
    if (!meta.is_object()) return false;
    for (const auto& [key, value] : f.user_metadata) {
      auto it = meta.find(key);
      if (it == meta.end() || !it->is_string() || it->get_ref<const std::string&>() != value) return false;
    }
  }
  if (!f.statuses.empty()) {
    const std::string status = r.finished == absl::InfinitePast() ? "active" : "client_finished";
    if (std::find(f.statuses.begin(), f.statuses.end(), status) == f.statuses.end()) return false;
  }
  return true;
}

}  // namespace

absl::Status Registry::PutSession(const std::string& id, const std::string& tenant, absl::Time now) {
  if (absl::Status s = NonEmpty(id, "session id"); !s.ok()) return s;
  if (absl::Status s = NonEmpty(tenant, "tenant"); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_,
          "INSERT INTO sessions (id, tenant, created_us, last_heartbeat_us) VALUES (?, ?, ?, ?) "
          "ON CONFLICT (id) DO UPDATE SET last_heartbeat_us = excluded.last_heartbeat_us "
          "WHERE sessions.tenant = excluded.tenant");
  st.Bind(id).Bind(tenant).Bind(Micros(now)).Bind(Micros(now));
  if (absl::Status s = st.Run("put session"); !s.ok()) return s;
  if (sqlite3_changes64(db_) == 0) {
    return absl::AlreadyExistsError(absl::StrCat("session '", id, "' already exists"));
  }
  return absl::OkStatus();
}

absl::Status Registry::TouchSession(const std::string& id, const std::string& tenant, absl::Time now) {
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_, "UPDATE sessions SET last_heartbeat_us = ? WHERE id = ? AND tenant = ?");
  st.Bind(Micros(now)).Bind(id).Bind(tenant);
  if (absl::Status s = st.Run("touch session"); !s.ok()) return s;
  if (sqlite3_changes64(db_) == 0) return SessionNotFound(id);
  return absl::OkStatus();
}

absl::StatusOr<SessionRecord> Registry::GetSession(const std::string& id, const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  const std::string sql = absl::StrCat("SELECT ", kSessionColumns, " FROM sessions WHERE id = ? AND tenant = ?");
  Stmt st(db_, path_, sql.c_str());
  st.Bind(id).Bind(tenant);
  absl::StatusOr<bool> row = st.Step("get session");
  if (!row.ok()) return row.status();
  if (!*row) return SessionNotFound(id);
  return ReadSession(st);
}

absl::Status Registry::SetSessionMetadata(const SessionRecord& m) {
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_,
          "UPDATE sessions SET tags_json = ?, user_metadata_json = ?, project_id = ?, display_name = ?, key_id = ? "
          "WHERE id = ? AND tenant = ?");
  st.Bind(m.tags_json).Bind(m.user_metadata_json).Bind(m.project_id).Bind(m.display_name).Bind(m.key_id);
  st.Bind(m.id).Bind(m.tenant);
  if (absl::Status s = st.Run("set session metadata"); !s.ok()) return s;
  if (sqlite3_changes64(db_) == 0) return SessionNotFound(m.id);
  return absl::OkStatus();
}

absl::Status Registry::SetSessionProject(const std::string& id, const std::string& tenant,
                                         const std::string& project_id) {
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_, "UPDATE sessions SET project_id = ? WHERE id = ? AND tenant = ?");
  st.Bind(project_id).Bind(id).Bind(tenant);
  if (absl::Status s = st.Run("set session project"); !s.ok()) return s;
  if (sqlite3_changes64(db_) == 0) return SessionNotFound(id);
  return absl::OkStatus();
}

absl::Status Registry::FinishSession(const std::string& id, const std::string& tenant, absl::Time now) {
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_, "UPDATE sessions SET finished_us = ? WHERE id = ? AND tenant = ? AND finished_us = 0");
  st.Bind(Micros(now)).Bind(id).Bind(tenant);
  return st.Run("finish session");
}

absl::StatusOr<std::vector<SessionRecord>> Registry::ListSessions(const std::string& tenant, Page page,
                                                                  int32_t* total) {
  if (page.limit < 0 || page.offset < 0) return absl::InvalidArgumentError("limit and offset must be >= 0");
  absl::MutexLock lock(&mu_);
  registry_internal::Txn txn(db_, path_);
  if (absl::Status s = txn.Begin(/*write=*/false); !s.ok()) return s;
  if (total != nullptr) {
    Stmt count(db_, path_, "SELECT COUNT(*) FROM sessions WHERE tenant = ?");
    count.Bind(tenant);
    absl::StatusOr<bool> row = count.Step("count sessions");
    if (!row.ok()) return row.status();
    *total = *row ? static_cast<int32_t>(count.Int(0)) : 0;
  }
  const std::string sql = absl::StrCat("SELECT ", kSessionColumns,
                                       " FROM sessions WHERE tenant = ? ORDER BY created_us DESC, id DESC "
                                       "LIMIT ? OFFSET ?");
  Stmt st(db_, path_, sql.c_str());
  st.Bind(tenant).Bind(int64_t{page.limit}).Bind(int64_t{page.offset});
  std::vector<SessionRecord> out;
  for (;;) {
    absl::StatusOr<bool> row = st.Step("list sessions");
    if (!row.ok()) return row.status();
    if (!*row) break;
    out.push_back(ReadSession(st));
  }
  if (absl::Status s = txn.Commit(); !s.ok()) return s;
  return out;
}

absl::StatusOr<std::vector<SessionRecord>> Registry::SearchSessions(const std::string& tenant,
                                                                    const SessionFilter& filter, int32_t limit) {
  if (limit < 0) return absl::InvalidArgumentError("limit must be >= 0");
  absl::MutexLock lock(&mu_);
  // The cursor narrows in SQL; the other filters are checked per row (a tenant's sessions are
  // few next to what one page scan costs).
  const std::string sql =
      absl::StrCat("SELECT ", kSessionColumns,
                   " FROM sessions WHERE tenant = ? AND (? = 0 OR created_us < ? OR (created_us = ? AND id < ?)) "
                   "ORDER BY created_us DESC, id DESC");
  Stmt st(db_, path_, sql.c_str());
  const int64_t cursor_us = filter.after ? Micros(filter.after->first) : 0;
  st.Bind(tenant).Bind(int64_t{filter.after ? 1 : 0}).Bind(cursor_us).Bind(cursor_us);
  st.Bind(filter.after ? filter.after->second : std::string());
  std::vector<SessionRecord> out;
  while (static_cast<int32_t>(out.size()) < limit) {
    absl::StatusOr<bool> row = st.Step("search sessions");
    if (!row.ok()) return row.status();
    if (!*row) break;
    SessionRecord r = ReadSession(st);
    if (MatchesFilter(r, filter)) out.push_back(std::move(r));
  }
  return out;
}

absl::Status Registry::DeleteSession(const std::string& id, const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_, "DELETE FROM sessions WHERE id = ? AND tenant = ?");
  st.Bind(id).Bind(tenant);
  if (absl::Status s = st.Run("delete session"); !s.ok()) return s;
  if (sqlite3_changes64(db_) == 0) return SessionNotFound(id);
  return absl::OkStatus();
}

absl::Status Registry::PutSamplingSession(const SamplingSessionRecord& r) {
  if (r.id.empty() || r.tenant.empty()) return absl::InvalidArgumentError("sampling session: empty id or tenant");
  absl::MutexLock lock(&mu_);
  // Only the owning tenant's row may be replaced: ON CONFLICT ... WHERE leaves another's as it was.
  Stmt st(db_, path_,
          "INSERT INTO sampling_sessions (id, tenant, model_path, owner, live, created_us, base_model) "
          "VALUES (?, ?, ?, ?, ?, ?, ?) "
          "ON CONFLICT(id) DO UPDATE SET model_path = excluded.model_path, owner = excluded.owner, "
          "live = excluded.live, created_us = excluded.created_us, base_model = excluded.base_model "
          "WHERE tenant = excluded.tenant");
  st.Bind(r.id).Bind(r.tenant).Bind(r.model_path).Bind(r.owner).Bind(int64_t{r.live ? 1 : 0}).Bind(Micros(r.created));
  st.Bind(r.base_model);
  if (absl::Status s = st.Run("put sampling session"); !s.ok()) return s;
  if (sqlite3_changes64(db_) == 0) {
    return absl::AlreadyExistsError(absl::StrCat("sampling session '", r.id, "' already exists"));
  }
  return absl::OkStatus();
}

absl::Status Registry::DeleteSamplingSession(const std::string& id, const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_, "DELETE FROM sampling_sessions WHERE id = ? AND tenant = ?");
  st.Bind(id).Bind(tenant);
  return st.Run("delete sampling session");
}

absl::StatusOr<std::vector<SamplingSessionRecord>> Registry::ListSamplingSessions() {
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_,
          "SELECT id, tenant, model_path, owner, live, created_us, base_model FROM sampling_sessions "
          "ORDER BY created_us, id");
  std::vector<SamplingSessionRecord> out;
  for (;;) {
    absl::StatusOr<bool> row = st.Step("list sampling sessions");
    if (!row.ok()) return row.status();
    if (!*row) break;
    SamplingSessionRecord r;
    r.id = st.Text(0);
    r.tenant = st.Text(1);
    r.model_path = st.Text(2);
    r.owner = st.Text(3);
    r.live = st.Int(4) != 0;
    r.created = FromMicros(st.Int(5));
    r.base_model = st.Text(6);
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace twinkle::registry
