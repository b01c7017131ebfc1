#include "core/scheduler/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <any>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "tests/unit/core/fake_clock.h"

namespace twinkle::sched {
namespace {

// Long enough never to fire in a passing run: a hang shows up as a failure, not a flake.
constexpr absl::Duration kLong = absl::Seconds(30);

using ::twinkle::testing::FakeClock;

// Results in these tests are training results carrying the op's label as text.
FutureValue Text(const std::string& label) {
  training::OpOutput out;
  out.text = label;
  return out;
}
std::string TextOf(const FutureValue& v) { return std::get<training::OpOutput>(v).text; }

// What the executor saw of one op.
struct Seen {
  uint64_t id;
  std::string tenant;
  std::string adapter;
  OpKind kind;
  int64_t tokens;
  std::string label;
};

// Records every batch; results are the op's label, or an error for labels in `fail`.
// Optionally holds the first Execute until released (to show Submit does not block on it).
class RecordingExecutor final : public Executor {
 public:
  std::vector<FutureResult> Execute(const std::vector<const Op*>& batch) override {
    std::vector<Seen> seen;
    std::vector<FutureResult> results;
    for (const Op* op : batch) {
      const std::string label =
          op->payload.has_value() ? std::any_cast<std::string>(op->payload) : "";
      seen.push_back({op->id, op->tenant, op->adapter, op->kind, op->tokens, label});
      if (fail_.contains(label)) {
        results.push_back(absl::InvalidArgumentError("bad op " + label));
      } else {
        results.push_back(Text(label));
      }
    }
    {
      absl::MutexLock lock(&mu_);
      batches_.push_back(std::move(seen));
    }
    if (hold_ != nullptr) {
      entered_.Notify();
      hold_->WaitForNotification();
      hold_ = nullptr;
    }
    return results;
  }

  std::vector<std::vector<Seen>> batches() const {
    absl::MutexLock lock(&mu_);
    return batches_;
  }
  // Labels in execution order.
  std::vector<std::string> order() const {
    std::vector<std::string> out;
    for (const auto& batch : batches()) {
      for (const Seen& s : batch) out.push_back(s.label);
    }
    return out;
  }
  std::vector<std::string> order_of(const std::string& adapter) const {
    std::vector<std::string> out;
    for (const auto& batch : batches()) {
      for (const Seen& s : batch) {
        if (s.adapter == adapter) out.push_back(s.label);
      }
    }
    return out;
  }

  std::set<std::string> fail_;
  absl::Notification* hold_ = nullptr;  // set before Start
  absl::Notification entered_;

 private:
  mutable absl::Mutex mu_;
  std::vector<std::vector<Seen>> batches_;
};

Op MakeOp(const std::string& tenant, const std::string& adapter, OpKind kind, int64_t tokens,
          const std::string& label) {
  Op op;
  op.tenant = tenant;
  op.adapter = adapter;
  op.kind = kind;
  op.tokens = tokens;
  op.payload = label;
  return op;
}

// Counts steps through the StepListener, so tests can wait for "N steps done".
class StepCounter {
 public:
  void Record(const StepStats& stats) {
    absl::MutexLock lock(&mu_);
    stats_.push_back(stats);
  }
  bool WaitFor(size_t steps) {
    absl::MutexLock lock(&mu_);
    auto done = [this, steps]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stats_.size() >= steps; };
    return mu_.AwaitWithTimeout(absl::Condition(&done), kLong);
  }
  std::vector<StepStats> stats() const {
    absl::MutexLock lock(&mu_);
    return stats_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<StepStats> stats_;
};

// Members are destroyed in reverse: the scheduler (and its thread) goes first.
struct Harness {
  explicit Harness(SchedulerOptions options = {}) : options(options) {}
  void Make() {
    sched = std::make_unique<Scheduler>(options, executor, futures, clock);
    sched->SetStepListener([this](const StepStats& s) { steps.Record(s); });
  }
  // Paused and started: nothing runs until Step() or Resume().
  void StartPaused() {
    Make();
    sched->Pause();
    sched->Start();
  }
  uint64_t Submit(Op op) {
    absl::StatusOr<uint64_t> id = sched->Submit(std::move(op));
    EXPECT_TRUE(id.ok()) << id.status();
    return id.ok() ? *id : 0;
  }
  // The op's result once it completed (fails the test if it does not within kLong).
  FutureResult Result(uint64_t id, const std::string& tenant) {
    absl::StatusOr<FutureResult> got = futures.Wait(id, tenant, kLong);
    EXPECT_TRUE(got.ok()) << "future " << id << ": " << got.status();
    if (!got.ok()) return got.status();
    return *got;
  }
  bool Done(uint64_t id, const std::string& tenant) {
    return futures.Wait(id, tenant, absl::ZeroDuration()).ok();
  }

