// Registry's tenants, api_keys and projects tables (schema v3): the runtime key set. Keys are
// stored as SHA-256 digests only; key ids are never reused (AUTOINCREMENT).
#include <sqlite3.h>

#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/registry/registry.h"
#include "core/registry/registry_internal.h"

namespace twinkle::registry {

using registry_internal::FromMicros;
using registry_internal::Micros;
using registry_internal::NonEmpty;
using registry_internal::Stmt;
using registry_internal::Txn;

namespace {

constexpr char kKeyColumns[] = "key_id, tenant, key_sha256, role, name, source, created_us, revoked_us";

ApiKeyRecord ReadKey(const Stmt& st) {
  ApiKeyRecord k;
  k.key_id = st.Int(0);
  k.tenant = st.Text(1);
  k.key_sha256 = st.Text(2);
  k.role = st.Text(3);
  k.name = st.Text(4);
  k.source = st.Text(5);
  k.created = FromMicros(st.Int(6));
  const int64_t revoked = st.Int(7);
  k.revoked = revoked == 0 ? absl::InfinitePast() : FromMicros(revoked);
  return k;
}

absl::Status KeyNotFound(int64_t key_id) { return absl::NotFoundError(absl::StrCat("API key ", key_id, " not found")); }

absl::Status CheckRole(const std::string& role) {
  if (role == "admin" || role == "member" || role == "read-only") return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("role '", role.substr(0, 64), "' is not one of admin, member, read-only"));
}

}  // namespace

absl::Status Registry::PutTenant(const std::string& id, const std::string& source, absl::Time now) {
  if (absl::Status s = NonEmpty(id, "tenant"); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_, "INSERT INTO tenants (id, source, created_us) VALUES (?, ?, ?) ON CONFLICT (id) DO NOTHING");
  st.Bind(id).Bind(source).Bind(Micros(now));
  return st.Run("put tenant");
}

absl::StatusOr<std::vector<TenantRecord>> Registry::ListTenants() {
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_, "SELECT id, source, created_us FROM tenants ORDER BY id");
  std::vector<TenantRecord> out;
  for (;;) {
    absl::StatusOr<bool> row = st.Step("list tenants");
    if (!row.ok()) return row.status();
    if (!*row) return out;
    out.push_back({st.Text(0), st.Text(1), FromMicros(st.Int(2))});
  }
}

absl::Status Registry::BootstrapConfigKeys(const std::vector<ApiKeyRecord>& keys, absl::Time now) {
  absl::MutexLock lock(&mu_);
  Txn txn(db_, path_);
  if (absl::Status s = txn.Begin(/*write=*/true); !s.ok()) return s;
  absl::flat_hash_set<std::string> listed;
  for (const ApiKeyRecord& k : keys) {
    if (absl::Status s = CheckRole(k.role); !s.ok()) return s;
    listed.insert(k.key_sha256);
    {
      Stmt t(db_, path_, "INSERT INTO tenants (id, source, created_us) VALUES (?, 'config', ?) ON CONFLICT (id) DO NOTHING");
      t.Bind(k.tenant).Bind(Micros(now));
      if (absl::Status s = t.Run("bootstrap tenant"); !s.ok()) return s;
    }
    Stmt st(db_, path_,
            "INSERT INTO api_keys (tenant, key_sha256, role, name, source, created_us) VALUES (?, ?, ?, ?, 'config', ?) "
            "ON CONFLICT (key_sha256) DO UPDATE SET tenant = excluded.tenant, role = excluded.role "
            "WHERE api_keys.source = 'config'");
    st.Bind(k.tenant).Bind(k.key_sha256).Bind(k.role).Bind(k.name).Bind(Micros(now));
    if (absl::Status s = st.Run("bootstrap key"); !s.ok()) return s;
  }
  // Config keys no longer in the config are revoked.
  std::vector<int64_t> stale;
  {
    Stmt st(db_, path_, "SELECT key_id, key_sha256 FROM api_keys WHERE source = 'config' AND revoked_us = 0");
    for (;;) {
      absl::StatusOr<bool> row = st.Step("list config keys");
      if (!row.ok()) return row.status();
      if (!*row) break;
      if (!listed.contains(st.Text(1))) stale.push_back(st.Int(0));
    }
  }
  for (int64_t id : stale) {
    Stmt st(db_, path_, "UPDATE api_keys SET revoked_us = ? WHERE key_id = ?");
    st.Bind(Micros(now)).Bind(id);
    if (absl::Status s = st.Run("revoke removed config key"); !s.ok()) return s;
  }
  return txn.Commit();
}

