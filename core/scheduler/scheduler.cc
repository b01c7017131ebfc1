#include "core/scheduler/scheduler.h"

#include <algorithm>
#include <atomic>
#include <deque>
#include <exception>
#include <tuple>
#include <variant>
#include <utility>

#include "absl/strings/str_cat.h"

namespace twinkle::sched {
namespace {

// How often the loop looks at the clock while queued ops have deadlines and nothing else
// wakes it. The clock may be a test's fake one that nobody signals us about, so the wait is
// bounded instead of computed from the deadline.
constexpr absl::Duration kDeadlinePoll = absl::Milliseconds(2);

bool Fusable(OpKind kind) { return kind == OpKind::kForward || kind == OpKind::kForwardBackward; }
// What fairness charges for an op: its tokens, at least 1 (so kOther ops are not free).
int64_t Charge(const Op& op) { return std::max<int64_t>(op.tokens, 1); }
// What an op takes of a step's token budget.
int64_t BudgetTokens(const Op& op) { return std::max<int64_t>(op.tokens, 0); }
// What an op takes of a step's memory budget (both are bounded, so the sum cannot overflow:
// each op counts at most 2^61 bytes, and one is added only while the sum stays in budget).
int64_t BudgetBytes(const Op& op) { return std::clamp<int64_t>(op.activation_bytes, 0, int64_t{1} << 61); }

}  // namespace

void SeedFutureIds(uint64_t next) { ::twinkle::SeedFutureIds(next); }

struct Scheduler::Queued {
  std::unique_ptr<Op> op;
  absl::Time enqueued;
};

struct Scheduler::TenantState {
  std::string name;
  int64_t served = 0;     // VTC counter: tokens charged (plus lifts on becoming backlogged)
  int64_t pending = 0;    // queued ops over all the tenant's adapters
  uint64_t last_pick = 0; // pick_seq_ when it was last served: ties go to the longest waiting
  std::deque<Queue*> rr;  // its adapters with queued ops; front takes the next turn
};

struct Scheduler::Queue {
  std::string adapter;
  TenantState* tenant = nullptr;  // tenants are never erased, so this stays valid
  std::deque<Queued> ops;         // head = ops.front(), the only one that may run
  bool in_rr = false;             // listed in tenant->rr (exactly when ops is non-empty and
                                  // the queue is not blocked)
  int blocked = 0;                // Block() count: while > 0 none of its ops is picked
  struct KeyRecord {
    uint64_t id = 0;       // the future id of the op first submitted with the key
    std::string name;      // that op's name and body fingerprint: a replay must match both
    uint64_t fingerprint = 0;
  };
  absl::flat_hash_map<std::string, KeyRecord> keys;  // idempotency key → its first op
  std::deque<std::string> key_order;                // oldest first, for the bound
};

Scheduler::Scheduler(SchedulerOptions options, Executor& executor, FutureStore& futures,
                     const Clock& clock)
    : options_(options), executor_(executor), futures_(futures), clock_(clock) {}

Scheduler::~Scheduler() { Stop(); }

void Scheduler::Start() {
  absl::MutexLock lock(&mu_);
  if (stopping_ || thread_.joinable()) return;
  thread_ = std::thread(&Scheduler::Loop, this);
}

void Scheduler::Stop() {
  std::thread loop;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    loop = std::move(thread_);
    wake_.SignalAll();
  }
  if (loop.joinable()) {
    // Called from the loop thread itself (a listener or a completion callback): it exits on
    // its own once the current step returns.
    if (loop.get_id() == std::this_thread::get_id()) {
      loop.detach();
    } else {
      loop.join();
    }
  }
  Completions done;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [adapter, queue] : queues_) {
      while (!queue->ops.empty()) {
        Queued q = TakeLocked(queue.get(), 0);
        done.emplace_back(q.op->id, absl::UnavailableError("scheduler stopped"));
      }
    }
  }
  CompleteAll(done);
}

