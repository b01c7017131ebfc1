#pragma once
// One thread that runs jobs when they fall due, one at a time: the timers of long polls and
// waits (a wait holds no thread; its timer answers "not yet"), seq_id gap timeouts, periodic
// housekeeping, and blocking calls that must leave the caller's thread. A job must not block
// for long: the jobs behind it wait. Destruction stops the thread; jobs not yet due are
// dropped without running.

#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "absl/time/time.h"

namespace twinkle {

class TimerThread {
 public:
  TimerThread();
  ~TimerThread();
  TimerThread(const TimerThread&) = delete;
  TimerThread& operator=(const TimerThread&) = delete;

  // Runs `fn` on the thread once `delay` has passed (jobs due at the same time in order).
  void After(absl::Duration delay, std::function<void()> fn);
  void Post(std::function<void()> fn) { After(absl::ZeroDuration(), std::move(fn)); }
  // Makes every job queued so far due now (in their order): a server that starts draining
  // answers its open waits at once instead of at their timeouts.
  void RunAllNow();

 private:
  void Loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::multimap<absl::Time, std::function<void()>> jobs_;
  bool stop_ = false;
  std::thread thread_;  // last: started once the members above exist
};

}  // namespace twinkle
