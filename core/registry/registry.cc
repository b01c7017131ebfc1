#include "core/registry/registry.h"

#include <sqlite3.h>

#include <array>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace twinkle::registry {
namespace {

// Migrations: kMigrations[v] takes a file from user_version v to v + 1. Each runs in its own
// transaction together with the user_version bump. Append only; never edit a shipped entry.
// (foreign_keys is on and cannot change inside a transaction: a future migration that
// rebuilds a referenced table must keep its keys intact.)
constexpr std::array<const char*, 1> kMigrations = {
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
};
static_assert(kMigrations.size() == Registry::kSchemaVersion,
              "every schema version needs its migration");

constexpr int kBusyTimeoutMs = 5000;
constexpr char kInterruptedMessage[] =
    "the server restarted before this future finished; its work was lost";

int64_t Micros(absl::Time t) { return absl::ToUnixMicros(t); }
absl::Time FromMicros(int64_t us) { return absl::FromUnixMicros(us); }

absl::StatusCode CodeFor(int rc) {
  switch (rc & 0xff) {
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
      return absl::StatusCode::kUnavailable;
    case SQLITE_FULL:
      return absl::StatusCode::kResourceExhausted;
    case SQLITE_CORRUPT:
      return absl::StatusCode::kDataLoss;
    case SQLITE_NOTADB:
    case SQLITE_CANTOPEN:
    case SQLITE_READONLY:
    case SQLITE_PERM:
      return absl::StatusCode::kFailedPrecondition;
    case SQLITE_CONSTRAINT:
      return absl::StatusCode::kFailedPrecondition;
    default:
      return absl::StatusCode::kInternal;
  }
}

absl::Status SqlError(sqlite3* db, int rc, const std::string& path, const std::string& what) {
  std::string detail = db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
  if ((rc & 0xff) == SQLITE_NOTADB) detail = "file is not a SQLite database";
  return absl::Status(CodeFor(rc), absl::StrCat("registry database '", path, "': ", what, ": ", detail,
                                                " (sqlite code ", std::to_string(rc), ")"));
}

// One prepared statement. Parameters are bound in order with Bind; the first failure sticks
// and is reported by Step/Run.
class Stmt {
 public:
  Stmt(sqlite3* db, const std::string& path, const char* sql) : db_(db), path_(path) {
    rc_ = sqlite3_prepare_v2(db, sql, -1, &stmt_, nullptr);
  }
  ~Stmt() { sqlite3_finalize(stmt_); }
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;

  Stmt& Bind(int64_t v) {
    if (rc_ == SQLITE_OK) rc_ = sqlite3_bind_int64(stmt_, ++index_, v);
    return *this;
  }
  Stmt& Bind(const std::string& s) {
    if (rc_ == SQLITE_OK) {
      rc_ = sqlite3_bind_text64(stmt_, ++index_, s.data(), s.size(), SQLITE_TRANSIENT, SQLITE_UTF8);
    }
    return *this;
  }
  Stmt& BindBlob(const std::string& s) {
    // s.data() is never null, so an empty string binds a zero-length blob, not NULL.
    if (rc_ == SQLITE_OK) rc_ = sqlite3_bind_blob64(stmt_, ++index_, s.data(), s.size(), SQLITE_TRANSIENT);
    return *this;
  }

  // true: a row is ready; false: done.
  absl::StatusOr<bool> Step(const std::string& what) {
    if (rc_ != SQLITE_OK) return SqlError(db_, rc_, path_, what);
    const int rc = sqlite3_step(stmt_);
    if (rc == SQLITE_ROW) return true;
    if (rc == SQLITE_DONE) return false;
    rc_ = rc;
    return SqlError(db_, rc, path_, what);
  }
  // Runs a statement to completion, ignoring rows.
  absl::Status Run(const std::string& what) {
    for (;;) {
      absl::StatusOr<bool> row = Step(what);
      if (!row.ok()) return row.status();
      if (!*row) return absl::OkStatus();
    }
  }

  int64_t Int(int col) const { return sqlite3_column_int64(stmt_, col); }
  std::string Text(int col) const {
    const unsigned char* p = sqlite3_column_text(stmt_, col);
    const int n = sqlite3_column_bytes(stmt_, col);
    return p == nullptr ? std::string() : std::string(reinterpret_cast<const char*>(p), n);
  }
  std::string Blob(int col) const {
    const void* p = sqlite3_column_blob(stmt_, col);
    const int n = sqlite3_column_bytes(stmt_, col);
    return p == nullptr ? std::string() : std::string(static_cast<const char*>(p), n);
  }

