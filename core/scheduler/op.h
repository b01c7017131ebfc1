#pragma once
// One unit of queued work for one adapter, as the scheduler sees it. The scheduler never
// looks inside `payload`: it orders, fuses and times ops by the fields around it, and hands
// them to an Executor that knows what they mean (core/training for engine work).

#include <any>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/futures/future_value.h"

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
  // Estimated activation bytes of its engine pass (core/common/activation_memory.h); a fused
  // step's sum stays within SchedulerOptions::max_activation_bytes_per_step. 0 = unknown.
  int64_t activation_bytes = 0;
  absl::Time deadline = absl::InfiniteFuture();  // never starts after this
  int64_t seq_id = -1;          // >= 0: ordered by it within the adapter's queue (Tinker)
  // Idempotency, per adapter queue (so per tenant: a queue is one tenant's). Non-empty: a
  // second Submit with the same key, the same `name` and the same `fingerprint` returns the
  // first op's id; with another name or fingerprint it is refused (IdempotencyConflict).
  std::string idempotency_key;
  std::string name;             // what the op is ("forward_backward", "optim_step", ...)
  uint64_t fingerprint = 0;     // a hash of the request's body; 0 = not given (not compared)
  // Whom the op is billed to (usage metering): reported back in StepStats::op_usage, never
  // read by the scheduler.
  struct Usage {
    int64_t key_id = 0;  // the API key that submitted it (0: unknown, auth off)
    std::string run_id;
    std::string session_id;
  } usage;
  std::any payload;             // the executor's
};

// An executor result meaning "not finished yet": the scheduler leaves the op's future alone,
// and the executor completes it later from another thread (a checkpoint write running off the
// scheduler thread). The executor Block()s the adapter first, and Unblock()s it when done,
// so the adapter's later ops wait while other adapters' ops keep running.
using Deferred = ::twinkle::Deferred;

// The refusal of a replayed idempotency key whose first use was another op or another body:
// FAILED_PRECONDITION (it will not clear by itself), marked so that the HTTP mapping answers
// 400 (the Tinker SDK retries 409) rather than 403.
inline constexpr char kIdempotencyConflictUrl[] = "twinkle.dev/idempotency-conflict";
inline absl::Status IdempotencyConflict(absl::string_view message) {
  absl::Status s = absl::FailedPreconditionError(message);
  s.SetPayload(kIdempotencyConflictUrl, absl::Cord("1"));
  return s;
}
inline bool IsIdempotencyConflict(const absl::Status& s) {
  return s.GetPayload(kIdempotencyConflictUrl).has_value();
}

}  // namespace twinkle::sched
