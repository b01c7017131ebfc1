// Registry's runs table and the checkpoints that belong to its runs (their foreign key):
// PutRun, TouchRun, GetRun, ListRuns and PutCheckpoint, GetCheckpoint, ListCheckpoints,
// DeleteCheckpoint, AllCheckpoints.
#include "core/registry/registry.h"

#include <sqlite3.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/registry/registry_internal.h"

namespace twinkle::registry {

using registry_internal::FromMicros;
using registry_internal::Micros;
using registry_internal::NonEmpty;
using registry_internal::Stmt;
using registry_internal::Txn;

namespace {

absl::Status RunNotFound(const std::string& run_id) {
  return absl::NotFoundError(absl::StrCat("run '", run_id, "' not found"));
}
absl::Status CheckpointNotFound(const std::string& run_id, const std::string& checkpoint_id) {
  return absl::NotFoundError(absl::StrCat("checkpoint '", checkpoint_id, "' of run '", run_id, "' not found"));
}

constexpr char kRunColumns[] =
    "run_id, tenant, adapter_name, base_model, lora_config_json, created_us, last_request_us, last_step, "
    "user_metadata_json";
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
  r.user_metadata_json = st.Text(8);
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
  if (!st.IsNull(7)) c.expires = FromMicros(st.Int(7));
  c.published = st.Int(8) != 0;
  return c;
}

constexpr char kCheckpointColumns[] =
    "tenant, run_id, checkpoint_id, kind, path, size_bytes, created_us, expires_us, published";

// Whether `tenant` owns `run_id`.
absl::StatusOr<bool> RunExists(sqlite3* db, const std::string& path, const std::string& tenant,
                               const std::string& run_id) {
  Stmt st(db, path, "SELECT 1 FROM runs WHERE tenant = ? AND run_id = ?");
  st.Bind(tenant).Bind(run_id);
  return st.Step("look up run");
}

}  // namespace

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

absl::Status Registry::SetRunUserMetadata(const std::string& tenant, const std::string& run_id,
                                          const std::string& json) {
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_, "UPDATE runs SET user_metadata_json = ? WHERE run_id = ? AND tenant = ?");
  st.Bind(json).Bind(run_id).Bind(tenant);
  if (absl::Status s = st.Run("set run user metadata"); !s.ok()) return s;
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
  if (checkpoint.kind != "training" && checkpoint.kind != "sampler" && checkpoint.kind != "external") {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint kind '", checkpoint.kind, "' is not 'training', 'sampler' or 'external'"));
  }
  absl::MutexLock lock(&mu_);
  Txn txn(db_, path_);
  if (absl::Status s = txn.Begin(/*write=*/true); !s.ok()) return s;
  absl::StatusOr<bool> exists = RunExists(db_, path_, checkpoint.tenant, checkpoint.run_id);
  if (!exists.ok()) return exists.status();
  if (!*exists) return RunNotFound(checkpoint.run_id);
  Stmt st(db_, path_,
          "INSERT INTO checkpoints (tenant, run_id, checkpoint_id, kind, path, size_bytes, created_us, "
          "expires_us, published) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
          "ON CONFLICT (tenant, run_id, checkpoint_id) DO UPDATE SET kind = excluded.kind, "
          "path = excluded.path, size_bytes = excluded.size_bytes, created_us = excluded.created_us, "
          "expires_us = excluded.expires_us, published = excluded.published");
  st.Bind(checkpoint.tenant)
      .Bind(checkpoint.run_id)
      .Bind(checkpoint.checkpoint_id)
      .Bind(checkpoint.kind)
      .Bind(checkpoint.path)
      .Bind(checkpoint.size_bytes)
      .Bind(Micros(checkpoint.created));
  if (checkpoint.expires) {
    st.Bind(Micros(*checkpoint.expires));
  } else {
    st.BindNull();
  }
  st.Bind(int64_t{checkpoint.published ? 1 : 0});
  if (absl::Status s = st.Run("put checkpoint"); !s.ok()) return s;
  return txn.Commit();
}

absl::StatusOr<CheckpointRecord> Registry::GetCheckpoint(const std::string& tenant, const std::string& run_id,
                                                         const std::string& checkpoint_id) {
  absl::MutexLock lock(&mu_);
  const std::string sql = absl::StrCat("SELECT ", std::string(kCheckpointColumns),
                                       " FROM checkpoints WHERE tenant = ? AND run_id = ? AND checkpoint_id = ?");
  Stmt st(db_, path_, sql.c_str());
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
    const std::string sql = absl::StrCat("SELECT ", std::string(kCheckpointColumns),
                                         " FROM checkpoints WHERE tenant = ? AND run_id = ? "
                                         "ORDER BY created_us, checkpoint_id");
    Stmt st(db_, path_, sql.c_str());
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
  const std::string sql = absl::StrCat("SELECT ", std::string(kCheckpointColumns),
                                       " FROM checkpoints ORDER BY tenant, run_id, created_us, checkpoint_id");
  Stmt st(db_, path_, sql.c_str());
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
// Retention and sharing (v3)

absl::Status Registry::SetCheckpointExpiry(const std::string& tenant, const std::string& run_id,
                                           const std::string& checkpoint_id, std::optional<absl::Time> expires) {
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_, "UPDATE checkpoints SET expires_us = ? WHERE tenant = ? AND run_id = ? AND checkpoint_id = ?");
  if (expires) {
    st.Bind(Micros(*expires));
  } else {
    st.BindNull();
  }
  st.Bind(tenant).Bind(run_id).Bind(checkpoint_id);
  if (absl::Status s = st.Run("set checkpoint expiry"); !s.ok()) return s;
  if (sqlite3_changes64(db_) == 0) return CheckpointNotFound(run_id, checkpoint_id);
  return absl::OkStatus();
}

