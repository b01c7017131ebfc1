#pragma once
// The run registry: what must survive a restart of the whole server, in one SQLite file
// (WAL mode, synchronous=FULL, so a committed row survives kill -9 and power loss).
//
//   sessions     id, tenant, created, last_heartbeat
//   runs         run_id, tenant, adapter_name, base_model, lora config (JSON), created,
//                last_request, last_step, user metadata (JSON, v2)
//   checkpoints  tenant, run_id, checkpoint_id ("weights/<name>" | "sampler_weights/<name>" |
//                "external_weights/<name>"), kind ("training" | "sampler" | "external"), path,
//                size_bytes, created, expires (v4; NULL = never), published (v4)
//                (a checkpoint belongs to one of its tenant's runs: foreign key)
//   futures      id, tenant, state ("pending" | "done" | "failed" | "interrupted"),
//                result (opaque bytes, the caller's serialisation), error code + message,
//                created, updated
//   counters     max_future_id (a high-water mark that survives ExpireFutures)
//   (v3) sessions also hold tags, user_metadata, project_id, display_name, key_id, finished;
//   tenants      id, source ("config" | "admin"), created
//   api_keys     key_id (never reused), tenant, key_sha256 (the digest, never the key), role,
//                name, source, created, revoked
//   projects     tenant, project_id, created
//   usage        hourly counters: bucket, tenant, key_id, session_id, run_id, kind, amount
//   audit        append-only (UPDATE is refused by a trigger): seq, at, tenant, key_id,
//                action, object, peer, details (JSON); ExpireAudit is the only delete
//   (v5) sampling_sessions  id, tenant, model_path, owner, live, created: the open sampling
//                sessions, so a sampling client outlives a restart (core/sampling reopens it)
//
// Every read and delete takes the tenant: another tenant's row is NotFound, with the same
// message as an unknown one. A write that names an id another tenant owns (PutSession,
// PutRun, PutFuture) is AlreadyExists and changes nothing; the message never names the owner.
// The schema carries a version (PRAGMA user_version); Open applies the migrations from
// the file's version to the newest in one transaction each, and refuses a file newer than
// this binary (FailedPrecondition naming both versions).
//
// Times are stored as integer unix microseconds (sub-microsecond parts are dropped, rounding
// toward the past). Every statement is prepared with bound parameters; strings are stored
// byte for byte. SQLite errors come back as: busy/locked → Unavailable, disk full →
// ResourceExhausted, corrupt → DataLoss, not a database / cannot open → FailedPrecondition,
// anything else → Internal; each message names the database file.
//
// Thread-safe: one connection guarded by a mutex (the registry is small and its writes are
// rare next to a training step). Another process may open the same file (busy_timeout 5 s).

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

struct sqlite3;

