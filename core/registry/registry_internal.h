#pragma once
// Internal to core/registry: the SQLite plumbing shared by registry.cc (Open, schema,
// migrations) and the table files registry_sessions.cc, registry_runs.cc (runs and their
// checkpoints) and registry_futures.cc — prepared statements, transactions, the error mapping
// registry.h describes and the time encoding. Defined in registry_internal.cc where not
// inline. Not part of the library's interface.

#include "core/registry/registry.h"

#include <sqlite3.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace twinkle::registry {
namespace registry_internal {

inline int64_t Micros(absl::Time t) { return absl::ToUnixMicros(t); }
inline absl::Time FromMicros(int64_t us) { return absl::FromUnixMicros(us); }

// The Status for SQLite result `rc` (registry.h's mapping), naming the database file and what
// was being done (`what`).
absl::Status SqlError(sqlite3* db, int rc, const std::string& path, const std::string& what);

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
  Stmt& BindNull() {
    if (rc_ == SQLITE_OK) rc_ = sqlite3_bind_null(stmt_, ++index_);
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
  bool IsNull(int col) const { return sqlite3_column_type(stmt_, col) == SQLITE_NULL; }
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
absl::Status Exec(sqlite3* db, const std::string& path, const char* sql, const std::string& what);

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

// InvalidArgument naming `field` when `value` is empty.
absl::Status NonEmpty(const std::string& value, const char* field);

}  // namespace registry_internal
}  // namespace twinkle::registry
