// Registry's sessions table: PutSession, TouchSession, GetSession and DeleteSession.
#include "core/registry/registry.h"

#include <sqlite3.h>

#include <string>

#include "absl/strings/str_cat.h"
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
  Stmt st(db_, path_,
          "SELECT id, tenant, created_us, last_heartbeat_us FROM sessions WHERE id = ? AND tenant = ?");
  st.Bind(id).Bind(tenant);
  absl::StatusOr<bool> row = st.Step("get session");
  if (!row.ok()) return row.status();
  if (!*row) return SessionNotFound(id);
  SessionRecord r;
  r.id = st.Text(0);
  r.tenant = st.Text(1);
  r.created = FromMicros(st.Int(2));
  r.last_heartbeat = FromMicros(st.Int(3));
  return r;
}

absl::Status Registry::DeleteSession(const std::string& id, const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_, "DELETE FROM sessions WHERE id = ? AND tenant = ?");
  st.Bind(id).Bind(tenant);
  if (absl::Status s = st.Run("delete session"); !s.ok()) return s;
  if (sqlite3_changes64(db_) == 0) return SessionNotFound(id);
  return absl::OkStatus();
}

}  // namespace twinkle::registry
