#pragma once
// A Clock for tests: time stands still until the test advances it. Thread-safe.

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/common/clock.h"

namespace twinkle::testing {

class FakeClock final : public Clock {
 public:
  absl::Time Now() const override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ = absl::FromUnixSeconds(1'700'000'000);
};

}  // namespace twinkle::testing
