#include "core/common/timer_thread.h"

#include <utility>

#include "absl/time/clock.h"

namespace twinkle {

TimerThread::TimerThread() : thread_([this] { Loop(); }) {}

TimerThread::~TimerThread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void TimerThread::After(absl::Duration delay, std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.emplace(absl::Now() + delay, std::move(fn));
  }
  cv_.notify_all();
}

void TimerThread::RunAllNow() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::multimap<absl::Time, std::function<void()>> due;
    const absl::Time now = absl::Now();
    for (auto& [when, fn] : jobs_) due.emplace(now, std::move(fn));
    jobs_.swap(due);
  }
  cv_.notify_all();
}

void TimerThread::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (jobs_.empty()) {
      cv_.wait(lock);
      continue;
    }
    const absl::Time when = jobs_.begin()->first;
    const absl::Time now = absl::Now();
    if (when > now) {
      cv_.wait_for(lock, absl::ToChronoNanoseconds(when - now));
      continue;
    }
    std::function<void()> fn = std::move(jobs_.begin()->second);
    jobs_.erase(jobs_.begin());
    lock.unlock();
    fn();
    lock.lock();
  }
}

}  // namespace twinkle
