#include "core/futures/future_store.h"

#include <utility>
#include <vector>

namespace twinkle {

struct FutureStore::Entry {
  std::string tenant;
  bool done = false;
  // Written once, under mu_, before `done` turns true; read-only afterwards, so readers that
  // saw done == true may read it without the lock (they hold the entry by shared_ptr).
  FutureResult result = absl::UnknownError("future not completed");
  absl::Time completed_at;
  std::vector<std::function<void(const FutureResult&)>> callbacks;
};

FutureStore::FutureStore(absl::Duration retention, const Clock& clock)
    : retention_(retention), clock_(clock) {}

void FutureStore::Create(uint64_t id, const std::string& tenant) {
  auto entry = std::make_shared<Entry>();
  entry->tenant = tenant;
  {
    absl::MutexLock lock(&mu_);
    // Ids are unique by contract; a repeated Create keeps the first future (and its result).
    if (!entries_.try_emplace(id, std::move(entry)).second) return;
    ++pending_;
  }
  if (journal_ != nullptr) journal_->Created(id, tenant);
}

void FutureStore::Complete(uint64_t id, FutureResult result) {
  std::shared_ptr<Entry> entry;
  std::vector<std::function<void(const FutureResult&)>> callbacks;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(id);
    if (it == entries_.end() || it->second->done) return;  // unknown or already completed
    entry = it->second;
    entry->result = std::move(result);
    entry->completed_at = clock_.Now();
    --pending_;
    entry->done = true;  // waiters in Wait() see this through their Condition
    callbacks.swap(entry->callbacks);
  }
  if (journal_ != nullptr) journal_->Completed(id, entry->tenant, entry->result);
  // Outside the lock: a callback may call back into the store (or into the scheduler).
  for (auto& done : callbacks) done(entry->result);
}

absl::StatusOr<FutureResult> FutureStore::Wait(uint64_t id, const std::string& tenant,
                                               absl::Duration timeout) {
  absl::ReleasableMutexLock lock(&mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) {
    lock.Release();
    // Not this process's (issued before a restart) or expired from memory: the journal knows.
    if (journal_ != nullptr) return journal_->Lookup(id, tenant);
    return absl::NotFoundError("no such future");
  }
  if (it->second->tenant != tenant) return absl::NotFoundError("no such future");
  std::shared_ptr<Entry> entry = it->second;  // stays alive even if Expire() drops it
  if (!mu_.AwaitWithTimeout(absl::Condition(&entry->done), timeout)) {
    return absl::UnavailableError("still pending");
  }
  return entry->result;
}

absl::Status FutureStore::OnComplete(uint64_t id, const std::string& tenant,
                                     std::function<void(const FutureResult&)> done) {
  std::shared_ptr<Entry> entry;
  {
    absl::ReleasableMutexLock lock(&mu_);
    auto it = entries_.find(id);
    if (it == entries_.end() && journal_ != nullptr) {
      lock.Release();
      absl::StatusOr<FutureResult> stored = journal_->Lookup(id, tenant);
      if (!stored.ok()) return stored.status();
      done(*stored);
      return absl::OkStatus();
    }
    if (it == entries_.end() || it->second->tenant != tenant) {
      return absl::NotFoundError("no such future");
    }
    entry = it->second;
    if (!entry->done) {
      entry->callbacks.push_back(std::move(done));
      return absl::OkStatus();
    }
  }
  done(entry->result);  // already complete: at once, on this thread, outside the lock
  return absl::OkStatus();
}

int64_t FutureStore::Expire() {
  const absl::Time cutoff = clock_.Now() - retention_;
  absl::MutexLock lock(&mu_);
  int64_t dropped = 0;
  for (auto it = entries_.begin(); it != entries_.end();) {
    const Entry& e = *it->second;
    if (e.done && e.completed_at <= cutoff) {
      entries_.erase(it++);
      ++dropped;
    } else {
      ++it;
    }
  }
  return dropped;
}

int64_t FutureStore::pending() const {
  absl::MutexLock lock(&mu_);
  return pending_;
}

}  // namespace twinkle
