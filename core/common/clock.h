#pragma once
// Time comes from this interface so that deadlines, heartbeats and back-off can be tested
// without sleeping. Production code uses RealClock().

#include <atomic>
#include <cstdint>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace twinkle {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
};

// The process-wide wall clock.
inline const Clock& RealClock() {
  struct Real final : Clock {
    absl::Time Now() const override { return absl::Now(); }
  };
  static const Real clock;
  return clock;
}

// Another clock moved forward by an offset that only grows: the server's retention clock
// (checkpoint expiry, the reaper, download URL expiry). Tests advance it through the
// testing.hooks-only route POST /api/v1/twinkle/testing/advance_clock instead of sleeping;
// in production nothing advances it, so it reads as `base`.
class OffsetClock final : public Clock {
 public:
  explicit OffsetClock(const Clock& base) : base_(base) {}
  absl::Time Now() const override {
    return base_.Now() + absl::Microseconds(offset_us_.load(std::memory_order_relaxed));
  }
  // Moves the clock forward (a non-positive duration changes nothing).
  void Advance(absl::Duration d) {
    const int64_t us = absl::ToInt64Microseconds(d);
    if (us > 0) offset_us_.fetch_add(us, std::memory_order_relaxed);
  }

 private:
  const Clock& base_;
  std::atomic<int64_t> offset_us_{0};
};

}  // namespace twinkle
