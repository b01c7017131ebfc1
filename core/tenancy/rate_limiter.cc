#include "core/tenancy/rate_limiter.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace twinkle::tenancy {
namespace {
constexpr char kRetryAfterPayload[] = "type.googleapis.com/twinkle.RetryAfterMicros";
}  // namespace

TokenRateLimiter::TokenRateLimiter(const Clock& clock) : clock_(clock) {}

TokenRateLimiter::Bucket& TokenRateLimiter::RefillLocked(const Tenant& tenant,
                                                        absl::Time now) const {
  const double burst = static_cast<double>(tenant.quotas.burst_tokens);
  auto [it, inserted] = buckets_.try_emplace(tenant.id, Bucket{burst, now});
  Bucket& b = it->second;
  if (!inserted) {
    const double elapsed_s = std::max(0.0, absl::ToDoubleSeconds(now - b.updated));
    b.tokens = std::min(burst, b.tokens + elapsed_s * tenant.quotas.tokens_per_s);
    if (now > b.updated) b.updated = now;
  }
  return b;
}

absl::Status TokenRateLimiter::Acquire(const Tenant& tenant, int64_t tokens) {
  const Quotas& q = tenant.quotas;
  if (tokens <= 0 || q.tokens_per_s <= 0) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  Bucket& b = RefillLocked(tenant, clock_.Now());
  const double needed = static_cast<double>(std::min(tokens, q.burst_tokens));
  if (b.tokens >= needed) {
    b.tokens -= static_cast<double>(tokens);
    return absl::OkStatus();
  }
  const double wait_s = (needed - b.tokens) / q.tokens_per_s;
  absl::Status status = absl::ResourceExhaustedError(absl::StrFormat(
      "rate limit: tenant '%s' may send %d tokens in %.3f s (tokens_per_s %g, burst_tokens %d)",
      tenant.id, tokens, wait_s, q.tokens_per_s, q.burst_tokens));
  SetRetryAfter(status, absl::Seconds(wait_s));
  return status;
}

void TokenRateLimiter::Refund(const Tenant& tenant, int64_t tokens) {
  if (tokens <= 0 || tenant.quotas.tokens_per_s <= 0) return;
  absl::MutexLock lock(&mu_);
  Bucket& b = RefillLocked(tenant, clock_.Now());
  b.tokens = std::min(static_cast<double>(tenant.quotas.burst_tokens),
                      b.tokens + static_cast<double>(tokens));
}

double TokenRateLimiter::available(const Tenant& tenant) const {
  absl::MutexLock lock(&mu_);
  return RefillLocked(tenant, clock_.Now()).tokens;
}

void SetRetryAfter(absl::Status& status, absl::Duration wait) {
  if (status.ok()) return;
  const int64_t micros = std::max<int64_t>(0, absl::ToInt64Microseconds(absl::Ceil(wait, absl::Microseconds(1))));
  status.SetPayload(kRetryAfterPayload, absl::Cord(absl::StrCat(micros)));
}

std::optional<absl::Duration> RetryAfter(const absl::Status& status) {
  if (status.ok()) return std::nullopt;
  auto payload = status.GetPayload(kRetryAfterPayload);
  int64_t micros;
  if (!payload || !absl::SimpleAtoi(std::string(*payload), &micros)) return std::nullopt;
  return absl::Microseconds(micros);
}

std::optional<int64_t> RetryAfterSeconds(const absl::Status& status) {
  std::optional<absl::Duration> wait = RetryAfter(status);
  if (!wait) return std::nullopt;
  const int64_t seconds = static_cast<int64_t>(std::ceil(absl::ToDoubleSeconds(*wait)));
  return std::max<int64_t>(1, seconds);
}

}  // namespace twinkle::tenancy
