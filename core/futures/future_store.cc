#include "core/futures/future_store.h"

#include <atomic>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/cord.h"

namespace twinkle {
namespace {

// One counter for every future id of the process (see NewFutureId).
std::atomic<uint64_t> g_next_id{1};

constexpr char kInterruptedMessage[] =
    "interrupted by a restart: the server stopped before this operation finished; submit it again";

int64_t FloatBytes(size_t n) { return static_cast<int64_t>(n * sizeof(float)); }

}  // namespace

uint64_t NewFutureId() { return g_next_id.fetch_add(1, std::memory_order_relaxed); }

void SeedFutureIds(uint64_t next) {
  uint64_t current = g_next_id.load();
  while (current < next && !g_next_id.compare_exchange_weak(current, next)) {
  }
}

absl::Status InterruptedByRestart() {
  absl::Status s = absl::AbortedError(kInterruptedMessage);
  s.SetPayload(kInterruptedByRestartUrl, absl::Cord("1"));
  return s;
}

bool IsInterruptedByRestart(const absl::Status& status) {
  if (status.GetPayload(kInterruptedByRestartUrl).has_value()) return true;
  return absl::IsAborted(status) && absl::StartsWith(status.message(), "interrupted by a restart");
}

absl::Status Gone(absl::string_view message) {
  absl::Status s = absl::FailedPreconditionError(message);
  s.SetPayload(kGoneUrl, absl::Cord("1"));
  return s;
}

bool IsGone(const absl::Status& status) { return status.GetPayload(kGoneUrl).has_value(); }

int64_t FutureValueBytes(const FutureValue& value) {
  struct Sizer {
    int64_t operator()(const training::OpOutput& o) const {
      int64_t n = static_cast<int64_t>(o.text.size() + o.checkpoint_uri.size() + o.checkpoint_dir.size());
      for (const training::SequenceResult& s : o.sequences) n += FloatBytes(s.logps.size() + s.loss.size());
      for (const auto& [name, t] : o.tensors) n += static_cast<int64_t>(name.size()) + FloatBytes(t.values.size());
      for (const auto& [k, v] : o.metric_strings) n += static_cast<int64_t>(k.size() + v.size());
      return n + static_cast<int64_t>(o.metrics.size() * 16);
    }
    int64_t operator()(const sampling::SampleOutput& o) const {
      int64_t n = 0;
      for (const sampling::PromptOutput& p : o.prompts) {
        n += FloatBytes(p.prompt_logprobs.size());
        for (const sampling::SampledSequence& s : p.sequences) {
          n += static_cast<int64_t>(s.tokens.size() * sizeof(int64_t)) + FloatBytes(s.logprobs.size());
        }
      }
      return n;
    }
    int64_t operator()(const sampling::SnapshotSession& o) const {
      return static_cast<int64_t>(o.sampling_session_id.size());
    }
    int64_t operator()(const EncodedResult& o) const { return static_cast<int64_t>(o.json.size() + o.proto.size()); }
    int64_t operator()(const Deferred&) const { return 0; }
  };
  // Every entry costs something, so the byte bound also bounds a flood of tiny results.
  return 64 + std::visit(Sizer{}, value);
}

struct FutureStore::Entry {
  uint64_t id = 0;
  std::string tenant;
  bool done = false;
  // Written once, under mu_, before `done` turns true; read-only afterwards, so readers that
  // saw done == true may read it without the lock (they hold the entry by shared_ptr).
  FutureResult result = absl::UnknownError("future not completed");
  absl::Time completed_at;
  int64_t bytes = 0;  // FutureValueBytes of the result, once done
  std::vector<std::function<void(const FutureResult&)>> callbacks;
};

FutureStore::FutureStore(absl::Duration retention, const Clock& clock)
    : FutureStore(FutureStoreOptions{.retention = retention}, clock) {}

FutureStore::FutureStore(FutureStoreOptions options, const Clock& clock)
    : options_(std::move(options)), clock_(clock) {}

void FutureStore::Create(uint64_t id, const std::string& tenant) {
  auto entry = std::make_shared<Entry>();
  entry->id = id;
  entry->tenant = tenant;
  {
    absl::MutexLock lock(&mu_);
    // Ids are unique by contract; a repeated Create keeps the first future (and its result).
    if (!entries_.try_emplace(id, std::move(entry)).second) return;
    ++pending_;
  }
  if (journal_ != nullptr) journal_->Created(id, tenant);
}

void FutureStore::DropLocked(uint64_t id, absl::Status why, Drops* drops) {
  auto it = entries_.find(id);
  if (it == entries_.end() || !it->second->done) return;
  std::shared_ptr<Entry> entry = it->second;
  entries_.erase(it);
  auto r = retained_.find(entry->tenant);
  if (r != retained_.end()) {
    r->second.ids.erase(id);
    r->second.bytes -= entry->bytes;
    if (r->second.ids.empty()) retained_.erase(r);
  }
  drops->emplace_back(std::move(entry), std::move(why));
}

void FutureStore::Journal(const Drops& drops) {
  if (journal_ == nullptr) return;
  for (const auto& [entry, why] : drops) journal_->Dropped(entry->id, entry->tenant, why);
}

void FutureStore::Complete(uint64_t id, FutureResult result) {
  std::shared_ptr<Entry> entry;
  std::vector<std::function<void(const FutureResult&)>> callbacks;
  Drops drops;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(id);
    if (it == entries_.end() || it->second->done) return;  // unknown or already completed
    entry = it->second;
    entry->result = std::move(result);
    entry->completed_at = clock_.Now();
    entry->bytes = entry->result.ok() ? FutureValueBytes(*entry->result)
                                      : 64 + static_cast<int64_t>(entry->result.status().message().size());
    --pending_;
    entry->done = true;  // waiters in Wait() see this through their Condition
    callbacks.swap(entry->callbacks);
    Retained& r = retained_[entry->tenant];
    r.ids.insert(id);
    r.bytes += entry->bytes;
    // Over a bound: the tenant's oldest finished results go first (never this one).
    const auto over_count = [&] {
      return options_.max_results_per_tenant > 0 && static_cast<int64_t>(r.ids.size()) > options_.max_results_per_tenant;
    };
    const auto over_bytes = [&] {
      return options_.max_result_bytes_per_tenant > 0 && r.bytes > options_.max_result_bytes_per_tenant;
    };
    while (r.ids.size() > 1 && (over_count() || over_bytes())) {
      const std::string key = over_count() ? options_.results_key : options_.bytes_key;
      const int64_t bound =
          over_count() ? options_.max_results_per_tenant : options_.max_result_bytes_per_tenant;
      const uint64_t oldest = *r.ids.begin() == id ? *std::next(r.ids.begin()) : *r.ids.begin();
      absl::Status why = absl::FailedPreconditionError(absl::StrCat(
          "the result of this operation was dropped: your finished results passed ", key, " (", bound,
          "); the oldest go first. Fetch results sooner, or keep fewer requests outstanding"));
      // Erase through the map iterator only after computing everything from `r`.
      DropLocked(oldest, std::move(why), &drops);
      if (!retained_.contains(entry->tenant)) break;
    }
  }
  if (journal_ != nullptr) journal_->Completed(id, entry->tenant, entry->result);
  Journal(drops);
  // Outside the lock: a callback may call back into the store (or into the scheduler).
  for (auto& done : callbacks) done(entry->result);
}

