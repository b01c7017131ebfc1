// Registry: opening the database file (its checks and connection settings), the schema as
// an append-only list of migrations, and closing. The tables' reads and writes are in
// registry_sessions.cc, registry_runs.cc and registry_futures.cc.
#include "core/registry/registry.h"

#include <sqlite3.h>

#include <array>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/registry/registry_internal.h"

namespace twinkle::registry {

using registry_internal::Exec;
using registry_internal::SqlError;
using registry_internal::Stmt;
using registry_internal::Txn;

namespace {

// Migrations: kMigrations[v] takes a file from user_version v to v + 1. Each runs in its own
// transaction together with the user_version bump. Append only; never edit a shipped entry.
// (foreign_keys is on and cannot change inside a transaction: a future migration that
// rebuilds a referenced table must keep its keys intact.)
constexpr std::array<const char*, 6> kMigrations = {
    // v0 → v1: the initial schema.
    R"sql(
CREATE TABLE sessions (
  id                TEXT    NOT NULL PRIMARY KEY,
  tenant            TEXT    NOT NULL,
  created_us        INTEGER NOT NULL,
  last_heartbeat_us INTEGER NOT NULL
);
CREATE INDEX sessions_by_tenant ON sessions(tenant);

CREATE TABLE runs (
  run_id           TEXT    NOT NULL PRIMARY KEY,
  tenant           TEXT    NOT NULL,
  adapter_name     TEXT    NOT NULL,
  base_model       TEXT    NOT NULL,
  lora_config_json TEXT    NOT NULL,
  created_us       INTEGER NOT NULL,
  last_request_us  INTEGER NOT NULL,
  last_step        INTEGER NOT NULL
);
-- The parent key of checkpoints' foreign key (so a checkpoint's tenant is its run's).
CREATE UNIQUE INDEX runs_tenant_run ON runs(tenant, run_id);
CREATE INDEX runs_by_tenant_created ON runs(tenant, created_us, run_id);

CREATE TABLE checkpoints (
  tenant        TEXT    NOT NULL,
  run_id        TEXT    NOT NULL,
  checkpoint_id TEXT    NOT NULL,
  kind          TEXT    NOT NULL CHECK (kind IN ('training', 'sampler')),
  path          TEXT    NOT NULL,
  size_bytes    INTEGER NOT NULL,
  created_us    INTEGER NOT NULL,
  PRIMARY KEY (tenant, run_id, checkpoint_id),
  FOREIGN KEY (tenant, run_id) REFERENCES runs(tenant, run_id) ON DELETE CASCADE
) WITHOUT ROWID;

CREATE TABLE futures (
  id            INTEGER NOT NULL PRIMARY KEY,
  tenant        TEXT    NOT NULL,
  state         TEXT    NOT NULL CHECK (state IN ('pending', 'done', 'failed', 'interrupted')),
  result        BLOB    NOT NULL,
  error_code    INTEGER NOT NULL,
  error_message TEXT    NOT NULL,
  created_us    INTEGER NOT NULL,
  updated_us    INTEGER NOT NULL
);
CREATE INDEX futures_by_state_updated ON futures(state, updated_us);

CREATE TABLE counters (
  name  TEXT    NOT NULL PRIMARY KEY,
  value INTEGER NOT NULL
) WITHOUT ROWID;
INSERT INTO counters(name, value) VALUES ('max_future_id', 0);
)sql",
    // v1 → v2: Tinker's run user_metadata (a JSON object; '' = none).
    R"sql(
ALTER TABLE runs ADD COLUMN user_metadata_json TEXT NOT NULL DEFAULT '';
)sql",
    // v2 → v3: session metadata; tenants, API keys (digests only) and projects; usage
    // buckets; the append-only audit log (registry_keys.cc, registry_usage.cc,
    // registry_audit.cc). Self-contained: depends on no other migration's tables.
    R"sql(
ALTER TABLE sessions ADD COLUMN tags_json          TEXT    NOT NULL DEFAULT '[]';
ALTER TABLE sessions ADD COLUMN user_metadata_json TEXT    NOT NULL DEFAULT '';
ALTER TABLE sessions ADD COLUMN project_id         TEXT    NOT NULL DEFAULT '';
ALTER TABLE sessions ADD COLUMN display_name       TEXT    NOT NULL DEFAULT '';
ALTER TABLE sessions ADD COLUMN key_id             INTEGER NOT NULL DEFAULT 0;
ALTER TABLE sessions ADD COLUMN finished_us        INTEGER NOT NULL DEFAULT 0;
CREATE INDEX sessions_by_tenant_created ON sessions(tenant, created_us, id);

CREATE TABLE tenants (
  id         TEXT    NOT NULL PRIMARY KEY,
  source     TEXT    NOT NULL CHECK (source IN ('config', 'admin')),
  created_us INTEGER NOT NULL
) WITHOUT ROWID;

CREATE TABLE api_keys (
  key_id     INTEGER PRIMARY KEY AUTOINCREMENT,
  tenant     TEXT    NOT NULL REFERENCES tenants(id),
  key_sha256 TEXT    NOT NULL UNIQUE,
  role       TEXT    NOT NULL CHECK (role IN ('admin', 'member', 'read-only')),
  name       TEXT    NOT NULL,
  source     TEXT    NOT NULL CHECK (source IN ('config', 'admin')),
  created_us INTEGER NOT NULL,
  revoked_us INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX api_keys_by_tenant ON api_keys(tenant, key_id);

CREATE TABLE projects (
  tenant     TEXT    NOT NULL,
  project_id TEXT    NOT NULL,
  created_us INTEGER NOT NULL,
  PRIMARY KEY (tenant, project_id)
) WITHOUT ROWID;

CREATE TABLE usage (
  bucket_us  INTEGER NOT NULL,
  tenant     TEXT    NOT NULL,
  key_id     INTEGER NOT NULL,
  session_id TEXT    NOT NULL,
  run_id     TEXT    NOT NULL,
  kind       TEXT    NOT NULL,
  amount     INTEGER NOT NULL,
  PRIMARY KEY (bucket_us, tenant, key_id, session_id, run_id, kind)
) WITHOUT ROWID;

CREATE TABLE audit (
  seq          INTEGER PRIMARY KEY AUTOINCREMENT,
  at_us        INTEGER NOT NULL,
  tenant       TEXT    NOT NULL,
  key_id       INTEGER NOT NULL,
  action       TEXT    NOT NULL,
  object       TEXT    NOT NULL,
  peer         TEXT    NOT NULL,
  details_json TEXT    NOT NULL
);
CREATE INDEX audit_by_time ON audit(at_us);
CREATE TRIGGER audit_append_only BEFORE UPDATE ON audit
BEGIN SELECT RAISE(ABORT, 'audit rows are append-only'); END;
)sql",
    // v3 → v4: checkpoint retention and sharing: an expiry (NULL = never), a published flag,
    // and the kind 'external' (save_weights_external). The CHECK on kind changes, so the
    // table is rebuilt (it is a child only: no key refers to it).
    R"sql(
CREATE TABLE checkpoints_v3 (
  tenant        TEXT    NOT NULL,
  run_id        TEXT    NOT NULL,
  checkpoint_id TEXT    NOT NULL,
  kind          TEXT    NOT NULL CHECK (kind IN ('training', 'sampler', 'external')),
  path          TEXT    NOT NULL,
  size_bytes    INTEGER NOT NULL,
  created_us    INTEGER NOT NULL,
  expires_us    INTEGER,
  published     INTEGER NOT NULL DEFAULT 0 CHECK (published IN (0, 1)),
  PRIMARY KEY (tenant, run_id, checkpoint_id),
  FOREIGN KEY (tenant, run_id) REFERENCES runs(tenant, run_id) ON DELETE CASCADE
) WITHOUT ROWID;
INSERT INTO checkpoints_v3 (tenant, run_id, checkpoint_id, kind, path, size_bytes, created_us)
  SELECT tenant, run_id, checkpoint_id, kind, path, size_bytes, created_us FROM checkpoints;
DROP TABLE checkpoints;
ALTER TABLE checkpoints_v3 RENAME TO checkpoints;
CREATE INDEX checkpoints_by_expiry ON checkpoints(expires_us) WHERE expires_us IS NOT NULL;
CREATE INDEX checkpoints_published ON checkpoints(run_id, checkpoint_id) WHERE published = 1;
)sql",
    // v4 → v5: open sampling sessions (registry_sessions.cc), reopened after a restart.
    R"sql(
