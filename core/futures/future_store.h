#pragma once
// Results of queued ops, by future id, until a client collects them or they expire.
//
// This is the one future store of the server, for every API: every op gets its future id
// when it is queued and the scheduler Completes it; a transport that answers with request
// ids of its own (Tinker) makes each one a future here too (ids from NewFutureId(),
// completed with an EncodedResult), so every id the server hands out lives in one place,
// is journaled in one place and is bounded in one place. Clients Wait for a future with a
// timeout or register a callback (the gRPC calls and the HTTP long-poll).
// A future belongs to a tenant: another tenant's id is NotFound, exactly like an unknown id.
//
// Retained results are bounded per tenant: by age (retention), by count and by bytes
// (FutureStoreOptions). Over a bound, the tenant's oldest finished results are dropped
// first; fetching a dropped one answers FAILED_PRECONDITION naming the bound (through the
// journal, which records the drop), never another result and never a bare NOT_FOUND.

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/common/clock.h"
#include "core/futures/future_value.h"

namespace twinkle {

// A finished op: its typed value, or the error it failed with.
using FutureResult = absl::StatusOr<FutureValue>;

// Makes futures outlive the process: told of every creation and completion, asked about ids
// the store does not hold (issued before a restart). Implementations must not block for
// long: Created runs under the scheduler's lock.
class FutureJournal {
 public:
  virtual ~FutureJournal() = default;
  virtual void Created(uint64_t id, const std::string& tenant) = 0;
  virtual void Completed(uint64_t id, const std::string& tenant, const FutureResult& result) = 0;
  // The outcome of a future this process does not hold: its stored result, or an error
  // saying it was interrupted by a restart. NotFound when the journal never saw it (or it
  // is another tenant's).
  virtual absl::StatusOr<FutureResult> Lookup(uint64_t id, const std::string& tenant) = 0;
  // A finished future left memory before its retention ran out: `why` OK means forget it
  // (its owner released it), else its result is replaced by `why` (it was dropped over a
  // bound), so a later fetch says so.
  virtual void Dropped(uint64_t id, const std::string& tenant, const absl::Status& why) {}
};

// A fresh future id, unique for the process (and, once seeded from the journal, across
// restarts): one counter for the scheduler's ops and the transports' request ids.
uint64_t NewFutureId();
// Makes NewFutureId() return at least `next` from now on.
void SeedFutureIds(uint64_t next);

struct FutureStoreOptions {
  absl::Duration retention = absl::Hours(24);  // a finished future stays fetchable this long
  // Finished results held per tenant at most (count and approximate bytes); 0 = unbounded.
  int64_t max_results_per_tenant = 0;
  int64_t max_result_bytes_per_tenant = 0;
  // The config keys of the bounds, named in the error a dropped result answers.
  std::string results_key = "sessions.max_retained_results";
  std::string bytes_key = "sessions.max_retained_result_bytes";
};

class FutureStore {
 public:
  // retention: how long a completed future stays fetchable after it completed.
  explicit FutureStore(absl::Duration retention = absl::Hours(24), const Clock& clock = RealClock());
  explicit FutureStore(FutureStoreOptions options, const Clock& clock = RealClock());

  // Registers a pending future for `tenant`. Ids are unique for the process lifetime (a
  // repeated Create of a known id is ignored).
  void Create(uint64_t id, const std::string& tenant);

  // Sets the result (first completion wins; later ones and unknown ids are ignored) and
  // wakes waiters and the callbacks registered with OnComplete. Callbacks run on this thread
  // after the store's lock is released, each exactly once.
  void Complete(uint64_t id, FutureResult result);

  // Blocks until the future completes or `timeout` passes. NotFound for an unknown id or
  // another tenant's; DeadlineExceeded-free: on timeout returns std::nullopt-like
  // Unavailable("still pending") so callers can tell "not yet" from a failed op:
  //   ok(result)                 the op finished; `result` itself may hold the op's error
  //   NotFound                   no such future for this tenant
  //   Unavailable                still pending after `timeout`
  absl::StatusOr<FutureResult> Wait(uint64_t id, const std::string& tenant, absl::Duration timeout);

  // Calls `done` once the future completes (at once, on this thread, if it already has);
  // otherwise on the completing thread. For the gRPC callback API, which must not block.
  // NotFound as for Wait.
  absl::Status OnComplete(uint64_t id, const std::string& tenant,
                          std::function<void(const FutureResult&)> done);

  // Drops completed futures older than the retention. Returns how many were dropped.
  // Pending futures never expire (the scheduler always completes what it queued).
  int64_t Expire();

  // Forgets a completed future at once (memory and journal): for an op whose result a
  // transport has copied into a future of its own. A pending or unknown id is left alone.
  void Release(uint64_t id);

  // Whether the store still holds `id` (pending, or finished and not yet dropped or expired):
  // what a transport's side tables keyed by the same ids follow, so they are bounded by
  // exactly the store's bounds.
  bool Holds(uint64_t id) const;

  // Futures created and not yet completed.
  int64_t pending() const;
  // A tenant's finished results held in memory: (count, approximate bytes).
  std::pair<int64_t, int64_t> retained(const std::string& tenant) const;

  // Set before use; not owned. Without one, futures live in memory only.
  void SetJournal(FutureJournal* journal) { journal_ = journal; }

 private:
  struct Entry;
  // A tenant's finished futures in memory, oldest (smallest id) first, and their bytes.
  struct Retained {
    std::set<uint64_t> ids;
    int64_t bytes = 0;
  };
  using Drops = std::vector<std::pair<std::shared_ptr<Entry>, absl::Status>>;
  // Erases a finished entry and its accounting; `why` goes to the journal.
  void DropLocked(uint64_t id, absl::Status why, Drops* drops) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Journal(const Drops& drops);

  const FutureStoreOptions options_;
  const Clock& clock_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Retained> retained_ ABSL_GUARDED_BY(mu_);
  int64_t pending_ ABSL_GUARDED_BY(mu_) = 0;  // entries not yet completed
  FutureJournal* journal_ = nullptr;
};

}  // namespace twinkle