absl::StatusOr<ApiKeyRecord> Registry::InsertKey(ApiKeyRecord key) {
  if (absl::Status s = NonEmpty(key.tenant, "tenant"); !s.ok()) return s;
  if (absl::Status s = CheckRole(key.role); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  Txn txn(db_, path_);
  if (absl::Status s = txn.Begin(/*write=*/true); !s.ok()) return s;
  {
    Stmt t(db_, path_, "SELECT 1 FROM tenants WHERE id = ?");
    t.Bind(key.tenant);
    absl::StatusOr<bool> row = t.Step("find tenant");
    if (!row.ok()) return row.status();
    if (!*row) return absl::NotFoundError(absl::StrCat("tenant '", key.tenant, "' not found"));
  }
  {
    Stmt d(db_, path_, "SELECT 1 FROM api_keys WHERE key_sha256 = ?");
    d.Bind(key.key_sha256);
    absl::StatusOr<bool> row = d.Step("find key digest");
    if (!row.ok()) return row.status();
    if (*row) return absl::AlreadyExistsError("an API key with this digest already exists");
  }
  Stmt st(db_, path_,
          "INSERT INTO api_keys (tenant, key_sha256, role, name, source, created_us) VALUES (?, ?, ?, ?, ?, ?)");
  st.Bind(key.tenant).Bind(key.key_sha256).Bind(key.role).Bind(key.name).Bind(key.source).Bind(Micros(key.created));
  if (absl::Status s = st.Run("insert key"); !s.ok()) return s;
  key.key_id = sqlite3_last_insert_rowid(db_);
  key.revoked = absl::InfinitePast();
  if (absl::Status s = txn.Commit(); !s.ok()) return s;
  return key;
}

absl::StatusOr<std::vector<ApiKeyRecord>> Registry::ListKeys(const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  const std::string sql =
      absl::StrCat("SELECT ", kKeyColumns, " FROM api_keys WHERE ? = '' OR tenant = ? ORDER BY key_id");
  Stmt st(db_, path_, sql.c_str());
  st.Bind(tenant).Bind(tenant);
  std::vector<ApiKeyRecord> out;
  for (;;) {
    absl::StatusOr<bool> row = st.Step("list keys");
    if (!row.ok()) return row.status();
    if (!*row) return out;
    out.push_back(ReadKey(st));
  }
}

absl::StatusOr<ApiKeyRecord> Registry::GetKey(int64_t key_id) {
  absl::MutexLock lock(&mu_);
  const std::string sql = absl::StrCat("SELECT ", kKeyColumns, " FROM api_keys WHERE key_id = ?");
  Stmt st(db_, path_, sql.c_str());
  st.Bind(key_id);
  absl::StatusOr<bool> row = st.Step("get key");
  if (!row.ok()) return row.status();
  if (!*row) return KeyNotFound(key_id);
  return ReadKey(st);
}

absl::StatusOr<ApiKeyRecord> Registry::RevokeKey(int64_t key_id, absl::Time now) {
  {
    absl::MutexLock lock(&mu_);
    Stmt st(db_, path_, "UPDATE api_keys SET revoked_us = ? WHERE key_id = ? AND revoked_us = 0");
    st.Bind(Micros(now)).Bind(key_id);
    if (absl::Status s = st.Run("revoke key"); !s.ok()) return s;
  }
  return GetKey(key_id);
}

absl::StatusOr<ApiKeyRecord> Registry::SetKeyRole(int64_t key_id, const std::string& role) {
  if (absl::Status s = CheckRole(role); !s.ok()) return s;
  {
    absl::MutexLock lock(&mu_);
    Stmt st(db_, path_, "UPDATE api_keys SET role = ? WHERE key_id = ?");
    st.Bind(role).Bind(key_id);
    if (absl::Status s = st.Run("set key role"); !s.ok()) return s;
    if (sqlite3_changes64(db_) == 0) return KeyNotFound(key_id);
  }
  return GetKey(key_id);
}

absl::StatusOr<ApiKeyRecord> Registry::RotateKey(int64_t key_id, const std::string& new_sha256, absl::Time now) {
  absl::MutexLock lock(&mu_);
  Txn txn(db_, path_);
  if (absl::Status s = txn.Begin(/*write=*/true); !s.ok()) return s;
  ApiKeyRecord old;
  {
    const std::string sql = absl::StrCat("SELECT ", kKeyColumns, " FROM api_keys WHERE key_id = ?");
    Stmt st(db_, path_, sql.c_str());
    st.Bind(key_id);
    absl::StatusOr<bool> row = st.Step("get key");
    if (!row.ok()) return row.status();
    if (!*row) return KeyNotFound(key_id);
    old = ReadKey(st);
  }
  if (!old.active()) return absl::FailedPreconditionError(absl::StrCat("API key ", key_id, " is revoked"));
  {
    Stmt st(db_, path_, "UPDATE api_keys SET revoked_us = ? WHERE key_id = ?");
    st.Bind(Micros(now)).Bind(key_id);
    if (absl::Status s = st.Run("revoke rotated key"); !s.ok()) return s;
  }
  ApiKeyRecord fresh = old;
  fresh.key_sha256 = new_sha256;
  fresh.source = "admin";
  fresh.created = now;
  fresh.revoked = absl::InfinitePast();
  Stmt st(db_, path_,
          "INSERT INTO api_keys (tenant, key_sha256, role, name, source, created_us) VALUES (?, ?, ?, ?, ?, ?)");
  st.Bind(fresh.tenant).Bind(fresh.key_sha256).Bind(fresh.role).Bind(fresh.name).Bind(fresh.source);
  st.Bind(Micros(now));
  if (absl::Status s = st.Run("insert rotated key"); !s.ok()) return s;
  fresh.key_id = sqlite3_last_insert_rowid(db_);
  if (absl::Status s = txn.Commit(); !s.ok()) return s;
  return fresh;
}

absl::Status Registry::PutProject(const std::string& tenant, const std::string& project_id, absl::Time now) {
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_,
          "INSERT INTO projects (tenant, project_id, created_us) VALUES (?, ?, ?) "
          "ON CONFLICT (tenant, project_id) DO NOTHING");
  st.Bind(tenant).Bind(project_id).Bind(Micros(now));
  return st.Run("put project");
}

}  // namespace twinkle::registry
