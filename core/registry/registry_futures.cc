// Registry's futures table and its max_future_id counter: PutFuture, GetFuture, DeleteFuture,
// InterruptPendingFutures, ExpireFutures and MaxFutureId.
#include "core/registry/registry.h"

#include <sqlite3.h>

#include <cstdint>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/registry/registry_internal.h"

namespace twinkle::registry {

using registry_internal::FromMicros;
using registry_internal::Micros;
using registry_internal::Stmt;
using registry_internal::Txn;

namespace {

constexpr char kInterruptedMessage[] =
    "interrupted by a restart: the server stopped before this operation finished; submit it again";

absl::Status FutureNotFound(uint64_t id) {
  return absl::NotFoundError(absl::StrCat("future ", std::to_string(id), " not found"));
}

absl::Status CheckFutureId(uint64_t id) {
  if (id == 0 || id > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat("future id ", std::to_string(id), " is outside [1, 2^63 - 1], the range the registry stores"));
  }
  return absl::OkStatus();
}

}  // namespace

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

absl::Status Registry::DeleteFuture(uint64_t id, const std::string& tenant) {
  if (id == 0 || id > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_, "DELETE FROM futures WHERE id = ? AND tenant = ?");
  st.Bind(static_cast<int64_t>(id)).Bind(tenant);
  return st.Run("delete future");
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