absl::StatusOr<uint64_t> Scheduler::Submit(Op op) {
  if (op.tenant.empty()) return absl::InvalidArgumentError("op without a tenant");
  if (op.adapter.empty()) return absl::InvalidArgumentError("op without an adapter");
  const absl::Time now = clock_.Now();
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("scheduler stopped");

  auto qit = queues_.find(op.adapter);
  Queue* queue = qit == queues_.end() ? nullptr : qit->second.get();
  if (queue != nullptr && queue->tenant->name != op.tenant) {
    return absl::InvalidArgumentError("adapter is not this tenant's");
  }
  // A retry of an accepted op: the earlier id, whatever became of it since.
  if (queue != nullptr && !op.idempotency_key.empty()) {
    auto k = queue->keys.find(op.idempotency_key);
    if (k != queue->keys.end()) {
      const Queue::KeyRecord& first = k->second;
      if (first.name != op.name) {
        return IdempotencyConflict(absl::StrCat(
            "idempotency key '", op.idempotency_key, "' was already used for a ", first.name.empty() ? "different" : first.name,
            " operation of this adapter; a ", op.name.empty() ? "different" : op.name,
            " operation needs a key of its own"));
      }
      if (first.fingerprint != 0 && op.fingerprint != 0 && first.fingerprint != op.fingerprint) {
        return IdempotencyConflict(absl::StrCat("idempotency key '", op.idempotency_key, "' was already used for a ",
                                                first.name, " with a different request body; a new request needs a "
                                                "key of its own"));
      }
      return first.id;
    }
  }
  if (op.deadline <= now) {
    return absl::DeadlineExceededError("deadline passed before the op was queued");
  }
  if (queue != nullptr && static_cast<int64_t>(queue->ops.size()) >= options_.queue_cap) {
    return absl::ResourceExhaustedError(
        absl::StrCat("adapter queue full: queue_cap=", options_.queue_cap));
  }
  auto tit = tenants_.find(op.tenant);
  TenantState* tenant = tit == tenants_.end() ? nullptr : tit->second.get();
  const int64_t tenant_pending = tenant == nullptr ? 0 : tenant->pending;
  if (tenant_pending >= options_.max_pending_per_tenant) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "tenant has too many queued ops: max_pending_per_tenant=", options_.max_pending_per_tenant));
  }
  if (queue == nullptr && options_.queue_cap <= 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("adapter queue full: queue_cap=", options_.queue_cap));
  }

  if (tenant == nullptr) {
    auto state = std::make_unique<TenantState>();
    state->name = op.tenant;
    tenant = state.get();
    tenants_.emplace(op.tenant, std::move(state));
  }
  if (queue == nullptr) {
    auto state = std::make_unique<Queue>();
    state->adapter = op.adapter;
    state->tenant = tenant;
    queue = state.get();
    queues_.emplace(op.adapter, std::move(state));
  }

  const uint64_t id = NewFutureId();
  op.id = id;
  futures_.Create(id, op.tenant);  // before the loop can see the op (it may complete it)

  if (!op.idempotency_key.empty() && options_.idempotency_keys_per_adapter > 0) {
    while (static_cast<int64_t>(queue->key_order.size()) >= options_.idempotency_keys_per_adapter) {
      queue->keys.erase(queue->key_order.front());
      queue->key_order.pop_front();
    }
    queue->keys.emplace(op.idempotency_key, Queue::KeyRecord{id, op.name, op.fingerprint});
    queue->key_order.push_back(op.idempotency_key);
  }
  if (op.deadline != absl::InfiniteFuture()) deadlines_.emplace(op.deadline, id);
  where_[id] = queue;

  // FIFO, except that an op with a seq_id passes queued ops with a larger seq_id (never an
  // op without one); equal seq_ids keep their arrival order.
  size_t position = queue->ops.size();
  if (op.seq_id >= 0) {
    while (position > 0) {
      const Op& before = *queue->ops[position - 1].op;
      if (before.seq_id < 0 || before.seq_id <= op.seq_id) break;
      --position;
    }
  }
  queue->ops.insert(queue->ops.begin() + position,
                    Queued{std::make_unique<Op>(std::move(op)), now});
  if (!queue->in_rr && queue->blocked == 0) {
    queue->tenant->rr.push_back(queue);
    queue->in_rr = true;
  }
  if (tenant->pending++ == 0) {
    // Becoming backlogged: lift the counter so that idling earns no credit. To the smallest
    // counter among the backlogged tenants, or when none is, to the counter of the tenant
    // that last went idle (VTC, Sheng et al. 2024, algorithm 2).
    int64_t floor = last_left_served_;
    if (!backlogged_.empty()) {
      floor = (*std::min_element(backlogged_.begin(), backlogged_.end(),
                                 [](const TenantState* a, const TenantState* b) {
                                   return a->served < b->served;
                                 }))->served;
    }
    tenant->served = std::max(tenant->served, floor);
    backlogged_.insert(tenant);
  }
  ++total_queued_;
  wake_.Signal();
  return id;
}

