#include "core/futures/future_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "tests/unit/core/fake_clock.h"

namespace twinkle {
namespace {

using ::twinkle::testing::FakeClock;

// Long enough never to fire in a passing run; a hang instead shows up as a failure.
constexpr absl::Duration kLong = absl::Seconds(30);

// Results in these tests are training results carrying a number.
FutureValue Num(int v) {
  training::OpOutput out;
  out.value = v;
  return out;
}
int NumOf(const FutureValue& v) { return static_cast<int>(std::get<training::OpOutput>(v).value); }

int ValueOf(const absl::StatusOr<FutureResult>& got) {
  EXPECT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->ok()) << got->status();
  return NumOf(**got);
}

TEST(FutureStoreTest, WaitReturnsTheResultOnceCompleted) {
  FutureStore store;
  store.Create(1, "alice");
  EXPECT_EQ(store.pending(), 1);
  store.Complete(1, Num(42));
  EXPECT_EQ(store.pending(), 0);
  EXPECT_EQ(ValueOf(store.Wait(1, "alice", kLong)), 42);
  // Collecting does not consume: a second Wait sees the same result.
  EXPECT_EQ(ValueOf(store.Wait(1, "alice", absl::ZeroDuration())), 42);
}

TEST(FutureStoreTest, AFailedOpIsAnOkWaitHoldingTheError) {
  FutureStore store;
  store.Create(1, "alice");
  store.Complete(1, absl::InvalidArgumentError("bad batch"));
  absl::StatusOr<FutureResult> got = store.Wait(1, "alice", kLong);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(got->status().message(), "bad batch");
}

TEST(FutureStoreTest, WaitOnAPendingFutureTimesOutAsUnavailable) {
  FutureStore store;
  store.Create(7, "alice");
  absl::StatusOr<FutureResult> got = store.Wait(7, "alice", absl::Milliseconds(1));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(got.status().message(), "still pending");
  EXPECT_EQ(store.pending(), 1);
}

TEST(FutureStoreTest, WaitWakesWhenAnotherThreadCompletes) {
  FutureStore store;
  store.Create(3, "alice");
  absl::StatusOr<FutureResult> got = absl::UnknownError("not set");
  std::thread waiter([&] { got = store.Wait(3, "alice", kLong); });
  store.Complete(3, Num(5));
  waiter.join();
  EXPECT_EQ(ValueOf(got), 5);
}

TEST(FutureStoreTest, FirstCompletionWins) {
  FutureStore store;
  store.Create(1, "alice");
  store.Complete(1, Num(1));
  store.Complete(1, Num(2));
  store.Complete(1, absl::InternalError("late"));
  EXPECT_EQ(ValueOf(store.Wait(1, "alice", kLong)), 1);
}

TEST(FutureStoreTest, AnotherTenantsFutureIsNotFoundLikeAnUnknownOne) {
  FutureStore store;
  store.Create(1, "alice");
  store.Complete(1, Num(1));
  EXPECT_EQ(store.Wait(1, "bob", kLong).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.Wait(99, "alice", kLong).status().code(), absl::StatusCode::kNotFound);
  bool called = false;
  EXPECT_EQ(store.OnComplete(1, "bob", [&](const FutureResult&) { called = true; }).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(store.OnComplete(99, "alice", [&](const FutureResult&) { called = true; }).code(),
            absl::StatusCode::kNotFound);
  EXPECT_FALSE(called);
  // The same message for both, so a probe cannot tell "someone else's" from "none".
  EXPECT_EQ(store.Wait(1, "bob", kLong).status().message(),
            store.Wait(99, "alice", kLong).status().message());
}

TEST(FutureStoreTest, OnCompleteRunsOnceOnTheCompletingThreadOutsideTheLock) {
  FutureStore store;
  store.Create(1, "alice");
  int calls = 0;
  int seen = 0;
  int64_t pending_inside = -1;
  ASSERT_TRUE(store
                  .OnComplete(1, "alice",
                              [&](const FutureResult& r) {
                                ++calls;
                                seen = NumOf(*r);
                                // Re-entering the store would deadlock under its lock.
                                pending_inside = store.pending();
                                store.Create(2, "alice");
                              })
                  .ok());
  EXPECT_EQ(calls, 0);
  store.Complete(1, Num(9));
  store.Complete(1, Num(10));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(seen, 9);
  EXPECT_EQ(pending_inside, 0);
  EXPECT_EQ(store.pending(), 1);  // the future the callback created
}

TEST(FutureStoreTest, OnCompleteOfACompletedFutureRunsAtOnce) {
  FutureStore store;
  store.Create(1, "alice");
  store.Complete(1, Num(4));
  int seen = 0;
  ASSERT_TRUE(store.OnComplete(1, "alice", [&](const FutureResult& r) {
    seen = NumOf(*r);
  }).ok());
  EXPECT_EQ(seen, 4);
}

TEST(FutureStoreTest, EveryCallbackRunsExactlyOnceUnderConcurrentCompletion) {
  FutureStore store;
  constexpr int kFutures = 200;
  std::atomic<int> calls[kFutures] = {};
  for (int i = 0; i < kFutures; ++i) {
    store.Create(i, "t");
    ASSERT_TRUE(store.OnComplete(i, "t", [&calls, i](const FutureResult&) { ++calls[i]; }).ok());
  }
  std::thread a([&] { for (int i = 0; i < kFutures; ++i) store.Complete(i, Num(1)); });
  std::thread b([&] { for (int i = kFutures - 1; i >= 0; --i) store.Complete(i, Num(2)); });
  a.join();
  b.join();
  for (int i = 0; i < kFutures; ++i) EXPECT_EQ(calls[i].load(), 1) << i;
  EXPECT_EQ(store.pending(), 0);
}

TEST(FutureStoreTest, CompletedFuturesExpireAfterTheRetentionPendingOnesNever) {
  FakeClock clock;
  FutureStore store(absl::Minutes(10), clock);
  store.Create(1, "alice");
  store.Create(2, "alice");
  store.Complete(1, Num(1));
  clock.Advance(absl::Minutes(9));
  EXPECT_EQ(store.Expire(), 0);
  EXPECT_EQ(ValueOf(store.Wait(1, "alice", kLong)), 1);
  clock.Advance(absl::Minutes(2));
  EXPECT_EQ(store.Expire(), 1);
  EXPECT_EQ(store.Wait(1, "alice", kLong).status().code(), absl::StatusCode::kNotFound);
  // Still pending long past the retention: kept.
  clock.Advance(absl::Hours(100));
  EXPECT_EQ(store.Expire(), 0);
  EXPECT_EQ(store.Wait(2, "alice", absl::ZeroDuration()).status().code(),
            absl::StatusCode::kUnavailable);
  store.Complete(2, Num(2));
  EXPECT_EQ(store.Expire(), 0);  // retention counts from completion
  clock.Advance(absl::Minutes(11));
  EXPECT_EQ(store.Expire(), 1);
}

TEST(FutureStoreTest, AWaiterHoldsItsResultEvenIfExpiredMeanwhile) {
  FakeClock clock;
  FutureStore store(absl::Seconds(1), clock);
  store.Create(1, "alice");
  absl::StatusOr<FutureResult> got = absl::UnknownError("not set");
  absl::Notification started;
  std::thread waiter([&] {
    started.Notify();
    got = store.Wait(1, "alice", kLong);
  });
  started.WaitForNotification();
  store.Complete(1, Num(3));
  clock.Advance(absl::Seconds(5));
  store.Expire();
  waiter.join();
  // Either the waiter got the result, or (if it looked up the id only after the expiry) the
  // id was gone: never a dangling entry.
  if (got.ok()) {
    EXPECT_EQ(ValueOf(got), 3);
  } else {
    EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
  }
}

// Records what the store tells its journal about drops.
class DropLog : public FutureJournal {
 public:
  void Created(uint64_t, const std::string&) override {}
  void Completed(uint64_t, const std::string&, const FutureResult&) override {}
  absl::StatusOr<FutureResult> Lookup(uint64_t id, const std::string& tenant) override {
    absl::MutexLock lock(&mu_);
    auto it = drops_.find(id);
    if (it == drops_.end() || it->second.ok()) return absl::NotFoundError("no such future");
    return FutureResult(it->second);
  }
  void Dropped(uint64_t id, const std::string&, const absl::Status& why) override {
    absl::MutexLock lock(&mu_);
    drops_[id] = why;
  }
  std::map<uint64_t, absl::Status> drops() {
    absl::MutexLock lock(&mu_);
    return drops_;
  }

 private:
  absl::Mutex mu_;
  std::map<uint64_t, absl::Status> drops_;
};

TEST(FutureStoreTest, RetainedResultsAreBoundedPerTenantByCountOldestFirst) {
  FutureStoreOptions options;
  options.max_results_per_tenant = 3;
  FutureStore store(options);
  DropLog log;
  store.SetJournal(&log);
  for (uint64_t id = 1; id <= 4; ++id) store.Create(id, "alice");
  store.Create(10, "bob");
  // Completed out of order: the oldest by id goes first, whatever finished first.
  for (uint64_t id : {3, 1, 2}) store.Complete(id, Num(static_cast<int>(id)));
  store.Complete(10, Num(10));
  EXPECT_EQ(store.retained("alice").first, 3);
  EXPECT_TRUE(log.drops().empty());
  store.Complete(4, Num(4));  // the first result over the bound
  EXPECT_EQ(store.retained("alice").first, 3);
  ASSERT_EQ(log.drops().size(), 1u);
  absl::StatusOr<FutureResult> dropped = store.Wait(1, "alice", kLong);
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  EXPECT_EQ(dropped->status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(dropped->status().message()), ::testing::HasSubstr("sessions.max_retained_results (3)"));
  for (uint64_t id : {2, 3, 4}) EXPECT_EQ(ValueOf(store.Wait(id, "alice", kLong)), static_cast<int>(id));
  // Bob's results are his own budget.
  EXPECT_EQ(ValueOf(store.Wait(10, "bob", kLong)), 10);
  EXPECT_EQ(store.retained("bob").first, 1);
  // Holds follows the bound (what transports' side tables key on): the dropped one is gone,
  // pending, kept and unknown ones answer as they are.
  EXPECT_FALSE(store.Holds(1));
  for (uint64_t id : {2, 3, 4, 10}) EXPECT_TRUE(store.Holds(id)) << id;
  store.Create(5, "alice");
  EXPECT_TRUE(store.Holds(5));
  EXPECT_FALSE(store.Holds(99));
}

TEST(FutureStoreTest, RetainedResultsAreBoundedPerTenantByBytes) {
  FutureStoreOptions options;
  options.max_result_bytes_per_tenant = 3000;
  FutureStore store(options);
  DropLog log;
  store.SetJournal(&log);
  const std::string kilobyte(1000, 'x');
  for (uint64_t id = 1; id <= 3; ++id) {
    store.Create(id, "alice");
    store.Complete(id, FutureValue(EncodedResult{kilobyte, ""}));
  }
  // 3 × (1000 + 64) bytes: over 3000, so the first one went.
  EXPECT_EQ(store.retained("alice").first, 2);
  EXPECT_EQ(store.retained("alice").second, 2 * 1064);
  absl::StatusOr<FutureResult> dropped = store.Wait(1, "alice", kLong);
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  EXPECT_EQ(dropped->status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(dropped->status().message()), ::testing::HasSubstr("sessions.max_retained_result_bytes"));
  // One result larger than the whole bound is still kept (it is the newest).
  store.Create(4, "alice");
  store.Complete(4, FutureValue(EncodedResult{std::string(5000, 'y'), ""}));
  EXPECT_EQ(store.retained("alice").first, 1);
  absl::StatusOr<FutureResult> big = store.Wait(4, "alice", kLong);
  ASSERT_TRUE(big.ok() && big->ok());
}

TEST(FutureStoreTest, ReleaseForgetsAFinishedFutureAndItsAccounting) {
  FutureStore store;
  DropLog log;
  store.SetJournal(&log);
  store.Create(1, "alice");
  store.Release(1);  // pending: left alone
  EXPECT_EQ(store.pending(), 1);
  store.Complete(1, Num(1));
  EXPECT_EQ(store.retained("alice").first, 1);
  store.Release(1);
  EXPECT_EQ(store.retained("alice"), (std::pair<int64_t, int64_t>{0, 0}));
  ASSERT_EQ(log.drops().size(), 1u);
  EXPECT_TRUE(log.drops().at(1).ok());  // forgotten, not failed
  EXPECT_EQ(store.Wait(1, "alice", kLong).status().code(), absl::StatusCode::kNotFound);
}

TEST(FutureStoreTest, IdsComeFromOneCounterThatSeedingOnlyRaises) {
  const uint64_t a = NewFutureId();
  SeedFutureIds(a + 1000);
  const uint64_t b = NewFutureId();
  EXPECT_GE(b, a + 1000);
  SeedFutureIds(5);  // lower: ignored
  EXPECT_GT(NewFutureId(), b);
}

TEST(FutureStoreTest, InterruptedByRestartIsRecognisedWithOrWithoutItsPayload) {
  EXPECT_TRUE(IsInterruptedByRestart(InterruptedByRestart()));
  // After a journal round trip only code and message remain.
  const absl::Status stored(absl::StatusCode::kAborted, InterruptedByRestart().message());
  EXPECT_TRUE(IsInterruptedByRestart(stored));
  EXPECT_FALSE(IsInterruptedByRestart(absl::AbortedError("adapter dropped")));
  EXPECT_FALSE(IsInterruptedByRestart(absl::InternalError(InterruptedByRestart().message())));
}

}  // namespace
}  // namespace twinkle
