#pragma once
// One thread that runs posted jobs in order, for slow work kept off the scheduler thread
// (checkpoint writes, merged exports). Stop() lets the jobs already posted run (a job can
// ask stopping() to cut itself short) and joins.

#include <deque>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace twinkle::training {

class JobThread {
 public:
  JobThread() = default;
  JobThread(const JobThread&) = delete;
  JobThread& operator=(const JobThread&) = delete;
  ~JobThread() { Stop(); }

  void Start() {
    thread_ = std::thread([this] { Loop(); });
  }
  void Post(std::function<void()> job) {
    absl::MutexLock lock(&mu_);
    jobs_.push_back(std::move(job));
  }
  bool stopping() const {
    absl::MutexLock lock(&mu_);
    return stop_;
  }
  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    if (thread_.joinable()) thread_.join();
  }

 private:
  void Loop() {
    while (true) {
      std::function<void()> job;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !jobs_.empty(); };
        mu_.Await(absl::Condition(&ready));
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }

  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> jobs_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace twinkle::training
