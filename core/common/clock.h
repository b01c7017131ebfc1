#pragma once
// Time comes from this interface so that deadlines, heartbeats and back-off can be tested
// without sleeping. Production code uses RealClock().

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

}  // namespace twinkle