CREATE TABLE sampling_sessions (
  id         TEXT    NOT NULL PRIMARY KEY,
  tenant     TEXT    NOT NULL,
  model_path TEXT    NOT NULL,
  owner      TEXT    NOT NULL,
  live       INTEGER NOT NULL CHECK (live IN (0, 1)),
  created_us INTEGER NOT NULL
) WITHOUT ROWID;
)sql",
    // v5 → v6: several base models (config `models:`). A sampling session is reopened on the
    // model it was opened on, and usage is counted per base model. '' = the default (first)
    // model: every row written before v6. The usage key changes, so its table is rebuilt (no
    // key refers to it).
    R"sql(
ALTER TABLE sampling_sessions ADD COLUMN base_model TEXT NOT NULL DEFAULT '';
CREATE TABLE usage_v6 (
  bucket_us  INTEGER NOT NULL,
  tenant     TEXT    NOT NULL,
  key_id     INTEGER NOT NULL,
  session_id TEXT    NOT NULL,
  run_id     TEXT    NOT NULL,
  base_model TEXT    NOT NULL,
  kind       TEXT    NOT NULL,
  amount     INTEGER NOT NULL,
  PRIMARY KEY (bucket_us, tenant, key_id, session_id, run_id, base_model, kind)
) WITHOUT ROWID;
INSERT INTO usage_v6 (bucket_us, tenant, key_id, session_id, run_id, base_model, kind, amount)
  SELECT bucket_us, tenant, key_id, session_id, run_id, '', kind, amount FROM usage;
