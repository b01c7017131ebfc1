#pragma once
// The fair, fusing scheduler: per-adapter FIFO queues, one loop thread that picks work across
// tenants fairly and fuses the head forward / forward_backward ops of many adapters into one
// engine step under a token budget.
//
// Fairness: virtual token counters (VTC, Sheng et al. 2024). Each tenant has a counter of
// the tokens served to it (an op is charged max(tokens, 1) when it is picked); the loop
// always serves the backlogged tenant (one with queued ops) with the smallest counter first,
// ties to the tenant served longest ago. A tenant that becomes backlogged after idling has
// its counter lifted to the smallest counter among the backlogged tenants (when none is
// backlogged: to the counter of the tenant that went idle last), so idling earns no credit
// to burst with. Within a tenant, its adapters take turns (round robin).
//
// Fusion: a step starts with the fairest head op. A kForward / kForwardBackward head (with
// options.fuse) is joined by the heads of the same kind of other adapters, picked on in the
// same fairness order (re-evaluated after each op is charged), at most one op per adapter,
// while the step's tokens stay within max_tokens_per_step, its estimated activation bytes
// within max_activation_bytes_per_step (when set) and its ops within max_ops_per_step; the
// first op runs even if it alone exceeds a budget (the coordinator refuses a request over the
// memory budget when it is submitted). Heads of another
// kind wait at their queue's head for a later step. A kOther op runs alone.
//
// Ordering: only the head of an adapter's queue can run, so an adapter's ops run strictly in
// submission order (or seq_id order when given): an optim_step runs after the backward
// queued before it. A fused step holds at most one op per adapter.
//
// Deadlines: a queued op whose deadline has passed is completed with DEADLINE_EXCEEDED and
// never runs. Cancel removes a queued op (CANCELLED). Results go to the FutureStore.

#include <any>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/common/clock.h"
#include "core/futures/future_store.h"
#include "core/scheduler/op.h"

namespace twinkle::sched {

// Runs what the scheduler picked. Called on the scheduler thread only, one batch at a time.
class Executor {
 public:
  virtual ~Executor() = default;
  // `batch` holds one op, or several ops of the same fusable kind for distinct adapters.
  // Returns one result per op, in order. An error in one op's result must not be caused by
  // another op of the batch (the executor retries ops alone when a fused step fails).
  virtual std::vector<FutureResult> Execute(const std::vector<const Op*>& batch) = 0;
};

struct SchedulerOptions {
  int64_t max_tokens_per_step = 8192;  // token budget of one fused step
  // Memory budget of one fused step: the sum of its ops' activation_bytes
  // (engine.activation_memory_mib); 0 = none.
  int64_t max_activation_bytes_per_step = 0;
  int32_t max_ops_per_step = 64;       // adapters fused into one step at most
  bool fuse = true;                    // false: every op runs alone (benchmarks compare)
  int32_t queue_cap = 64;              // queued ops per adapter; more → RESOURCE_EXHAUSTED
  int32_t max_pending_per_tenant = 256;  // queued ops per tenant over all its adapters
  // Idempotency keys remembered per adapter (oldest forgotten first), so that a retry of an
  // op that already completed still gets the earlier id.
  int32_t idempotency_keys_per_adapter = 1024;
};

// What a step looked like, for metrics.
struct StepStats {
  OpKind kind = OpKind::kOther;
  int32_t ops = 0;       // ops (= adapters) in the step
  int64_t tokens = 0;
  int32_t tenants = 0;
  absl::Duration duration;
  std::vector<std::pair<std::string, absl::Duration>> waits;  // (tenant, queue wait) per op
  std::vector<int64_t> op_tokens;                              // per op, in the order of waits
  // Per op, in the order of waits: its billing attribution, name and whether it succeeded.
  std::vector<Op::Usage> op_usage;
  std::vector<std::string> op_names;
  std::vector<bool> op_ok;
};

// Future ids continue from `next` (never moving backwards): a server that persists futures
// starts each boot in its own id range. Call before any Submit.
void SeedFutureIds(uint64_t next);

class Scheduler {
 public:
  using StepListener = std::function<void(const StepStats&)>;

  Scheduler(SchedulerOptions options, Executor& executor, FutureStore& futures,
            const Clock& clock = RealClock());
  ~Scheduler();  // Stop()s

