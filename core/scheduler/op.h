#pragma once
// One unit of queued work for one adapter, as the scheduler sees it. The scheduler never
// looks inside `payload`: it orders, fuses and times ops by the fields around it, and hands
// them to an Executor that knows what they mean (core/training for engine work).

#include <any>
#include <cstdint>
#include <string>

#include "absl/time/time.h"

namespace twinkle::sched {

enum class OpKind {
  kForward,          // fusable with other adapters' kForward heads into one engine pass
  kForwardBackward,  // fusable with other adapters' kForwardBackward heads
  kOther,            // optim_step, zero_grad, clip, state changes...: runs alone, in order
};

struct Op {
  uint64_t id = 0;              // the future id; assigned by the scheduler at Submit
  std::string tenant;
  std::string adapter;          // queue key: unique across tenants (the caller qualifies it)
  OpKind kind = OpKind::kOther;
  int64_t tokens = 0;           // what fairness charges for it (kOther: 0, counted as 1)
  absl::Time deadline = absl::InfiniteFuture();  // never starts after this
  int64_t seq_id = -1;          // >= 0: ordered by it within the adapter's queue (Tinker)
  std::string idempotency_key;  // non-empty: a second Submit with it returns the first's id
  std::any payload;             // the executor's
};

// An executor result meaning "not finished yet": the scheduler leaves the op's future alone,
// and the executor completes it later from another thread (a checkpoint write running off the
// scheduler thread). The executor Block()s the adapter first, and Unblock()s it when done,
// so the adapter's later ops wait while other adapters' ops keep running.
struct Deferred {};

}  // namespace twinkle::sched