 private:
  sqlite3* db_;
  const std::string& path_;
  sqlite3_stmt* stmt_ = nullptr;
  int rc_ = SQLITE_OK;
  int index_ = 0;
};

// Executes constant SQL (no values in it) such as BEGIN or a migration script.
absl::Status Exec(sqlite3* db, const std::string& path, const char* sql, const std::string& what) {
  char* err = nullptr;
  const int rc = sqlite3_exec(db, sql, nullptr, nullptr, &err);
  if (rc == SQLITE_OK) return absl::OkStatus();
  std::string detail = err != nullptr ? err : sqlite3_errstr(rc);
  sqlite3_free(err);
  if ((rc & 0xff) == SQLITE_NOTADB) detail = "file is not a SQLite database";
  return absl::Status(CodeFor(rc), absl::StrCat("registry database '", path, "': ", what, ": ", detail,
                                                " (sqlite code ", std::to_string(rc), ")"));
}

// A transaction rolled back unless committed.
class Txn {
 public:
  Txn(sqlite3* db, const std::string& path) : db_(db), path_(path) {}
  ~Txn() {
    if (open_) sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
  }
  // IMMEDIATE takes the write lock up front (no upgrade deadlock with another process);
  // DEFERRED is for read-only snapshots.
  absl::Status Begin(bool write) {
    absl::Status s = Exec(db_, path_, write ? "BEGIN IMMEDIATE" : "BEGIN DEFERRED", "begin transaction");
    open_ = s.ok();
    return s;
  }
  absl::Status Commit() {
    absl::Status s = Exec(db_, path_, "COMMIT", "commit");
    if (s.ok()) open_ = false;
    return s;
  }

 private:
  sqlite3* db_;
  const std::string& path_;
  bool open_ = false;
};

absl::StatusOr<int64_t> ReadUserVersion(sqlite3* db, const std::string& path) {
  Stmt st(db, path, "PRAGMA user_version");
  absl::StatusOr<bool> row = st.Step("read user_version");
  if (!row.ok()) return row.status();
  if (!*row) return absl::InternalError(absl::StrCat("registry database '", path, "': no user_version"));
  return st.Int(0);
}

absl::Status RunNotFound(const std::string& run_id) {
  return absl::NotFoundError(absl::StrCat("run '", run_id, "' not found"));
}
absl::Status CheckpointNotFound(const std::string& run_id, const std::string& checkpoint_id) {
  return absl::NotFoundError(absl::StrCat("checkpoint '", checkpoint_id, "' of run '", run_id, "' not found"));
}
absl::Status SessionNotFound(const std::string& id) {
  return absl::NotFoundError(absl::StrCat("session '", id, "' not found"));
}
absl::Status FutureNotFound(uint64_t id) {
  return absl::NotFoundError(absl::StrCat("future ", std::to_string(id), " not found"));
}

absl::Status NonEmpty(const std::string& value, const char* field) {
  if (value.empty()) return absl::InvalidArgumentError(absl::StrCat(std::string(field), " must not be empty"));
  return absl::OkStatus();
}

absl::Status CheckFutureId(uint64_t id) {
  if (id == 0 || id > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat("future id ", std::to_string(id), " is outside [1, 2^63 - 1], the range the registry stores"));
  }
  return absl::OkStatus();
}

constexpr char kRunColumns[] =
    "run_id, tenant, adapter_name, base_model, lora_config_json, created_us, last_request_us, last_step";
RunRecord ReadRun(const Stmt& st) {
  RunRecord r;
  r.run_id = st.Text(0);
  r.tenant = st.Text(1);
  r.adapter_name = st.Text(2);
  r.base_model = st.Text(3);
  r.lora_config_json = st.Text(4);
  r.created = FromMicros(st.Int(5));
  r.last_request = FromMicros(st.Int(6));
  r.last_step = st.Int(7);
  return r;
}

CheckpointRecord ReadCheckpoint(const Stmt& st) {
  CheckpointRecord c;
  c.tenant = st.Text(0);
  c.run_id = st.Text(1);
  c.checkpoint_id = st.Text(2);
  c.kind = st.Text(3);
  c.path = st.Text(4);
  c.size_bytes = st.Int(5);
  c.created = FromMicros(st.Int(6));
  return c;
}