namespace twinkle::registry {

struct RunRecord {
  std::string run_id;
  std::string tenant;
  std::string adapter_name;
  std::string base_model;
  std::string lora_config_json;  // {"r":…, "lora_alpha":…, "target_modules":[…], …}
  absl::Time created;
  absl::Time last_request;
  int64_t last_step = 0;
  // Tinker's create_model user_metadata as a JSON object ("" = none). Not written by PutRun
  // (which keeps it): SetRunUserMetadata sets it.
  std::string user_metadata_json;
};

struct CheckpointRecord {
  std::string tenant;
  std::string run_id;
  std::string checkpoint_id;  // "weights/<name>", "sampler_weights/<name>" or "external_weights/<name>"
  std::string kind;           // "training" | "sampler" | "external"
  std::string path;           // absolute directory
  int64_t size_bytes = 0;
  absl::Time created;
  std::optional<absl::Time> expires;  // the reaper deletes it once the clock passes this
  bool published = false;             // readable (never writable) by every tenant
};

struct FutureRecord {
  uint64_t id = 0;
  std::string tenant;
  std::string state;   // pending | done | failed | interrupted
  std::string result;  // done: the caller's serialised result
  int32_t error_code = 0;  // failed: an absl::StatusCode
  std::string error_message;
  absl::Time created;
  absl::Time updated;
};

struct SessionRecord {
  std::string id;
  std::string tenant;
  absl::Time created;
  absl::Time last_heartbeat;
  // v3: what create_session carried (SetSessionMetadata) and where it stands.
  std::string tags_json = "[]";     // a JSON array of strings
  std::string user_metadata_json;   // a JSON object ("" = none)
  std::string project_id;           // "" = none
  std::string display_name;         // "" = none
  int64_t key_id = 0;               // the API key that created it (0 = unknown / auth off)
  absl::Time finished = absl::InfinitePast();  // InfinitePast: not finished
};

// An open sampling session as the sampler reopens it after a restart (v5).
struct SamplingSessionRecord {
  std::string id;
  std::string tenant;
  std::string model_path;  // "" = the base model; a checkpoint path otherwise
  std::string owner;       // the training session it belongs to, or ""
  bool live = false;       // on an unnamed snapshot of a training adapter: not kept across restarts
  absl::Time created;
  std::string base_model;  // (v6) the served model it samples on; "" = the default (first) model
};

// ---- v3: runtime keys, usage and audit (registry_keys.cc, registry_usage.cc,
// registry_audit.cc). Keys are stored as SHA-256 digests only.

struct ApiKeyRecord {
  int64_t key_id = 0;       // assigned by InsertKey (positive, never reused)
  std::string tenant;
  std::string key_sha256;   // 64 lower-case hex digits
  std::string role;         // "admin" | "member" | "read-only"
  std::string name;
  std::string source;       // "config" (the bootstrap set) | "admin" (created at runtime)
  absl::Time created;
  absl::Time revoked = absl::InfinitePast();  // InfinitePast: active
  bool active() const { return revoked == absl::InfinitePast(); }
};

struct TenantRecord {
  std::string id;
  std::string source;  // "config" | "admin"
  absl::Time created;
};

// One usage counter: `amount` of `kind` in the hour starting at `bucket`.
struct UsageRecord {
  absl::Time bucket;  // a UTC hour boundary
  std::string tenant;
  int64_t key_id = 0;
  std::string session_id;
  std::string run_id;
  std::string kind;  // training | forward | prefill | sampled | optim_steps | storage_byte_seconds
  int64_t amount = 0;
  std::string base_model;  // (v6) the served model it was used on; "" = the default (first) model
};

struct AuditRecord {
  int64_t seq = 0;  // assigned by AppendAudit
  absl::Time at;
  std::string tenant;  // whose key acted ("" when none)
  int64_t key_id = 0;  // never the key
  std::string action;  // e.g. "key_create", "checkpoint_delete"
  std::string object;  // what it acted on
  std::string peer;    // where the call came from
  std::string details_json = "{}";
};

// SearchSessions' filters (all optional; every given one must hold).
struct SessionFilter {
  std::string session_id;      // exact; with display_name, either may match
  std::string display_name;    // case-insensitive words, each a substring
  std::vector<std::string> project_ids;
  std::vector<std::pair<std::string, std::string>> user_metadata;  // exact string pairs
  std::vector<std::string> statuses;  // "active" | "client_finished" (empty = any)
  // Cursor: rows strictly older than (created, id) in (created desc, id desc) order.
  std::optional<std::pair<absl::Time, std::string>> after;
};

// limit 0 returns no rows (only the total); a negative limit or offset is InvalidArgument.
struct Page {
  int32_t limit = 20;
  int32_t offset = 0;
};

class Registry {
 public:
  static constexpr int kSchemaVersion = 6;

  // Opens (creating when absent) the database file and migrates it. NotFound naming the
  // path when its parent directory does not exist; FailedPrecondition when the file is not a
  // SQLite database or its schema is newer than kSchemaVersion.
  static absl::StatusOr<std::unique_ptr<Registry>> Open(const std::string& path);
  ~Registry();  // closes the connection; every Put* has committed by the time it returned

  // Sessions. PutSession inserts (created = last_heartbeat = now), or for an existing id of
  // the same tenant sets last_heartbeat = now; another tenant's id is AlreadyExists.
  absl::Status PutSession(const std::string& id, const std::string& tenant, absl::Time now);
  // Sets last_heartbeat; NotFound for an unknown id or another tenant's.
  absl::Status TouchSession(const std::string& id, const std::string& tenant, absl::Time now);
  absl::StatusOr<SessionRecord> GetSession(const std::string& id, const std::string& tenant);
  absl::Status DeleteSession(const std::string& id, const std::string& tenant);

  // Open sampling sessions (v5). Put inserts or replaces by id (another tenant's id is
  // AlreadyExists); Delete of an unknown id is OK (a release may race a restart's cleanup);
  // List returns every tenant's, oldest first, for the sampler's start.
  absl::Status PutSamplingSession(const SamplingSessionRecord& record);
  absl::Status DeleteSamplingSession(const std::string& id, const std::string& tenant);
  absl::StatusOr<std::vector<SamplingSessionRecord>> ListSamplingSessions();

