// The SQLite plumbing registry_internal.h declares: how SQLite result codes become absl
// Statuses, constant SQL execution and the shared input check.
#include "core/registry/registry_internal.h"

#include <sqlite3.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace twinkle::registry {
namespace registry_internal {
namespace {

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

}  // namespace

absl::Status SqlError(sqlite3* db, int rc, const std::string& path, const std::string& what) {
  std::string detail = db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
  if ((rc & 0xff) == SQLITE_NOTADB) detail = "file is not a SQLite database";
  return absl::Status(CodeFor(rc), absl::StrCat("registry database '", path, "': ", what, ": ", detail,
                                                " (sqlite code ", std::to_string(rc), ")"));
}

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

absl::Status NonEmpty(const std::string& value, const char* field) {
  if (value.empty()) return absl::InvalidArgumentError(absl::StrCat(std::string(field), " must not be empty"));
  return absl::OkStatus();
}

}  // namespace registry_internal
}  // namespace twinkle::registry