absl::Status Registry::SetCheckpointPublished(const std::string& tenant, const std::string& run_id,
                                              const std::string& checkpoint_id, bool published) {
  absl::MutexLock lock(&mu_);
  Txn txn(db_, path_);
  if (absl::Status s = txn.Begin(/*write=*/true); !s.ok()) return s;
  {
    Stmt st(db_, path_, "SELECT published FROM checkpoints WHERE tenant = ? AND run_id = ? AND checkpoint_id = ?");
    st.Bind(tenant).Bind(run_id).Bind(checkpoint_id);
    absl::StatusOr<bool> row = st.Step("read checkpoint published");
    if (!row.ok()) return row.status();
    if (!*row) return CheckpointNotFound(run_id, checkpoint_id);
    if ((st.Int(0) != 0) == published) {
      return absl::AlreadyExistsError(absl::StrCat("checkpoint '", checkpoint_id, "' of run '", run_id, "' is already ",
                                                   published ? "published" : "private"));
    }
  }
  Stmt st(db_, path_, "UPDATE checkpoints SET published = ? WHERE tenant = ? AND run_id = ? AND checkpoint_id = ?");
  st.Bind(int64_t{published ? 1 : 0}).Bind(tenant).Bind(run_id).Bind(checkpoint_id);
  if (absl::Status s = st.Run("set checkpoint published"); !s.ok()) return s;
  return txn.Commit();
}

absl::StatusOr<CheckpointRecord> Registry::GetPublishedCheckpoint(const std::string& run_id,
                                                                  const std::string& checkpoint_id) {
  absl::MutexLock lock(&mu_);
  const std::string sql = absl::StrCat("SELECT ", std::string(kCheckpointColumns),
                                       " FROM checkpoints WHERE run_id = ? AND checkpoint_id = ? AND published = 1");
  Stmt st(db_, path_, sql.c_str());
  st.Bind(run_id).Bind(checkpoint_id);
  absl::StatusOr<bool> row = st.Step("get published checkpoint");
  if (!row.ok()) return row.status();
  if (!*row) return CheckpointNotFound(run_id, checkpoint_id);
  return ReadCheckpoint(st);
}

absl::StatusOr<std::vector<CheckpointRecord>> Registry::PublishedCheckpointsOfOthers(const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  const std::string sql = absl::StrCat("SELECT ", std::string(kCheckpointColumns),
                                       " FROM checkpoints WHERE published = 1 AND tenant <> ? "
                                       "ORDER BY tenant, run_id, created_us, checkpoint_id");
  Stmt st(db_, path_, sql.c_str());
  st.Bind(tenant);
  std::vector<CheckpointRecord> out;
  for (;;) {
    absl::StatusOr<bool> row = st.Step("list published checkpoints");
    if (!row.ok()) return row.status();
    if (!*row) break;
    out.push_back(ReadCheckpoint(st));
  }
  return out;
}

absl::StatusOr<std::vector<CheckpointRecord>> Registry::ExpiredCheckpoints(absl::Time now, int32_t limit) {
  if (limit < 0) return absl::InvalidArgumentError("limit must not be negative");
  absl::MutexLock lock(&mu_);
  const std::string sql = absl::StrCat("SELECT ", std::string(kCheckpointColumns),
                                       " FROM checkpoints WHERE expires_us IS NOT NULL AND expires_us <= ? "
                                       "ORDER BY expires_us, tenant, run_id, checkpoint_id LIMIT ?");
  Stmt st(db_, path_, sql.c_str());
  st.Bind(Micros(now)).Bind(int64_t{limit});
  std::vector<CheckpointRecord> out;
  for (;;) {
    absl::StatusOr<bool> row = st.Step("list expired checkpoints");
    if (!row.ok()) return row.status();
    if (!*row) break;
    out.push_back(ReadCheckpoint(st));
  }
  return out;
}

absl::StatusOr<int64_t> Registry::TenantStorageBytes(const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_, "SELECT COALESCE(SUM(size_bytes), 0) FROM checkpoints WHERE tenant = ?");
  st.Bind(tenant);
  absl::StatusOr<bool> row = st.Step("sum tenant storage");
  if (!row.ok()) return row.status();
  return *row ? st.Int(0) : 0;
}

absl::StatusOr<std::vector<std::pair<std::string, int64_t>>> Registry::StorageBytesByTenant() {
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_, "SELECT tenant, SUM(size_bytes) FROM checkpoints GROUP BY tenant ORDER BY tenant");
  std::vector<std::pair<std::string, int64_t>> out;
  for (;;) {
    absl::StatusOr<bool> row = st.Step("sum storage by tenant");
    if (!row.ok()) return row.status();
    if (!*row) break;
    out.emplace_back(st.Text(0), st.Int(1));
  }
  return out;
}

}  // namespace twinkle::registry