  // Runs: insert, or overwrite every field of an existing run_id of the same tenant (the
  // record is written as given, `created` included); another tenant's run_id is
  // AlreadyExists and its row is left as it was. Empty run_id or tenant: InvalidArgument.
  absl::Status PutRun(const RunRecord& run);
  // Sets last_request = now and last_step; NotFound for an unknown or another tenant's run.
  absl::Status TouchRun(const std::string& tenant, const std::string& run_id, absl::Time now, int64_t last_step);
  absl::StatusOr<RunRecord> GetRun(const std::string& tenant, const std::string& run_id);
  // Sets the run's user_metadata_json; NotFound for an unknown or another tenant's run.
  absl::Status SetRunUserMetadata(const std::string& tenant, const std::string& run_id, const std::string& json);
  // Newest first (created descending, then run_id descending); `total` (may be null) receives
  // the tenant's run count, read in the same transaction as the page.
  absl::StatusOr<std::vector<RunRecord>> ListRuns(const std::string& tenant, Page page, int32_t* total);

  // Checkpoints: insert or replace by (tenant, run_id, checkpoint_id). The run must be one of
  // the tenant's (NotFound, with GetRun's message, otherwise); kind must be "training" or
  // "sampler" (InvalidArgument).
  absl::Status PutCheckpoint(const CheckpointRecord& checkpoint);
  absl::StatusOr<CheckpointRecord> GetCheckpoint(const std::string& tenant, const std::string& run_id,
                                                 const std::string& checkpoint_id);
  // Oldest first (created, then checkpoint_id). NotFound (GetRun's message) for an unknown
  // or another tenant's run; an empty list for a run without checkpoints.
  absl::StatusOr<std::vector<CheckpointRecord>> ListCheckpoints(const std::string& tenant,
                                                                const std::string& run_id);
  absl::Status DeleteCheckpoint(const std::string& tenant, const std::string& run_id,
                                const std::string& checkpoint_id);
  // Every checkpoint of every tenant (startup reconciliation), by tenant, run, created.
  absl::StatusOr<std::vector<CheckpointRecord>> AllCheckpoints();

  // Retention and sharing (v4). Each is NotFound (GetCheckpoint's message) for an unknown or
  // another tenant's checkpoint.
  // Sets (a time) or clears (nullopt) the checkpoint's expiry.
  absl::Status SetCheckpointExpiry(const std::string& tenant, const std::string& run_id,
                                   const std::string& checkpoint_id, std::optional<absl::Time> expires);
  // Publishes or unpublishes; AlreadyExists when it already is in that state (nothing changes).
  absl::Status SetCheckpointPublished(const std::string& tenant, const std::string& run_id,
                                      const std::string& checkpoint_id, bool published);
  // A published checkpoint of any tenant by run and id (run ids are unique server-wide);
  // NotFound, with GetCheckpoint's message, when there is none or it is not published.
  absl::StatusOr<CheckpointRecord> GetPublishedCheckpoint(const std::string& run_id,
                                                          const std::string& checkpoint_id);
  // Every published checkpoint of tenants other than `tenant`, by tenant, run, created.
  absl::StatusOr<std::vector<CheckpointRecord>> PublishedCheckpointsOfOthers(const std::string& tenant);
  // Checkpoints whose expiry is at or before `now`, oldest expiry first, at most `limit`.
  absl::StatusOr<std::vector<CheckpointRecord>> ExpiredCheckpoints(absl::Time now, int32_t limit);
  // The sum of size_bytes of the tenant's checkpoints (0 when none).
  absl::StatusOr<int64_t> TenantStorageBytes(const std::string& tenant);
  // (tenant, bytes) for every tenant with a checkpoint, by tenant.
  absl::StatusOr<std::vector<std::pair<std::string, int64_t>>> StorageBytesByTenant();

  // Futures. Ids are uint64 in the API but SQLite integers are int64: ids must lie in
  // [1, 2^63 - 1] (InvalidArgument otherwise), which the process counter never leaves.
  // PutFuture inserts or replaces every field by id; another tenant's id is AlreadyExists.
  // state must be one of the four above (InvalidArgument). The tenant may be empty (a
  // bookkeeping row, e.g. a boot marker: readable only with tenant "", still counted by
  // MaxFutureId and dropped by ExpireFutures like any finished future).
  absl::Status PutFuture(const FutureRecord& future);
  absl::StatusOr<FutureRecord> GetFuture(uint64_t id, const std::string& tenant);
  // Forgets the tenant's future `id` (OK when there is none; MaxFutureId keeps counting it).
  absl::Status DeleteFuture(uint64_t id, const std::string& tenant);
  // Startup: every pending future becomes "interrupted" (its work died with the old process),
  // with updated = now, error_code = ABORTED and a message saying the server restarted.
  // Returns how many.
  absl::StatusOr<int64_t> InterruptPendingFutures(absl::Time now);
  // Drops finished (done, failed, interrupted) futures last updated before `cutoff`; pending
  // ones never expire. Returns how many.
  absl::StatusOr<int64_t> ExpireFutures(absl::Time cutoff);
  // The largest future id ever recorded (0 when none), kept even after its row expired: ids
  // continue above it after a restart.
  absl::StatusOr<uint64_t> MaxFutureId();