Scheduler::Queued Scheduler::TakeLocked(Queue* queue, size_t position) {
  Queued out = std::move(queue->ops[position]);
  queue->ops.erase(queue->ops.begin() + position);
  const Op& op = *out.op;
  where_.erase(op.id);
  if (op.deadline != absl::InfiniteFuture()) deadlines_.erase({op.deadline, op.id});
  --total_queued_;
  TenantState* tenant = queue->tenant;
  if (queue->ops.empty() && queue->in_rr) {
    tenant->rr.erase(std::find(tenant->rr.begin(), tenant->rr.end(), queue));
    queue->in_rr = false;
  }
  if (--tenant->pending == 0) {
    backlogged_.erase(tenant);
    last_left_served_ = tenant->served;
  }
  return out;
}

absl::Status Scheduler::Cancel(uint64_t id, const std::string& tenant) {
  {
    absl::MutexLock lock(&mu_);
    auto w = where_.find(id);
    if (w == where_.end() || w->second->tenant->name != tenant) {
      return absl::NotFoundError("no queued op with this id");
    }
    Queue* queue = w->second;
    size_t position = 0;
    while (queue->ops[position].op->id != id) ++position;
    TakeLocked(queue, position);
  }
  futures_.Complete(id, absl::CancelledError("cancelled"));
  return absl::OkStatus();
}

int64_t Scheduler::DropAdapter(const std::string& adapter, const absl::Status& status) {
  // An OK status cannot be a failed result; the ops did not run, so say so.
  const absl::Status result = status.ok() ? absl::AbortedError("adapter dropped") : status;
  Completions done;
  {
    absl::MutexLock lock(&mu_);
    auto it = queues_.find(adapter);
    if (it == queues_.end()) return 0;
    Queue* queue = it->second.get();
    while (!queue->ops.empty()) done.emplace_back(TakeLocked(queue, 0).op->id, result);
    queues_.erase(it);
  }
  const int64_t dropped = static_cast<int64_t>(done.size());
  CompleteAll(done);
  return dropped;
}

void Scheduler::ExpireLocked(absl::Time now, Completions* done) {
  while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
    const uint64_t id = deadlines_.begin()->second;
    Queue* queue = where_.at(id);
    size_t position = 0;
    while (queue->ops[position].op->id != id) ++position;
    TakeLocked(queue, position);
    done->emplace_back(id, absl::DeadlineExceededError("deadline passed while queued"));
  }
}

void Scheduler::CompleteAll(Completions& done) {
  for (auto& [id, status] : done) futures_.Complete(id, status);
  done.clear();
}