  SchedulerOptions options;
  FakeClock clock;
  FutureStore futures{absl::Hours(1), clock};
  RecordingExecutor executor;
  StepCounter steps;
  std::unique_ptr<Scheduler> sched;
};

std::string Label(const FutureResult& r) {
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? TextOf(*r) : "";
}

TEST(SchedulerTest, OpsOfOneAdapterRunInSubmissionOrder) {
  Harness h;
  h.StartPaused();
  std::vector<uint64_t> ids;
  const OpKind kinds[] = {OpKind::kForwardBackward, OpKind::kForward, OpKind::kOther,
                          OpKind::kForwardBackward, OpKind::kOther, OpKind::kForward};
  for (int i = 0; i < 6; ++i) ids.push_back(h.Submit(MakeOp("t", "a", kinds[i], 10, absl::StrCat(i))));
  for (int i = 0; i < 4; ++i) ids.push_back(h.Submit(MakeOp("t", "b", OpKind::kForwardBackward, 10, absl::StrCat("b", i))));
  EXPECT_EQ(h.sched->queued("a"), 6);
  EXPECT_EQ(h.sched->queued_for_tenant("t"), 10);
  h.sched->Resume();
  for (uint64_t id : ids) EXPECT_TRUE(h.Result(id, "t").ok());
  EXPECT_EQ(h.executor.order_of("a"), (std::vector<std::string>{"0", "1", "2", "3", "4", "5"}));
  EXPECT_EQ(h.executor.order_of("b"), (std::vector<std::string>{"b0", "b1", "b2", "b3"}));
  EXPECT_EQ(h.sched->queued("a"), 0);
  EXPECT_EQ(h.sched->queued_for_tenant("t"), 0);
}

TEST(SchedulerTest, SeqIdsOrderTheQueueTiesByArrival) {
  Harness h;
  h.StartPaused();
  std::vector<uint64_t> ids;
  for (auto [seq, label] : std::vector<std::pair<int64_t, std::string>>{
           {3, "s3"}, {1, "s1"}, {5, "s5"}, {1, "s1-again"}, {2, "s2"}, {0, "s0"}}) {
    Op op = MakeOp("t", "a", OpKind::kOther, 0, label);
    op.seq_id = seq;
    ids.push_back(h.Submit(std::move(op)));
  }
  h.sched->Resume();
  for (uint64_t id : ids) EXPECT_TRUE(h.Result(id, "t").ok());
  EXPECT_EQ(h.executor.order_of("a"),
            (std::vector<std::string>{"s0", "s1", "s1-again", "s2", "s3", "s5"}));
}

TEST(SchedulerTest, IdempotencyKeyReturnsTheEarlierIdEvenAfterItCompleted) {
  SchedulerOptions options;
  options.idempotency_keys_per_adapter = 2;
  Harness h(options);
  h.StartPaused();
  Op op = MakeOp("t", "a", OpKind::kForwardBackward, 10, "first");
  op.idempotency_key = "k1";
  const uint64_t first = h.Submit(op);
  Op retry = op;
  retry.payload = std::string("retry");
  EXPECT_EQ(h.Submit(retry), first);
  EXPECT_EQ(h.sched->queued("a"), 1);
  // The same key on another adapter is another op.
  Op other = MakeOp("t", "b", OpKind::kForwardBackward, 10, "other");
  other.idempotency_key = "k1";
  EXPECT_NE(h.Submit(other), first);

  h.sched->Resume();
  EXPECT_EQ(Label(h.Result(first, "t")), "first");
  EXPECT_EQ(h.Submit(retry), first);  // after completion too
  EXPECT_EQ(h.sched->queued("a"), 0);
  EXPECT_EQ(h.executor.order_of("a"), std::vector<std::string>{"first"});

  // The memory is bounded: two newer keys push k1 out.
  for (const char* key : {"k2", "k3"}) {
    Op more = MakeOp("t", "a", OpKind::kOther, 0, key);
    more.idempotency_key = key;
    EXPECT_TRUE(h.Result(h.Submit(more), "t").ok());
  }
  EXPECT_NE(h.Submit(retry), first);
}

TEST(SchedulerTest, AReplayedKeyOfAnotherOpOrBodyIsRefusedNeverAnsweredWithTheFirstOpsId) {
  Harness h;
  h.StartPaused();
  Op fb = MakeOp("t", "a", OpKind::kForwardBackward, 10, "fb");
  fb.idempotency_key = "tinker-seq-1";
  fb.name = "forward_backward";
  fb.fingerprint = 11;
  const uint64_t first = h.Submit(fb);

  // The same key on a snapshot of the same adapter: refused, naming the key and both ops.
  Op snapshot = MakeOp("t", "a", OpKind::kOther, 0, "snap");
  snapshot.idempotency_key = "tinker-seq-1";
  snapshot.name = "snapshot";
  absl::StatusOr<uint64_t> refused = h.sched->Submit(snapshot);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(IsIdempotencyConflict(refused.status()));
  EXPECT_NE(refused.status().message().find("'tinker-seq-1'"), std::string::npos) << refused.status();
  EXPECT_NE(refused.status().message().find("forward_backward"), std::string::npos) << refused.status();

  // The same op with another body: refused too.
  Op other_body = fb;
  other_body.fingerprint = 12;
  absl::StatusOr<uint64_t> body = h.sched->Submit(other_body);
  ASSERT_FALSE(body.ok());
  EXPECT_TRUE(IsIdempotencyConflict(body.status()));
  EXPECT_NE(body.status().message().find("different request body"), std::string::npos) << body.status();

  // A true retry (same op, same body) still gets the first id; nothing else was queued.
  EXPECT_EQ(h.Submit(fb), first);
  EXPECT_EQ(h.sched->queued("a"), 1);
  h.sched->Resume();
  EXPECT_EQ(Label(h.Result(first, "t")), "fb");
  EXPECT_EQ(h.executor.order_of("a"), std::vector<std::string>{"fb"});
  // After completion the conflict still holds (the key is remembered, not the queue entry).
  EXPECT_TRUE(IsIdempotencyConflict(h.sched->Submit(snapshot).status()));
}

TEST(SchedulerTest, QueueCapRejectsExactlyTheOverflow) {
  SchedulerOptions options;
  options.queue_cap = 8;
  Harness h(options);
  h.StartPaused();
  int accepted = 0;
  int exhausted = 0;
  for (int i = 0; i < options.queue_cap + 5; ++i) {
    absl::StatusOr<uint64_t> id =
        h.sched->Submit(MakeOp("t", "a", OpKind::kForwardBackward, 10, absl::StrCat(i)));
    if (id.ok()) {
      ++accepted;
    } else {
      EXPECT_EQ(id.status().code(), absl::StatusCode::kResourceExhausted);
      EXPECT_NE(id.status().message().find("queue_cap=8"), std::string::npos) << id.status();
      ++exhausted;
    }
  }
  EXPECT_EQ(accepted, 8);
  EXPECT_EQ(exhausted, 5);
  EXPECT_EQ(h.sched->queued("a"), 8);
  EXPECT_EQ(h.futures.pending(), 8);  // rejected ops left no future behind
  // Another adapter has its own cap.
  EXPECT_TRUE(h.sched->Submit(MakeOp("t", "b", OpKind::kOther, 0, "b")).ok());
  // Running one frees one slot.
  h.sched->Step(1);
  ASSERT_TRUE(h.steps.WaitFor(1));
  EXPECT_TRUE(h.sched->Submit(MakeOp("t", "a", OpKind::kForwardBackward, 10, "late")).ok());
  EXPECT_EQ(h.sched->Submit(MakeOp("t", "a", OpKind::kForwardBackward, 10, "x")).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(SchedulerTest, TenantPendingCapSpansItsAdaptersAndSparesOthers) {
  SchedulerOptions options;
  options.max_pending_per_tenant = 6;
  Harness h(options);
  h.StartPaused();
  int exhausted = 0;
  for (int i = 0; i < 10; ++i) {
    absl::StatusOr<uint64_t> id = h.sched->Submit(
        MakeOp("greedy", absl::StrCat("g", i % 3), OpKind::kOther, 0, absl::StrCat(i)));
    if (!id.ok()) {
      EXPECT_EQ(id.status().code(), absl::StatusCode::kResourceExhausted);
      EXPECT_NE(id.status().message().find("max_pending_per_tenant=6"), std::string::npos)
          << id.status();
      ++exhausted;
    }
  }
  EXPECT_EQ(exhausted, 4);
  EXPECT_EQ(h.sched->queued_for_tenant("greedy"), 6);
  EXPECT_TRUE(h.sched->Submit(MakeOp("modest", "m", OpKind::kOther, 0, "m")).ok());
}

TEST(SchedulerTest, AnAlreadyPassedDeadlineIsRefusedAtSubmit) {
  Harness h;
  h.StartPaused();
  Op op = MakeOp("t", "a", OpKind::kOther, 0, "late");
  op.deadline = h.clock.Now();
  EXPECT_EQ(h.sched->Submit(op).status().code(), absl::StatusCode::kDeadlineExceeded);
  op.deadline = h.clock.Now() - absl::Seconds(1);
  EXPECT_EQ(h.sched->Submit(op).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(h.sched->queued("a"), 0);
  EXPECT_EQ(h.futures.pending(), 0);
}

TEST(SchedulerTest, QueuedOpsWhoseDeadlinePassesExpireWithoutRunningEvenWhilePaused) {
  Harness h;
  h.StartPaused();
  Op head = MakeOp("t", "a", OpKind::kForwardBackward, 10, "head");
  head.deadline = h.clock.Now() + absl::Seconds(10);
  Op middle = MakeOp("t", "a", OpKind::kForwardBackward, 10, "middle");
  middle.deadline = h.clock.Now() + absl::Seconds(1);
  Op tail = MakeOp("t", "a", OpKind::kForwardBackward, 10, "tail");  // no deadline
  const uint64_t head_id = h.Submit(head);
  const uint64_t middle_id = h.Submit(middle);
  const uint64_t tail_id = h.Submit(tail);

  h.clock.Advance(absl::Seconds(2));  // nobody signals the scheduler: it must notice itself
  EXPECT_EQ(h.Result(middle_id, "t").status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(h.sched->queued("a"), 2);
  EXPECT_FALSE(h.Done(head_id, "t"));

  h.clock.Advance(absl::Seconds(10));
  EXPECT_EQ(h.Result(head_id, "t").status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(h.sched->queued("a"), 1);

  h.sched->Step(1);
  EXPECT_EQ(Label(h.Result(tail_id, "t")), "tail");
  EXPECT_EQ(h.executor.order(), std::vector<std::string>{"tail"});  // never saw the others
}

TEST(SchedulerTest, CancelRemovesAQueuedOpOnlyForItsTenant) {
  Harness h;
  h.StartPaused();
  const uint64_t keep = h.Submit(MakeOp("t", "a", OpKind::kOther, 0, "keep"));
  const uint64_t drop = h.Submit(MakeOp("t", "a", OpKind::kOther, 0, "drop"));
  EXPECT_EQ(h.sched->Cancel(drop, "intruder").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(h.sched->Cancel(123456789, "t").code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(h.Done(drop, "t"));
  ASSERT_TRUE(h.sched->Cancel(drop, "t").ok());
  EXPECT_EQ(h.Result(drop, "t").status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(h.sched->Cancel(drop, "t").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(h.sched->queued("a"), 1);
  h.sched->Resume();
  EXPECT_EQ(Label(h.Result(keep, "t")), "keep");
  EXPECT_EQ(h.sched->Cancel(keep, "t").code(), absl::StatusCode::kNotFound);  // done
  EXPECT_EQ(h.executor.order(), std::vector<std::string>{"keep"});
}

TEST(SchedulerTest, FusesHeadsOfOneKindAcrossAdaptersUnderTheBudget) {
  SchedulerOptions options;
  options.max_tokens_per_step = 1000;
  options.max_ops_per_step = 3;
  Harness h(options);
  h.StartPaused();
  // All counters start equal: fairness order t1, t2, t3 (ties by name), then by counter.
  h.Submit(MakeOp("t1", "a", OpKind::kForwardBackward, 300, "a1"));
  h.Submit(MakeOp("t1", "a", OpKind::kForwardBackward, 100, "a2"));  // behind a1: not with it
  h.Submit(MakeOp("t1", "b", OpKind::kForwardBackward, 300, "b1"));
  h.Submit(MakeOp("t2", "c", OpKind::kForwardBackward, 300, "c1"));
  h.Submit(MakeOp("t2", "d", OpKind::kForward, 100, "d1"));          // another kind
  h.Submit(MakeOp("t3", "e", OpKind::kForwardBackward, 500, "e1"));  // over what is left
  h.sched->Resume();
  ASSERT_TRUE(h.steps.WaitFor(3));
  std::vector<std::vector<Seen>> batches = h.executor.batches();
  ASSERT_EQ(batches.size(), 3u);
  auto labels = [](const std::vector<Seen>& batch) {
    std::vector<std::string> out;
    for (const Seen& s : batch) out.push_back(s.label);
    return out;
  };
  // Step 1: a1 (t1), c1 (t2), e1 does not fit (1100 > 1000), b1 (t1) fills the op limit.
  EXPECT_EQ(labels(batches[0]), (std::vector<std::string>{"a1", "c1", "b1"}));
  // Step 2: t3 has the smallest counter; t2's only head is a forward; t1's a2 fits.
  EXPECT_EQ(labels(batches[1]), (std::vector<std::string>{"e1", "a2"}));
  // Step 3: the forward, alone of its kind.
  EXPECT_EQ(labels(batches[2]), std::vector<std::string>{"d1"});
  for (const auto& batch : batches) {
    std::set<std::string> adapters;
    int64_t tokens = 0;
    for (const Seen& s : batch) {
      EXPECT_TRUE(adapters.insert(s.adapter).second) << "adapter twice in one step: " << s.adapter;
      EXPECT_EQ(s.kind, batch.front().kind) << "kinds mixed in one step";
      tokens += s.tokens;
    }
    EXPECT_LE(tokens, options.max_tokens_per_step);
  }
  std::vector<StepStats> stats = h.steps.stats();
  EXPECT_EQ(stats[0].ops, 3);
  EXPECT_EQ(stats[0].tokens, 900);
  EXPECT_EQ(stats[0].tenants, 2);
  EXPECT_EQ(stats[0].kind, OpKind::kForwardBackward);
  EXPECT_EQ(stats[0].waits.size(), 3u);
  EXPECT_EQ(stats[2].kind, OpKind::kForward);
}

TEST(SchedulerTest, AnOversizedFirstOpRunsAloneAndOtherOpsNeverFuse) {
  SchedulerOptions options;
  options.max_tokens_per_step = 100;
  Harness h(options);
  h.StartPaused();
  h.Submit(MakeOp("t1", "big", OpKind::kForward, 500, "big"));
  h.Submit(MakeOp("t2", "small", OpKind::kForward, 50, "small"));
  h.Submit(MakeOp("t3", "o1", OpKind::kOther, 0, "o1"));
  h.Submit(MakeOp("t4", "o2", OpKind::kOther, 0, "o2"));
  h.sched->Resume();
  ASSERT_TRUE(h.steps.WaitFor(4));
  for (const auto& batch : h.executor.batches()) EXPECT_EQ(batch.size(), 1u);
  EXPECT_EQ(h.executor.order(), (std::vector<std::string>{"big", "small", "o1", "o2"}));
}

// max_activation_bytes_per_step: ops whose estimated bytes sum over it never share a step,
// ops whose sum is at it do; the token budget is not what stops them here.
TEST(SchedulerTest, FusionStaysWithinTheActivationMemoryBudget) {
  SchedulerOptions options;
  options.max_tokens_per_step = 1000000;
  options.max_activation_bytes_per_step = 1000;
  Harness h(options);
  auto with_bytes = [](Op op, int64_t bytes) {
    op.activation_bytes = bytes;
    return op;
  };
  h.StartPaused();
  h.Submit(with_bytes(MakeOp("t1", "a", OpKind::kForwardBackward, 10, "a1"), 600));
  h.Submit(with_bytes(MakeOp("t2", "b", OpKind::kForwardBackward, 10, "b1"), 401));  // 1001: not with a1
  h.Submit(with_bytes(MakeOp("t3", "c", OpKind::kForwardBackward, 10, "c1"), 400));  // 1000: with a1
  h.Submit(with_bytes(MakeOp("t4", "d", OpKind::kForwardBackward, 10, "d1"), 2000));  // alone: over by itself
  h.Submit(with_bytes(MakeOp("t5", "e", OpKind::kForwardBackward, 10, "e1"), 0));    // unknown: counts 0
  h.sched->Resume();
  ASSERT_TRUE(h.steps.WaitFor(3));
  std::vector<std::vector<std::string>> steps;
  for (const auto& batch : h.executor.batches()) {
    steps.emplace_back();
    for (const Seen& s : batch) steps.back().push_back(s.label);
  }
  ASSERT_EQ(steps.size(), 3u);
  EXPECT_EQ(steps[0], (std::vector<std::string>{"a1", "c1", "e1"}));
  EXPECT_EQ(steps[1], (std::vector<std::string>{"b1"}));  // d1 does not fit beside it
  EXPECT_EQ(steps[2], (std::vector<std::string>{"d1"}));

  // Without a budget (0) the same ops fuse into one step.
  Harness unbounded;
  unbounded.StartPaused();
  unbounded.Submit(with_bytes(MakeOp("t1", "a", OpKind::kForwardBackward, 10, "a1"), 600));
  unbounded.Submit(with_bytes(MakeOp("t2", "b", OpKind::kForwardBackward, 10, "b1"), 401));
  unbounded.sched->Resume();
  ASSERT_TRUE(unbounded.steps.WaitFor(1));
  ASSERT_EQ(unbounded.executor.batches().size(), 1u);
  EXPECT_EQ(unbounded.executor.batches()[0].size(), 2u);
}

TEST(SchedulerTest, WithoutFusionEveryOpRunsAlone) {
  SchedulerOptions options;
  options.fuse = false;
  Harness h(options);
  h.StartPaused();
  for (int i = 0; i < 4; ++i) {
    h.Submit(MakeOp(absl::StrCat("t", i), absl::StrCat("a", i), OpKind::kForwardBackward,
                    10, absl::StrCat(i)));
  }
  h.sched->Resume();
  ASSERT_TRUE(h.steps.WaitFor(4));
  for (const auto& batch : h.executor.batches()) EXPECT_EQ(batch.size(), 1u);
}

TEST(SchedulerTest, AnOptimStepRunsBetweenTheBackwardsAroundIt) {
  Harness h;
  h.StartPaused();
  std::vector<uint64_t> ids;
  ids.push_back(h.Submit(MakeOp("t1", "A", OpKind::kForwardBackward, 100, "A-fb1")));
  ids.push_back(h.Submit(MakeOp("t1", "A", OpKind::kOther, 0, "A-step")));
  ids.push_back(h.Submit(MakeOp("t1", "A", OpKind::kForwardBackward, 100, "A-fb2")));
  ids.push_back(h.Submit(MakeOp("t2", "B", OpKind::kForwardBackward, 100, "B-fb1")));
  ids.push_back(h.Submit(MakeOp("t2", "B", OpKind::kForwardBackward, 100, "B-fb2")));
  h.sched->Resume();
  for (uint64_t id : ids) {
    FutureResult r = h.futures.Wait(id, id == ids[3] || id == ids[4] ? "t2" : "t1", kLong).value();
    EXPECT_TRUE(r.ok()) << r.status();
  }
  EXPECT_EQ(h.executor.order_of("A"), (std::vector<std::string>{"A-fb1", "A-step", "A-fb2"}));
  for (const auto& batch : h.executor.batches()) {
    for (const Seen& s : batch) {
      if (s.kind == OpKind::kOther) {
        EXPECT_EQ(batch.size(), 1u) << "optim step fused";
      }
    }
  }
}

TEST(SchedulerTest, AStepHoldsAtMostMaxOpsPerStep) {
  SchedulerOptions options;
  options.max_ops_per_step = 2;
  Harness h(options);
  h.StartPaused();
  for (int i = 0; i < 5; ++i) {
    h.Submit(MakeOp("t", absl::StrCat("a", i), OpKind::kForwardBackward, 10, absl::StrCat(i)));
  }
  h.sched->Resume();
  ASSERT_TRUE(h.steps.WaitFor(3));
  std::vector<size_t> sizes;
  for (const auto& batch : h.executor.batches()) sizes.push_back(batch.size());
  EXPECT_EQ(sizes, (std::vector<size_t>{2, 2, 1}));
}

TEST(SchedulerTest, ATenantsAdaptersTakeTurns) {
  Harness h;
  h.StartPaused();
  for (int i = 0; i < 3; ++i) {
    h.Submit(MakeOp("t", "a", OpKind::kOther, 0, absl::StrCat("a", i)));
    h.Submit(MakeOp("t", "b", OpKind::kOther, 0, absl::StrCat("b", i)));
  }
  h.sched->Resume();
  ASSERT_TRUE(h.steps.WaitFor(6));
  EXPECT_EQ(h.executor.order(), (std::vector<std::string>{"a0", "b0", "a1", "b1", "a2", "b2"}));
}

int64_t Spread(const absl::flat_hash_map<std::string, int64_t>& served,
               const std::vector<std::string>& tenants) {
  int64_t lo = INT64_MAX, hi = INT64_MIN;
  for (const std::string& t : tenants) {
    auto it = served.find(t);
    const int64_t v = it == served.end() ? 0 : it->second;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  return hi - lo;
}

TEST(SchedulerTest, VtcKeepsEquallyBackloggedTenantsWithinOneOpOfEachOther) {
  SchedulerOptions options;
  options.fuse = false;  // one op per step: every step is a fairness decision
  Harness h(options);
  h.StartPaused();
  const std::vector<std::string> tenants = {"t0", "t1", "t2", "t3"};
  // Different op sizes per tenant: fairness is in tokens, not in ops.
  const int64_t sizes[] = {50, 100, 150, 200};
  for (int i = 0; i < 4; ++i) {
    for (int k = 0; k < 40; ++k) {
      h.Submit(MakeOp(tenants[i], absl::StrCat(tenants[i], "-a", k % 2),
                      OpKind::kForwardBackward, sizes[i], "x"));
    }
  }
  int done = 0;
  for (int n : {1, 7, 13, 20, 40}) {
    h.sched->Step(n - done);
    done = n;
    ASSERT_TRUE(h.steps.WaitFor(n));
    EXPECT_LE(Spread(h.sched->served_tokens(), tenants), 200) << "after " << n << " steps";
  }
  // What was actually executed agrees (every tenant stayed backlogged throughout).
  std::map<std::string, int64_t> executed;
  for (const auto& batch : h.executor.batches()) {
    for (const Seen& s : batch) executed[s.tenant] += s.tokens;
  }
  int64_t lo = INT64_MAX, hi = 0;
  for (const std::string& t : tenants) {
    lo = std::min(lo, executed[t]);
    hi = std::max(hi, executed[t]);
  }
  EXPECT_LE(hi - lo, 200);
  EXPECT_GT(lo, 0);
}

TEST(SchedulerTest, AFloodingTenantDoesNotStarveALightOne) {
  SchedulerOptions options;
  options.fuse = false;
  options.queue_cap = 100;
  options.max_pending_per_tenant = 1000;
  Harness h(options);
  h.StartPaused();
  for (int i = 0; i < 250; ++i) {  // 50x the light tenant's ops, queued first
    h.Submit(MakeOp("flood", absl::StrCat("f", i % 5), OpKind::kForwardBackward, 100, "f"));
  }
  std::vector<uint64_t> light;
  for (int i = 0; i < 5; ++i) {
    light.push_back(h.Submit(MakeOp("light", "l", OpKind::kForwardBackward, 100, "l")));
  }
  h.sched->Step(10);  // equal shares: the light tenant's 5 ops fit in 10 steps
  ASSERT_TRUE(h.steps.WaitFor(10));
  for (uint64_t id : light) EXPECT_TRUE(h.Done(id, "light")) << "light op " << id << " starved";
  EXPECT_EQ(h.sched->queued_for_tenant("flood"), 245);
}

TEST(SchedulerTest, ATenantReturningFromIdleGetsNoCreditToBurstWith) {
  SchedulerOptions options;
  options.fuse = false;
  options.max_pending_per_tenant = 1000;
  options.queue_cap = 1000;
  Harness h(options);
  h.StartPaused();
  for (int i = 0; i < 40; ++i) h.Submit(MakeOp("busy", "b", OpKind::kForwardBackward, 100, "b"));
  h.sched->Step(10);
  ASSERT_TRUE(h.steps.WaitFor(10));
  const int64_t busy_before = h.sched->served_tokens().at("busy");
  EXPECT_EQ(busy_before, 1000);
  for (int i = 0; i < 10; ++i) h.Submit(MakeOp("late", "l", OpKind::kForwardBackward, 100, "l"));
  EXPECT_GE(h.sched->served_tokens().at("late"), busy_before);  // lifted on arrival
  h.sched->Step(10);
  ASSERT_TRUE(h.steps.WaitFor(20));
  std::vector<std::vector<Seen>> batches = h.executor.batches();
  int late = 0;
  for (size_t i = 10; i < batches.size(); ++i) late += batches[i][0].tenant == "late" ? 1 : 0;
  EXPECT_LE(late, 6);  // about half, not all ten
  EXPECT_GE(late, 4);
}

TEST(SchedulerTest, StopCompletesQueuedOpsWithUnavailableAndRefusesMore) {
  Harness h;
  h.StartPaused();
  std::vector<uint64_t> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(h.Submit(MakeOp("t", "a", OpKind::kOther, 0, "x")));
  h.sched->Stop();
  for (uint64_t id : ids) {
    EXPECT_EQ(h.Result(id, "t").status().code(), absl::StatusCode::kUnavailable);
  }
  EXPECT_TRUE(h.executor.batches().empty());
  EXPECT_EQ(h.sched->Submit(MakeOp("t", "a", OpKind::kOther, 0, "y")).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(h.sched->queued("a"), 0);
  h.sched->Stop();  // idempotent
}

TEST(SchedulerTest, SubmitDoesNotWaitForTheRunningStep) {
  Harness h;
  absl::Notification release;
  h.executor.hold_ = &release;
  h.Make();
  h.sched->Start();
  const uint64_t first = h.Submit(MakeOp("t", "a", OpKind::kForwardBackward, 10, "first"));
  h.executor.entered_.WaitForNotification();  // the step is running, held in Execute
  // These would hang if Submit/Cancel/queued needed the step to finish.
  const uint64_t second = h.Submit(MakeOp("t", "a", OpKind::kForwardBackward, 10, "second"));
  const uint64_t third = h.Submit(MakeOp("t", "a", OpKind::kForwardBackward, 10, "third"));
  EXPECT_EQ(h.sched->queued("a"), 2);
  EXPECT_TRUE(h.sched->Cancel(third, "t").ok());
  EXPECT_EQ(h.sched->Cancel(first, "t").code(), absl::StatusCode::kNotFound);  // running
  EXPECT_FALSE(h.Done(first, "t"));
  release.Notify();
  EXPECT_EQ(Label(h.Result(first, "t")), "first");
  EXPECT_EQ(Label(h.Result(second, "t")), "second");
}

TEST(SchedulerTest, StopLetsTheRunningStepFinishAndFailsOnlyTheQueued) {
  Harness h;
  absl::Notification release;
  h.executor.hold_ = &release;
  h.Make();
  h.sched->Start();
  const uint64_t running = h.Submit(MakeOp("t", "a", OpKind::kOther, 0, "running"));
  h.executor.entered_.WaitForNotification();
  std::vector<uint64_t> queued = {h.Submit(MakeOp("t", "a", OpKind::kOther, 0, "queued"))};
  std::thread stopper([&] { h.sched->Stop(); });
  // Wait (by condition, not time) until Stop has begun. The probe queues nothing: its
  // deadline has passed, so Submit refuses it with DEADLINE_EXCEEDED, and with UNAVAILABLE
  // once the scheduler is stopping.
  Op probe = MakeOp("t", "b", OpKind::kOther, 0, "probe");
  probe.deadline = h.clock.Now();
  for (;;) {
    absl::StatusCode code = h.sched->Submit(probe).status().code();
    if (code == absl::StatusCode::kUnavailable) break;
    ASSERT_EQ(code, absl::StatusCode::kDeadlineExceeded);
    std::this_thread::yield();
  }
  EXPECT_FALSE(h.Done(running, "t"));
  release.Notify();
  stopper.join();
  EXPECT_EQ(Label(h.Result(running, "t")), "running");
  for (uint64_t id : queued) {
    EXPECT_EQ(h.Result(id, "t").status().code(), absl::StatusCode::kUnavailable);
  }
  EXPECT_EQ(h.executor.order(), std::vector<std::string>{"running"});
}

TEST(SchedulerTest, ACompletionCallbackMaySubmitMoreWork) {
  Harness h;
  h.StartPaused();  // so that `first` completes on the scheduler thread, after OnComplete
  const uint64_t first = h.Submit(MakeOp("t", "a", OpKind::kForwardBackward, 10, "first"));
  absl::Notification chained;
  uint64_t second = 0;
  // Runs on the scheduler thread once `first` completes: it must not hold the scheduler's
  // lock there, or this Submit deadlocks.
  ASSERT_TRUE(h.futures
                  .OnComplete(first, "t",
                              [&](const FutureResult&) {
                                second = h.Submit(MakeOp("t", "a", OpKind::kOther, 0, "second"));
                                chained.Notify();
                              })
                  .ok());
  h.sched->Resume();
  ASSERT_TRUE(chained.WaitForNotificationWithTimeout(kLong));
  EXPECT_EQ(Label(h.Result(second, "t")), "second");
  EXPECT_EQ(h.executor.order(), (std::vector<std::string>{"first", "second"}));
}

TEST(SchedulerTest, DropAdapterCompletesItsQueuedOpsWithTheGivenStatus) {
  Harness h;
  h.StartPaused();
  std::vector<uint64_t> gone;
  for (int i = 0; i < 3; ++i) gone.push_back(h.Submit(MakeOp("t", "a", OpKind::kOther, 0, "a")));
  const uint64_t kept = h.Submit(MakeOp("t", "b", OpKind::kOther, 0, "b"));
  EXPECT_EQ(h.sched->DropAdapter("a", absl::NotFoundError("adapter deleted")), 3);
  EXPECT_EQ(h.sched->DropAdapter("a", absl::NotFoundError("adapter deleted")), 0);
  for (uint64_t id : gone) {
    EXPECT_EQ(h.Result(id, "t").status().code(), absl::StatusCode::kNotFound);
  }
  EXPECT_EQ(h.sched->queued("a"), 0);
  EXPECT_EQ(h.sched->queued_for_tenant("t"), 1);
  h.sched->Resume();
  EXPECT_EQ(Label(h.Result(kept, "t")), "b");
  EXPECT_EQ(h.executor.order(), std::vector<std::string>{"b"});
}

TEST(SchedulerTest, OneOpsErrorStaysWithThatOpInAFusedStep) {
  Harness h;
  h.executor.fail_ = {"bad"};
  h.StartPaused();
  const uint64_t good = h.Submit(MakeOp("t1", "a", OpKind::kForwardBackward, 10, "good"));
  const uint64_t bad = h.Submit(MakeOp("t2", "b", OpKind::kForwardBackward, 10, "bad"));
  h.sched->Step(1);
  EXPECT_EQ(Label(h.Result(good, "t1")), "good");
  EXPECT_EQ(h.Result(bad, "t2").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(h.executor.batches().size(), 1u);
}

TEST(SchedulerTest, ResultsAreOnlyVisibleToTheSubmittingTenant) {
  Harness h;
  h.StartPaused();
  const uint64_t id = h.Submit(MakeOp("t1", "a", OpKind::kOther, 0, "x"));
  h.sched->Step(1);
  EXPECT_TRUE(h.Result(id, "t1").ok());
  EXPECT_EQ(h.futures.Wait(id, "t2", absl::ZeroDuration()).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(SchedulerTest, InvalidOpsAreRefused) {
  Harness h;
  h.StartPaused();
  EXPECT_EQ(h.sched->Submit(MakeOp("", "a", OpKind::kOther, 0, "x")).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(h.sched->Submit(MakeOp("t", "", OpKind::kOther, 0, "x")).status().code(),
            absl::StatusCode::kInvalidArgument);
  h.Submit(MakeOp("t1", "shared", OpKind::kOther, 0, "x"));
  EXPECT_EQ(h.sched->Submit(MakeOp("t2", "shared", OpKind::kOther, 0, "x")).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SchedulerTest, StepRunsExactlyTheAllowedStepsWhilePaused) {
  Harness h;
  h.StartPaused();
  for (int i = 0; i < 5; ++i) h.Submit(MakeOp("t", "a", OpKind::kOther, 0, absl::StrCat(i)));
  h.sched->Step(2);
  ASSERT_TRUE(h.steps.WaitFor(2));
  // A third step would need a Step(); give the loop a chance to (wrongly) run one by
  // submitting and cancelling, which wakes it.
  const uint64_t extra = h.Submit(MakeOp("t", "b", OpKind::kOther, 0, "extra"));
  ASSERT_TRUE(h.sched->Cancel(extra, "t").ok());
  h.sched->Step(1);
  ASSERT_TRUE(h.steps.WaitFor(3));
  EXPECT_EQ(h.executor.order(), (std::vector<std::string>{"0", "1", "2"}));
  EXPECT_EQ(h.sched->queued("a"), 2);
}

// Defers ops labelled "defer": blocks their adapter and leaves the future to the test, like a
// checkpoint write that finishes on another thread.
class DeferringExecutor final : public Executor {
 public:
  std::vector<FutureResult> Execute(const std::vector<const Op*>& batch) override {
    std::vector<FutureResult> results;
    for (const Op* op : batch) {
      const std::string label = std::any_cast<std::string>(op->payload);
      {
        absl::MutexLock lock(&mu_);
        order_.push_back(label);
      }
      if (label == "defer") {
        sched->Block(op->adapter);
        absl::MutexLock lock(&mu_);
        deferred_ = op->id;
        results.push_back(FutureValue(Deferred{}));
      } else {
        results.push_back(Text(label));
      }
    }
    return results;
  }
  std::vector<std::string> order() const {
    absl::MutexLock lock(&mu_);
    return order_;
  }
  uint64_t deferred() const {
    absl::MutexLock lock(&mu_);
    return deferred_;
  }
  Scheduler* sched = nullptr;

 private:
  mutable absl::Mutex mu_;
  std::vector<std::string> order_;
  uint64_t deferred_ = 0;
};

TEST(SchedulerTest, ADeferredOpHoldsItsAdapterUntilUnblockedWhileOthersRun) {
  FakeClock clock;
  FutureStore futures(absl::Hours(1), clock);
  DeferringExecutor executor;
  Scheduler sched({}, executor, futures, clock);
  executor.sched = &sched;
  sched.Pause();
  sched.Start();
  const uint64_t save = *sched.Submit(MakeOp("t", "a", OpKind::kOther, 0, "defer"));
  const uint64_t after = *sched.Submit(MakeOp("t", "a", OpKind::kOther, 0, "a-after"));
  const uint64_t other = *sched.Submit(MakeOp("u", "b", OpKind::kOther, 0, "b-op"));
  sched.Resume();
  // b runs; a's second op waits behind the unfinished deferred one.
  ASSERT_TRUE(futures.Wait(other, "u", kLong).ok());
  EXPECT_FALSE(futures.Wait(save, "t", absl::Milliseconds(50)).ok()) << "deferred op completed by the scheduler";
  EXPECT_FALSE(futures.Wait(after, "t", absl::Milliseconds(50)).ok()) << "a blocked adapter's op ran";
  EXPECT_EQ(sched.queued("a"), 1);
  ASSERT_EQ(executor.deferred(), save);
  // The executor finishes: completes the future itself and unblocks the adapter.
  futures.Complete(save, Text("saved"));
  sched.Unblock("a");
  absl::StatusOr<FutureResult> got = futures.Wait(after, "t", kLong);
  ASSERT_TRUE(got.ok() && got->ok());
  EXPECT_EQ(TextOf(**got), "a-after");
  EXPECT_EQ(TextOf(**futures.Wait(save, "t", kLong)), "saved");
  EXPECT_EQ(executor.order(), (std::vector<std::string>{"defer", "b-op", "a-after"}));
  sched.Stop();
}

}  // namespace
}  // namespace twinkle::sched
