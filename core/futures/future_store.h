#pragma once
// Results of queued ops, by future id, until a client collects them or they expire.
//
// Every op gets its future id when it is queued; the scheduler Completes it; clients Wait
// for it with a timeout (the gRPC blocking calls and the HTTP long-poll both sit on Wait).
// A future belongs to a tenant: another tenant's id is NotFound, exactly like an unknown id.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

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
};

class FutureStore {
 public:
  // retention: how long a completed future stays fetchable after it completed.
  explicit FutureStore(absl::Duration retention = absl::Hours(24), const Clock& clock = RealClock());

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

  // Futures created and not yet completed.
  int64_t pending() const;

  // Set before use; not owned. Without one, futures live in memory only.
  void SetJournal(FutureJournal* journal) { journal_ = journal; }

 private:
  struct Entry;
  const absl::Duration retention_;
  const Clock& clock_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  int64_t pending_ ABSL_GUARDED_BY(mu_) = 0;  // entries not yet completed
  FutureJournal* journal_ = nullptr;
};

}  // namespace twinkle