absl::StatusOr<FutureResult> FutureStore::Wait(uint64_t id, const std::string& tenant,
                                               absl::Duration timeout) {
  absl::ReleasableMutexLock lock(&mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) {
    lock.Release();
    // Not this process's (issued before a restart), expired or dropped from memory: the
    // journal knows.
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
  const absl::Time cutoff = clock_.Now() - options_.retention;
  Drops drops;
  {
    absl::MutexLock lock(&mu_);
    std::vector<uint64_t> old;
    for (const auto& [id, e] : entries_) {
      if (e->done && e->completed_at <= cutoff) old.push_back(id);
    }
    // Past its retention the journal forgets it on its own (Registry::ExpireFutures).
    for (uint64_t id : old) DropLocked(id, absl::OkStatus(), &drops);
  }
  return static_cast<int64_t>(drops.size());
}

void FutureStore::Release(uint64_t id) {
  Drops drops;
  {
    absl::MutexLock lock(&mu_);
    DropLocked(id, absl::OkStatus(), &drops);
  }
  Journal(drops);
}

bool FutureStore::Holds(uint64_t id) const {
  absl::MutexLock lock(&mu_);
  return entries_.contains(id);
}

int64_t FutureStore::pending() const {
  absl::MutexLock lock(&mu_);
  return pending_;
}

std::pair<int64_t, int64_t> FutureStore::retained(const std::string& tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = retained_.find(tenant);
  if (it == retained_.end()) return {0, 0};
  return {static_cast<int64_t>(it->second.ids.size()), it->second.bytes};
}

}  // namespace twinkle