// Whether `tenant` owns `run_id`.
absl::StatusOr<bool> RunExists(sqlite3* db, const std::string& path, const std::string& tenant,
                               const std::string& run_id) {
  Stmt st(db, path, "SELECT 1 FROM runs WHERE tenant = ? AND run_id = ?");
  st.Bind(tenant).Bind(run_id);
  return st.Step("look up run");
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

// ---------------------------------------------------------------------------------------- //
// Sessions

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

// ---------------------------------------------------------------------------------------- //
// Runs

absl::Status Registry::PutRun(const RunRecord& run) {
  if (absl::Status s = NonEmpty(run.run_id, "run_id"); !s.ok()) return s;
  if (absl::Status s = NonEmpty(run.tenant, "tenant"); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  // One statement: the tenant check and the write are atomic.
  Stmt st(db_, path_,
          "INSERT INTO runs (run_id, tenant, adapter_name, base_model, lora_config_json, created_us, "
          "last_request_us, last_step) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
          "ON CONFLICT (run_id) DO UPDATE SET adapter_name = excluded.adapter_name, "
          "base_model = excluded.base_model, lora_config_json = excluded.lora_config_json, "
          "created_us = excluded.created_us, last_request_us = excluded.last_request_us, "
          "last_step = excluded.last_step "
          "WHERE runs.tenant = excluded.tenant");
  st.Bind(run.run_id)
      .Bind(run.tenant)
      .Bind(run.adapter_name)
      .Bind(run.base_model)
      .Bind(run.lora_config_json)
      .Bind(Micros(run.created))
      .Bind(Micros(run.last_request))
      .Bind(run.last_step);
  if (absl::Status s = st.Run("put run"); !s.ok()) return s;
  if (sqlite3_changes64(db_) == 0) {
    return absl::AlreadyExistsError(absl::StrCat("run '", run.run_id, "' already exists"));
  }
  return absl::OkStatus();
}

absl::Status Registry::TouchRun(const std::string& tenant, const std::string& run_id, absl::Time now,
                                int64_t last_step) {
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_, "UPDATE runs SET last_request_us = ?, last_step = ? WHERE run_id = ? AND tenant = ?");
  st.Bind(Micros(now)).Bind(last_step).Bind(run_id).Bind(tenant);
  if (absl::Status s = st.Run("touch run"); !s.ok()) return s;
  if (sqlite3_changes64(db_) == 0) return RunNotFound(run_id);
  return absl::OkStatus();
}

absl::StatusOr<RunRecord> Registry::GetRun(const std::string& tenant, const std::string& run_id) {
  absl::MutexLock lock(&mu_);
  const std::string sql = absl::StrCat("SELECT ", std::string(kRunColumns), " FROM runs WHERE run_id = ? AND tenant = ?");
  Stmt st(db_, path_, sql.c_str());
  st.Bind(run_id).Bind(tenant);
  absl::StatusOr<bool> row = st.Step("get run");
  if (!row.ok()) return row.status();
  if (!*row) return RunNotFound(run_id);
  return ReadRun(st);
}

absl::StatusOr<std::vector<RunRecord>> Registry::ListRuns(const std::string& tenant, Page page, int32_t* total) {
  if (page.limit < 0 || page.offset < 0) {
    return absl::InvalidArgumentError(absl::StrCat("limit (", std::to_string(page.limit), ") and offset (",
                                                   std::to_string(page.offset), ") must not be negative"));
  }
  absl::MutexLock lock(&mu_);
  Txn txn(db_, path_);
  if (absl::Status s = txn.Begin(/*write=*/false); !s.ok()) return s;
  {
    Stmt st(db_, path_, "SELECT COUNT(*) FROM runs WHERE tenant = ?");
    st.Bind(tenant);
    absl::StatusOr<bool> row = st.Step("count runs");
    if (!row.ok()) return row.status();
    if (total != nullptr) *total = *row ? static_cast<int32_t>(st.Int(0)) : 0;
  }
  std::vector<RunRecord> runs;
  {
    const std::string sql = absl::StrCat("SELECT ", std::string(kRunColumns),
                                         " FROM runs WHERE tenant = ? ORDER BY created_us DESC, run_id DESC "
                                         "LIMIT ? OFFSET ?");
    Stmt st(db_, path_, sql.c_str());
    st.Bind(tenant).Bind(int64_t{page.limit}).Bind(int64_t{page.offset});
    for (;;) {
      absl::StatusOr<bool> row = st.Step("list runs");
      if (!row.ok()) return row.status();
      if (!*row) break;
      runs.push_back(ReadRun(st));
    }
  }
  if (absl::Status s = txn.Commit(); !s.ok()) return s;
  return runs;
}

// ---------------------------------------------------------------------------------------- //
// Checkpoints

absl::Status Registry::PutCheckpoint(const CheckpointRecord& checkpoint) {
  if (absl::Status s = NonEmpty(checkpoint.tenant, "tenant"); !s.ok()) return s;
  if (absl::Status s = NonEmpty(checkpoint.run_id, "run_id"); !s.ok()) return s;
  if (absl::Status s = NonEmpty(checkpoint.checkpoint_id, "checkpoint_id"); !s.ok()) return s;
  if (checkpoint.kind != "training" && checkpoint.kind != "sampler") {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint kind '", checkpoint.kind, "' is neither 'training' nor 'sampler'"));
  }
  absl::MutexLock lock(&mu_);
  Txn txn(db_, path_);
  if (absl::Status s = txn.Begin(/*write=*/true); !s.ok()) return s;
  absl::StatusOr<bool> exists = RunExists(db_, path_, checkpoint.tenant, checkpoint.run_id);
  if (!exists.ok()) return exists.status();
  if (!*exists) return RunNotFound(checkpoint.run_id);
  Stmt st(db_, path_,
          "INSERT INTO checkpoints (tenant, run_id, checkpoint_id, kind, path, size_bytes, created_us) "
          "VALUES (?, ?, ?, ?, ?, ?, ?) "
          "ON CONFLICT (tenant, run_id, checkpoint_id) DO UPDATE SET kind = excluded.kind, "
          "path = excluded.path, size_bytes = excluded.size_bytes, created_us = excluded.created_us");
  st.Bind(checkpoint.tenant)
      .Bind(checkpoint.run_id)
      .Bind(checkpoint.checkpoint_id)
      .Bind(checkpoint.kind)
      .Bind(checkpoint.path)
      .Bind(checkpoint.size_bytes)
      .Bind(Micros(checkpoint.created));
  if (absl::Status s = st.Run("put checkpoint"); !s.ok()) return s;
  return txn.Commit();
}

absl::StatusOr<CheckpointRecord> Registry::GetCheckpoint(const std::string& tenant, const std::string& run_id,
                                                         const std::string& checkpoint_id) {
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_,
          "SELECT tenant, run_id, checkpoint_id, kind, path, size_bytes, created_us FROM checkpoints "
          "WHERE tenant = ? AND run_id = ? AND checkpoint_id = ?");
  st.Bind(tenant).Bind(run_id).Bind(checkpoint_id);
  absl::StatusOr<bool> row = st.Step("get checkpoint");
  if (!row.ok()) return row.status();
  if (!*row) return CheckpointNotFound(run_id, checkpoint_id);
  return ReadCheckpoint(st);
}