  void Start();
  // Stops the loop after the step in progress; queued ops complete with UNAVAILABLE.
  // Idempotent. From the loop thread (a listener or a completion callback) it does not wait
  // for the loop, which then exits once that callback returns.
  void Stop();

  // Queues `op` (its id is assigned here, unique in the process) and creates its future.
  // Returns the future id. INVALID_ARGUMENT without a tenant or adapter, or when the adapter
  // is queued under another tenant.
  // RESOURCE_EXHAUSTED when the adapter's queue or the tenant's pending quota is full;
  // DEADLINE_EXCEEDED when the deadline has already passed; UNAVAILABLE after Stop. With an
  // idempotency key already seen for this adapter, returns the earlier op's id and queues
  // nothing when the op's name and fingerprint match the earlier op's; otherwise
  // FAILED_PRECONDITION (IdempotencyConflict) naming the key: a replay never gets another
  // op's result.
  absl::StatusOr<uint64_t> Submit(Op op);

  // Removes a queued op: its future completes with CANCELLED. NotFound when the id is not
  // queued for this tenant (unknown, another tenant's, already running or done).
  absl::Status Cancel(uint64_t id, const std::string& tenant);

  // Completes every queued op of `adapter` with `status` (ABORTED when `status` is OK) and
  // forgets the queue, its idempotency keys included (the adapter is being removed or
  // expired). An op of it already running completes normally. Returns how many ops were
  // dropped.
  int64_t DropAdapter(const std::string& adapter, const absl::Status& status);

  // While an adapter is blocked (a count: each Block needs its Unblock), none of its queued
  // ops is picked; other adapters run. For work an executor finishes off the scheduler
  // thread (see Deferred). Unknown adapters are ignored.
  void Block(const std::string& adapter);
  void Unblock(const std::string& adapter);

  // Test hooks (exposed only when the config enables them): while paused the loop runs
  // nothing except what Step() allows; deadlines still expire queued ops.
  void Pause();
  void Resume();
  // While paused: allow this many more steps, run as soon as there are ops to run (steps
  // allowed while the queues are empty wait for ops). Ignored when not paused.
  void Step(int32_t steps = 1);

  int64_t queued(const std::string& adapter) const;
  int64_t queued_for_tenant(const std::string& tenant) const;
  // Served-token counters per tenant (VTC), for tests and metrics.
  absl::flat_hash_map<std::string, int64_t> served_tokens() const;

  void SetStepListener(StepListener listener);

 private:
  struct Queued;
  struct Queue;
  struct TenantState;
  using Completions = std::vector<std::pair<uint64_t, absl::Status>>;

  void Loop();
  // Runs one picked step: Execute without mu_, then completes the futures and tells the
  // listener.
  void RunStep(std::vector<Queued>& batch, absl::Time picked_at, const StepListener& listener);
  std::vector<Queued> PickLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Some backlogged tenant has an unblocked queue with ops.
  bool RunnableLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ExpireLocked(absl::Time now, Completions* done) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes one queued op from its queue and every index; keeps the counters true.
  Queued TakeLocked(Queue* queue, size_t position) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CompleteAll(Completions& done);  // without mu_

  const SchedulerOptions options_;
  Executor& executor_;
  FutureStore& futures_;
  const Clock& clock_;

  mutable absl::Mutex mu_;
  absl::CondVar wake_;
  StepListener listener_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool paused_ ABSL_GUARDED_BY(mu_) = false;
  int32_t steps_allowed_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, std::unique_ptr<Queue>> queues_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::unique_ptr<TenantState>> tenants_ ABSL_GUARDED_BY(mu_);
  // Tenants with queued ops (VTC's "backlogged" set).
  absl::flat_hash_set<TenantState*> backlogged_ ABSL_GUARDED_BY(mu_);
  // Queued op id → its queue (Cancel, expiry).
  absl::flat_hash_map<uint64_t, Queue*> where_ ABSL_GUARDED_BY(mu_);
  // (deadline, id) of queued ops with a finite deadline, earliest first.
  std::set<std::pair<absl::Time, uint64_t>> deadlines_ ABSL_GUARDED_BY(mu_);
  int64_t total_queued_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t last_left_served_ ABSL_GUARDED_BY(mu_) = 0;  // counter of the last tenant to idle
  uint64_t pick_seq_ ABSL_GUARDED_BY(mu_) = 0;         // orders ties between equal counters
  std::thread thread_ ABSL_GUARDED_BY(mu_);
};

}  // namespace twinkle::sched