std::vector<Scheduler::Queued> Scheduler::PickLocked() {
  std::vector<Queued> batch;
  // VTC order: smallest counter first; among equal counters the tenant served longest ago.
  auto min_tenant = [this](const absl::flat_hash_set<TenantState*>& excluded)
                        ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    TenantState* best = nullptr;
    for (TenantState* t : backlogged_) {
      if (excluded.contains(t) || t->rr.empty()) continue;  // empty rr: only blocked queues
      if (best == nullptr || std::tie(t->served, t->last_pick, t->name) <
                                 std::tie(best->served, best->last_pick, best->name)) {
        best = t;
      }
    }
    return best;
  };
  auto take_head = [this, &batch](TenantState* tenant, Queue* queue)
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    tenant->served += Charge(*queue->ops.front().op);
    tenant->last_pick = ++pick_seq_;
    batch.push_back(TakeLocked(queue, 0));
    if (queue->in_rr) {  // still has ops: its turn is over, to the back of the round robin
      auto& rr = tenant->rr;
      rr.erase(std::find(rr.begin(), rr.end(), queue));
      rr.push_back(queue);
    }
  };

  absl::flat_hash_set<TenantState*> full;  // tenants with nothing more for this step
  TenantState* tenant = min_tenant(full);
  if (tenant == nullptr) return batch;
  Queue* first = tenant->rr.front();
  take_head(tenant, first);
  const OpKind kind = batch.front().op->kind;
  if (!options_.fuse || !Fusable(kind)) return batch;

  // Fuse: further heads of the same kind, in fairness order, one per adapter, under budget.
  int64_t tokens = BudgetTokens(*batch.front().op);
  int64_t bytes = BudgetBytes(*batch.front().op);
  const int64_t max_bytes = options_.max_activation_bytes_per_step;
  absl::flat_hash_set<const Queue*> used = {first};
  while (static_cast<int64_t>(batch.size()) < options_.max_ops_per_step) {
    tenant = min_tenant(full);
    if (tenant == nullptr) break;
    Queue* pick = nullptr;
    for (Queue* queue : tenant->rr) {
      if (used.contains(queue)) continue;
      const Op& head = *queue->ops.front().op;
      if (head.kind != kind || tokens + BudgetTokens(head) > options_.max_tokens_per_step) continue;
      if (max_bytes > 0 && bytes + BudgetBytes(head) > max_bytes) continue;
      pick = queue;
      break;
    }
    if (pick == nullptr) {
      full.insert(tenant);
      continue;
    }
    tokens += BudgetTokens(*pick->ops.front().op);
    bytes += BudgetBytes(*pick->ops.front().op);
    used.insert(pick);
    take_head(tenant, pick);
  }
  return batch;
}

void Scheduler::Loop() {
  for (;;) {
    Completions expired;
    std::vector<Queued> batch;
    absl::Time picked_at;
    StepListener listener;
    bool exit = false;
    {
      absl::MutexLock lock(&mu_);
      for (;;) {
        if (stopping_) {
          exit = true;
          break;
        }
        const absl::Time now = clock_.Now();
        ExpireLocked(now, &expired);
        if (total_queued_ > 0 && (!paused_ || steps_allowed_ > 0) && RunnableLocked()) {
          batch = PickLocked();
          if (paused_) --steps_allowed_;
          picked_at = now;
          break;
        }
        if (!expired.empty()) break;  // complete them before sleeping
        if (deadlines_.empty()) {
          wake_.Wait(&mu_);
        } else {
          wake_.WaitWithTimeout(&mu_, kDeadlinePoll);
        }
      }
      listener = listener_;
    }
    CompleteAll(expired);
    if (exit) return;
    if (!batch.empty()) RunStep(batch, picked_at, listener);
  }
}

