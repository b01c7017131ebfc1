#pragma once
// Per-tenant token rate limits: one token bucket per tenant, filled at quotas.tokens_per_s
// up to quotas.burst_tokens (a tenant's bucket starts full). tokens_per_s = 0 means
// unlimited.
//
// A request for n tokens passes when the bucket holds min(n, burst_tokens) tokens, and then
// takes all n: a request larger than the burst is allowed once the bucket is full and leaves
// it in debt, so the long-run rate still never exceeds tokens_per_s. Otherwise it is refused
// with RESOURCE_EXHAUSTED and takes nothing; the status says how long to wait, in its message
// and in a payload that RetryAfter() reads, so HTTP can answer 429 + Retry-After and gRPC can
// send the `retry-after` trailing metadata.

#include <cstdint>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/common/clock.h"
#include "core/tenancy/tenant.h"

namespace twinkle::tenancy {

class TokenRateLimiter {
 public:
  explicit TokenRateLimiter(const Clock& clock = RealClock());

  // Takes `tokens` from the tenant's bucket (quotas from tenant.quotas), or returns
  // ResourceExhausted with the wait. tokens <= 0 always passes. Thread-safe.
  absl::Status Acquire(const Tenant& tenant, int64_t tokens);

  // Gives back tokens taken by an Acquire whose request was then refused for another
  // reason (never above the burst).
  void Refund(const Tenant& tenant, int64_t tokens);

  // Tokens in the tenant's bucket now (may be negative after an oversized request);
  // burst_tokens for a tenant never seen. For tests and metrics.
  double available(const Tenant& tenant) const;

 private:
  struct Bucket {
    double tokens = 0;
    absl::Time updated;
  };
  Bucket& RefillLocked(const Tenant& tenant, absl::Time now) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Clock& clock_;
  mutable absl::Mutex mu_;
  mutable absl::flat_hash_map<std::string, Bucket> buckets_ ABSL_GUARDED_BY(mu_);
};

// The wait a RESOURCE_EXHAUSTED status from TokenRateLimiter::Acquire carries; nullopt for
// any other status.
std::optional<absl::Duration> RetryAfter(const absl::Status& status);

// The same wait in whole seconds, rounded up and at least 1: the value for an HTTP
// `Retry-After` header or the gRPC `retry-after` trailing metadata.
std::optional<int64_t> RetryAfterSeconds(const absl::Status& status);

// Attaches a wait to any status (for other refusals that should carry Retry-After, e.g. a
// full queue). No effect on an OK status.
void SetRetryAfter(absl::Status& status, absl::Duration wait);

}  // namespace twinkle::tenancy