absl::StatusOr<std::vector<CheckpointRecord>> Registry::ListCheckpoints(const std::string& tenant,
                                                                        const std::string& run_id) {
  absl::MutexLock lock(&mu_);
  Txn txn(db_, path_);
  if (absl::Status s = txn.Begin(/*write=*/false); !s.ok()) return s;
  absl::StatusOr<bool> exists = RunExists(db_, path_, tenant, run_id);
  if (!exists.ok()) return exists.status();
  if (!*exists) return RunNotFound(run_id);
  std::vector<CheckpointRecord> out;
  {
    Stmt st(db_, path_,
            "SELECT tenant, run_id, checkpoint_id, kind, path, size_bytes, created_us FROM checkpoints "
            "WHERE tenant = ? AND run_id = ? ORDER BY created_us, checkpoint_id");
    st.Bind(tenant).Bind(run_id);
    for (;;) {
      absl::StatusOr<bool> row = st.Step("list checkpoints");
      if (!row.ok()) return row.status();
      if (!*row) break;
      out.push_back(ReadCheckpoint(st));
    }
  }
  if (absl::Status s = txn.Commit(); !s.ok()) return s;
  return out;
}

absl::Status Registry::DeleteCheckpoint(const std::string& tenant, const std::string& run_id,
                                        const std::string& checkpoint_id) {
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_, "DELETE FROM checkpoints WHERE tenant = ? AND run_id = ? AND checkpoint_id = ?");
  st.Bind(tenant).Bind(run_id).Bind(checkpoint_id);
  if (absl::Status s = st.Run("delete checkpoint"); !s.ok()) return s;
  if (sqlite3_changes64(db_) == 0) return CheckpointNotFound(run_id, checkpoint_id);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<CheckpointRecord>> Registry::AllCheckpoints() {
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_,
          "SELECT tenant, run_id, checkpoint_id, kind, path, size_bytes, created_us FROM checkpoints "
          "ORDER BY tenant, run_id, created_us, checkpoint_id");
  std::vector<CheckpointRecord> out;
  for (;;) {
    absl::StatusOr<bool> row = st.Step("list all checkpoints");
    if (!row.ok()) return row.status();
    if (!*row) break;
    out.push_back(ReadCheckpoint(st));
  }
  return out;
}