  // ---- v3: session metadata (registry_sessions.cc) ----
  // Sets tags, user_metadata, project, display name and key of the tenant's session.
  absl::Status SetSessionMetadata(const SessionRecord& meta);
  absl::Status SetSessionProject(const std::string& id, const std::string& tenant, const std::string& project_id);
  absl::Status FinishSession(const std::string& id, const std::string& tenant, absl::Time now);
  // Newest first (created descending, then id descending); `total` (may be null) receives the
  // tenant's session count.
  absl::StatusOr<std::vector<SessionRecord>> ListSessions(const std::string& tenant, Page page, int32_t* total);
  // Up to `limit` sessions of the tenant matching `filter`, newest first.
  absl::StatusOr<std::vector<SessionRecord>> SearchSessions(const std::string& tenant, const SessionFilter& filter,
                                                            int32_t limit);

  // ---- v3: tenants, keys, projects (registry_keys.cc) ----
  // Inserts the tenant when absent (an existing one keeps its source and created time).
  absl::Status PutTenant(const std::string& id, const std::string& source, absl::Time now);
  absl::StatusOr<std::vector<TenantRecord>> ListTenants();
  // The bootstrap set: a config key is inserted when its digest is new, else its tenant and
  // role follow the config (a revoked key stays revoked). Config keys whose digest is not in
  // `digests` any more are revoked at `now`. Returns nothing; one transaction.
  absl::Status BootstrapConfigKeys(const std::vector<ApiKeyRecord>& keys, absl::Time now);
  // Inserts a new key (key_id assigned; source and created as given). AlreadyExists when the
  // digest is already stored; NotFound when the tenant is unknown.
  absl::StatusOr<ApiKeyRecord> InsertKey(ApiKeyRecord key);
  // Every key (tenant "" = all tenants), revoked ones included, by key_id.
  absl::StatusOr<std::vector<ApiKeyRecord>> ListKeys(const std::string& tenant);
  absl::StatusOr<ApiKeyRecord> GetKey(int64_t key_id);
  // Revokes the key (NotFound when unknown; a revoked key stays as it was). Returns the row.
  absl::StatusOr<ApiKeyRecord> RevokeKey(int64_t key_id, absl::Time now);
  absl::StatusOr<ApiKeyRecord> SetKeyRole(int64_t key_id, const std::string& role);
  // One transaction: the active key `key_id` is revoked and a key with `new_sha256`, the same
  // tenant, role and name is inserted (FailedPrecondition when `key_id` is revoked).
  absl::StatusOr<ApiKeyRecord> RotateKey(int64_t key_id, const std::string& new_sha256, absl::Time now);
  absl::Status PutProject(const std::string& tenant, const std::string& project_id, absl::Time now);

  // ---- v3: usage (registry_usage.cc) ----
  // Adds every row's amount to its counter (one transaction).
  absl::Status AddUsage(const std::vector<UsageRecord>& rows);
  // Counters with bucket in [from, to), tenant "" = all; by bucket, tenant, key, session, run, kind.
  absl::StatusOr<std::vector<UsageRecord>> ListUsage(const std::string& tenant, absl::Time from, absl::Time to);

  // ---- v3: audit (registry_audit.cc) ----
  absl::StatusOr<int64_t> AppendAudit(const AuditRecord& record);
  // Rows with at in [from, to), oldest first; tenant "" = all; at most `limit`.
  absl::StatusOr<std::vector<AuditRecord>> ListAudit(const std::string& tenant, absl::Time from, absl::Time to,
                                                     int32_t limit);
  // Drops rows older than `cutoff` (retention); returns how many.
  absl::StatusOr<int64_t> ExpireAudit(absl::Time cutoff);

 private:
  Registry(sqlite3* db, std::string path) : db_(db), path_(std::move(path)) {}
  absl::Status Migrate() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  sqlite3* db_ ABSL_GUARDED_BY(mu_);
  const std::string path_;  // for error messages
};

}  // namespace twinkle::registry