void Scheduler::RunStep(std::vector<Queued>& batch, absl::Time picked_at,
                        const StepListener& listener) {
  std::vector<const Op*> ops;
  ops.reserve(batch.size());
  for (const Queued& q : batch) ops.push_back(q.op.get());

  const absl::Time start = clock_.Now();
  std::vector<FutureResult> results;
  try {
    results = executor_.Execute(ops);
  } catch (const std::exception& e) {
    results.assign(ops.size(), absl::InternalError(absl::StrCat("executor threw: ", std::string(e.what()))));
  } catch (...) {
    results.assign(ops.size(), absl::InternalError("executor threw"));
  }
  if (results.size() != ops.size()) {
    results.assign(ops.size(), absl::InternalError(absl::StrCat(
                                   "executor returned ", results.size(), " results for ",
                                   ops.size(), " ops")));
  }
  const absl::Duration duration = clock_.Now() - start;
  std::vector<bool> ok(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) ok[i] = results[i].ok();  // before the results move out
  for (size_t i = 0; i < ops.size(); ++i) {
    // A Deferred result: the executor completes this future itself, later.
    if (results[i].ok() && std::holds_alternative<Deferred>(*results[i])) continue;
    futures_.Complete(ops[i]->id, std::move(results[i]));
  }

  if (!listener) return;
  StepStats stats;
  stats.kind = ops.front()->kind;
  stats.ops = static_cast<int32_t>(ops.size());
  stats.duration = duration;
  absl::flat_hash_set<std::string> tenants;
  for (size_t i = 0; i < batch.size(); ++i) {
    const Queued& q = batch[i];
    stats.tokens += BudgetTokens(*q.op);
    tenants.insert(q.op->tenant);
    stats.waits.emplace_back(q.op->tenant, picked_at - q.enqueued);
    stats.op_tokens.push_back(BudgetTokens(*q.op));
    stats.op_usage.push_back(q.op->usage);
    stats.op_names.push_back(q.op->name);
    stats.op_ok.push_back(ok[i]);
  }
  stats.tenants = static_cast<int32_t>(tenants.size());
  listener(stats);
}

bool Scheduler::RunnableLocked() const {
  for (const TenantState* t : backlogged_) {
    if (!t->rr.empty()) return true;
  }
  return false;
}

void Scheduler::Block(const std::string& adapter) {
  absl::MutexLock lock(&mu_);
  auto it = queues_.find(adapter);
  if (it == queues_.end()) return;
  Queue* queue = it->second.get();
  if (queue->blocked++ == 0 && queue->in_rr) {
    auto& rr = queue->tenant->rr;
    rr.erase(std::find(rr.begin(), rr.end(), queue));
    queue->in_rr = false;
  }
}

void Scheduler::Unblock(const std::string& adapter) {
  absl::MutexLock lock(&mu_);
  auto it = queues_.find(adapter);
  if (it == queues_.end()) return;
  Queue* queue = it->second.get();
  if (queue->blocked == 0 || --queue->blocked > 0) return;
  if (!queue->ops.empty() && !queue->in_rr) {
    queue->tenant->rr.push_back(queue);
    queue->in_rr = true;
  }
  wake_.Signal();
}

void Scheduler::Pause() {
  absl::MutexLock lock(&mu_);
  paused_ = true;
  steps_allowed_ = 0;
}

void Scheduler::Resume() {
  absl::MutexLock lock(&mu_);
  paused_ = false;
  steps_allowed_ = 0;
  wake_.Signal();
}

void Scheduler::Step(int32_t steps) {
  absl::MutexLock lock(&mu_);
  if (!paused_ || steps <= 0) return;
  steps_allowed_ += steps;
  wake_.Signal();
}

int64_t Scheduler::queued(const std::string& adapter) const {
  absl::MutexLock lock(&mu_);
  auto it = queues_.find(adapter);
  return it == queues_.end() ? 0 : static_cast<int64_t>(it->second->ops.size());
}

int64_t Scheduler::queued_for_tenant(const std::string& tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = tenants_.find(tenant);
  return it == tenants_.end() ? 0 : it->second->pending;
}

absl::flat_hash_map<std::string, int64_t> Scheduler::served_tokens() const {
  absl::MutexLock lock(&mu_);
  absl::flat_hash_map<std::string, int64_t> out;
  for (const auto& [name, tenant] : tenants_) out[name] = tenant->served;
  return out;
}

void Scheduler::SetStepListener(StepListener listener) {
  absl::MutexLock lock(&mu_);
  listener_ = std::move(listener);
}

}  // namespace twinkle::sched