DROP TABLE usage;
ALTER TABLE usage_v6 RENAME TO usage;
)sql",
};
static_assert(kMigrations.size() == Registry::kSchemaVersion,
              "every schema version needs its migration");

constexpr int kBusyTimeoutMs = 5000;

absl::StatusOr<int64_t> ReadUserVersion(sqlite3* db, const std::string& path) {
  Stmt st(db, path, "PRAGMA user_version");
  absl::StatusOr<bool> row = st.Step("read user_version");
  if (!row.ok()) return row.status();
  if (!*row) return absl::InternalError(absl::StrCat("registry database '", path, "': no user_version"));
  return st.Int(0);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Registry>> Registry::Open(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("registry database path is empty");
  {
    std::filesystem::path parent = std::filesystem::path(path).parent_path();
    if (parent.empty()) parent = ".";
    std::error_code ec;
    const std::filesystem::file_status st = std::filesystem::status(parent, ec);
    if (!std::filesystem::exists(st)) {
      return absl::NotFoundError(absl::StrCat("registry database '", path, "': directory '", parent.string(),
                                              "' does not exist"));
    }
    if (!std::filesystem::is_directory(st)) {
      return absl::FailedPreconditionError(absl::StrCat("registry database '", path, "': '", parent.string(),
                                                        "' is not a directory"));
    }
    if (std::filesystem::is_directory(std::filesystem::status(path, ec))) {
      return absl::FailedPreconditionError(absl::StrCat("registry database '", path, "' is a directory"));
    }
  }

  sqlite3* db = nullptr;
  const int rc = sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX,
                                 nullptr);
  if (rc != SQLITE_OK) {
    absl::Status s = SqlError(db, rc, path, "open");
    sqlite3_close_v2(db);  // a handle is returned even on failure (or null, which is fine)
    return s;
  }
  // From here the Registry owns the handle, so every early return closes it.
  std::unique_ptr<Registry> registry(new Registry(db, path));
  absl::MutexLock lock(&registry->mu_);

  sqlite3_extended_result_codes(db, 1);
  sqlite3_busy_timeout(db, kBusyTimeoutMs);
  sqlite3_db_config(db, SQLITE_DBCONFIG_DEFENSIVE, 1, nullptr);
  sqlite3_db_config(db, SQLITE_DBCONFIG_TRUSTED_SCHEMA, 0, nullptr);

  // The first statement that reads the file: a file that is not a database fails here.
  {
    Stmt st(db, path, "PRAGMA journal_mode = WAL");
    absl::StatusOr<bool> row = st.Step("set journal_mode=WAL");
    if (!row.ok()) return row.status();
    const std::string mode = *row ? st.Text(0) : std::string();
    if (mode != "wal") {
      return absl::FailedPreconditionError(
          absl::StrCat("registry database '", path, "': journal_mode is '", mode, "', WAL is required"));
    }
  }
  if (absl::Status s = Exec(db, path, "PRAGMA synchronous = FULL", "set synchronous=FULL"); !s.ok()) return s;
  if (absl::Status s = Exec(db, path, "PRAGMA foreign_keys = ON", "enable foreign keys"); !s.ok()) return s;
  {
    Stmt st(db, path, "PRAGMA foreign_keys");
    absl::StatusOr<bool> row = st.Step("check foreign keys");
    if (!row.ok()) return row.status();
    if (!*row || st.Int(0) != 1) {
      return absl::InternalError(absl::StrCat("registry database '", path, "': foreign keys could not be enabled"));
    }
  }
  if (absl::Status s = registry->Migrate(); !s.ok()) return s;
  return registry;
}

