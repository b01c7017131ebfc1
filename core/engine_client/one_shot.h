#pragma once
// A helper process run to completion (such as `twinkle-engine export`), its stdout collected.

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace twinkle {

struct OneShotResult {
  bool exited_zero = false;
  std::string how_ended;  // "exit code 0", "signal 9 (Killed)"
  std::string stdout_text;
};

// Runs `argv` (stderr shared with this process, so its log lines join ours) and returns once
// it has exited. Past `timeout`, or as soon as `cancelled` returns true (polled every 100 ms),
// the child is killed and reaped: DeadlineExceeded / Cancelled. More stdout than
// `max_stdout` bytes is ResourceExhausted (the child is killed).
absl::StatusOr<OneShotResult> RunToCompletion(const std::vector<std::string>& argv, absl::Duration timeout,
                                              const std::function<bool()>& cancelled,
                                              size_t max_stdout = 1 << 20);

}  // namespace twinkle
