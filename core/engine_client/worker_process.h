#pragma once
// A child process: spawned with fork+exec, killed with a signal, reaped without blocking.

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace twinkle {

class WorkerProcess {
 public:
  // Starts `argv[0]` with `argv`. The child gets SIGKILL if this process dies (Linux
  // PR_SET_PDEATHSIG), so a crashed coordinator never leaves workers holding a device.
  // `stdout_fd` >= 0 becomes the child's stdout (the caller keeps and closes its copy).
  static absl::StatusOr<WorkerProcess> Spawn(const std::vector<std::string>& argv, int stdout_fd = -1);

  WorkerProcess() = default;
  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0; }

  // If the child has exited, reaps it and returns how it ended ("exit code 1", "signal 9").
  std::optional<std::string> PollExit();

  // Sends `signal` and, for SIGKILL, reaps the child. No-op when not running.
  void Kill(int signal);

  // Waits up to `timeout_ms` for the child to exit, then SIGKILLs it. Always reaps.
  std::string WaitOrKill(int timeout_ms);

 private:
  explicit WorkerProcess(pid_t pid) : pid_(pid) {}
  pid_t pid_ = -1;
};

}  // namespace twinkle