absl::Status Registry::Migrate() {
  // Checked once outside a transaction so that a newer file is refused without taking the
  // write lock, then again inside each migration's transaction (another process may have
  // migrated in between).
  absl::StatusOr<int64_t> version = ReadUserVersion(db_, path_);
  if (!version.ok()) return version.status();
  for (;;) {
    if (*version > kSchemaVersion) {
      return absl::FailedPreconditionError(absl::StrCat(
          "registry database '", path_, "' has schema version ", std::to_string(*version),
          ", newer than this binary's ", std::to_string(kSchemaVersion), "; refusing to open it"));
    }
    if (*version == kSchemaVersion) return absl::OkStatus();
    if (*version < 0) {
      return absl::FailedPreconditionError(absl::StrCat("registry database '", path_,
                                                        "' has an invalid schema version ",
                                                        std::to_string(*version)));
    }
    Txn txn(db_, path_);
    if (absl::Status s = txn.Begin(/*write=*/true); !s.ok()) return s;
    absl::StatusOr<int64_t> current = ReadUserVersion(db_, path_);
    if (!current.ok()) return current.status();
    if (*current == *version) {
      const int64_t target = *version + 1;
      const std::string what = absl::StrCat("migrate schema to version ", std::to_string(target));
      if (absl::Status s = Exec(db_, path_, kMigrations[*version], what); !s.ok()) return s;
      // PRAGMA takes no bound parameters; `target` is our own integer, not an input.
      const std::string bump = absl::StrCat("PRAGMA user_version = ", std::to_string(target));
      if (absl::Status s = Exec(db_, path_, bump.c_str(), what); !s.ok()) return s;
      if (absl::Status s = txn.Commit(); !s.ok()) return s;
      version = target;
    } else {
      version = *current;  // someone else migrated; re-check (the Txn rolls back, nothing written)
    }
  }
}

Registry::~Registry() {
  absl::MutexLock lock(&mu_);
  // Every statement is finalized when its call returns, so close_v2 closes at once.
  sqlite3_close_v2(db_);
  db_ = nullptr;
}

}  // namespace twinkle::registry