// ---------------------------------------------------------------------------------------- //
// Futures

absl::Status Registry::PutFuture(const FutureRecord& future) {
  // An empty tenant is allowed: callers record bookkeeping rows (a boot marker) that way.
  if (absl::Status s = CheckFutureId(future.id); !s.ok()) return s;
  if (future.state != "pending" && future.state != "done" && future.state != "failed" &&
      future.state != "interrupted") {
    return absl::InvalidArgumentError(absl::StrCat(
        "future state '", future.state, "' is not one of pending, done, failed, interrupted"));
  }
  const int64_t id = static_cast<int64_t>(future.id);
  absl::MutexLock lock(&mu_);
  Txn txn(db_, path_);
  if (absl::Status s = txn.Begin(/*write=*/true); !s.ok()) return s;
  {
    Stmt st(db_, path_,
            "INSERT INTO futures (id, tenant, state, result, error_code, error_message, created_us, updated_us) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (id) DO UPDATE SET state = excluded.state, result = excluded.result, "
            "error_code = excluded.error_code, error_message = excluded.error_message, "
            "created_us = excluded.created_us, updated_us = excluded.updated_us "
            "WHERE futures.tenant = excluded.tenant");
    st.Bind(id)
        .Bind(future.tenant)
        .Bind(future.state)
        .BindBlob(future.result)
        .Bind(int64_t{future.error_code})
        .Bind(future.error_message)
        .Bind(Micros(future.created))
        .Bind(Micros(future.updated));
    if (absl::Status s = st.Run("put future"); !s.ok()) return s;
    if (sqlite3_changes64(db_) == 0) {
      return absl::AlreadyExistsError(absl::StrCat("future ", std::to_string(future.id), " already exists"));
    }
  }
  {
    Stmt st(db_, path_, "UPDATE counters SET value = MAX(value, ?) WHERE name = 'max_future_id'");
    st.Bind(id);
    if (absl::Status s = st.Run("record max future id"); !s.ok()) return s;
  }
  return txn.Commit();
}

absl::StatusOr<FutureRecord> Registry::GetFuture(uint64_t id, const std::string& tenant) {
  if (id == 0 || id > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return FutureNotFound(id);
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_,
          "SELECT id, tenant, state, result, error_code, error_message, created_us, updated_us FROM futures "
          "WHERE id = ? AND tenant = ?");
  st.Bind(static_cast<int64_t>(id)).Bind(tenant);
  absl::StatusOr<bool> row = st.Step("get future");
  if (!row.ok()) return row.status();
  if (!*row) return FutureNotFound(id);
  FutureRecord f;
  f.id = static_cast<uint64_t>(st.Int(0));
  f.tenant = st.Text(1);
  f.state = st.Text(2);
  f.result = st.Blob(3);
  f.error_code = static_cast<int32_t>(st.Int(4));
  f.error_message = st.Text(5);
  f.created = FromMicros(st.Int(6));
  f.updated = FromMicros(st.Int(7));
  return f;
}

absl::StatusOr<int64_t> Registry::InterruptPendingFutures(absl::Time now) {
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_,
          "UPDATE futures SET state = 'interrupted', error_code = ?, error_message = ?, updated_us = ? "
          "WHERE state = 'pending'");
  st.Bind(static_cast<int64_t>(absl::StatusCode::kAborted)).Bind(std::string(kInterruptedMessage)).Bind(Micros(now));
  if (absl::Status s = st.Run("interrupt pending futures"); !s.ok()) return s;
  return static_cast<int64_t>(sqlite3_changes64(db_));
}

absl::StatusOr<int64_t> Registry::ExpireFutures(absl::Time cutoff) {
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_, "DELETE FROM futures WHERE state <> 'pending' AND updated_us < ?");
  st.Bind(Micros(cutoff));
  if (absl::Status s = st.Run("expire futures"); !s.ok()) return s;
  return static_cast<int64_t>(sqlite3_changes64(db_));
}

absl::StatusOr<uint64_t> Registry::MaxFutureId() {
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_,
          "SELECT MAX(IFNULL((SELECT value FROM counters WHERE name = 'max_future_id'), 0), "
          "IFNULL((SELECT MAX(id) FROM futures), 0))");
  absl::StatusOr<bool> row = st.Step("read max future id");
  if (!row.ok()) return row.status();
  if (!*row) return uint64_t{0};
  const int64_t v = st.Int(0);
  return v < 0 ? uint64_t{0} : static_cast<uint64_t>(v);
}

}  // namespace twinkle::registry
