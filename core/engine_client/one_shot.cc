#include "core/engine_client/one_shot.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "core/engine_client/worker_process.h"

namespace twinkle {

absl::StatusOr<OneShotResult> RunToCompletion(const std::vector<std::string>& argv, absl::Duration timeout,
                                              const std::function<bool()>& cancelled, size_t max_stdout) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return absl::ResourceExhaustedError(absl::StrCat("pipe: ", std::strerror(errno)));
  absl::StatusOr<WorkerProcess> child = WorkerProcess::Spawn(argv, fds[1]);
  close(fds[1]);
  if (!child.ok()) {
    close(fds[0]);
    return child.status();
  }
  const absl::Time deadline = absl::Now() + timeout;
  OneShotResult result;
  absl::Status failure;
  char buffer[65536];
  while (true) {
    if (absl::Now() > deadline) {
      failure = absl::DeadlineExceededError(absl::StrCat(argv[0], " ran past its deadline of ",
                                                         absl::FormatDuration(timeout)));
      break;
    }
    if (cancelled && cancelled()) {
      failure = absl::CancelledError(absl::StrCat(argv[0], ": cancelled (the server is stopping)"));
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    const int ready = poll(&p, 1, 100);
    if (ready < 0 && errno != EINTR) {
      failure = absl::InternalError(absl::StrCat("poll: ", std::strerror(errno)));
      break;
    }
    if (ready <= 0) continue;
    const ssize_t n = read(fds[0], buffer, sizeof(buffer));
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) break;  // EOF: the child closed its stdout (it is exiting)
    if (result.stdout_text.size() + static_cast<size_t>(n) > max_stdout) {
      failure = absl::ResourceExhaustedError(absl::StrCat(argv[0], " wrote more than ", max_stdout,
                                                          " bytes to stdout"));
      break;
    }
    result.stdout_text.append(buffer, static_cast<size_t>(n));
  }
  close(fds[0]);
  if (!failure.ok()) {
    child->Kill(SIGKILL);
    return failure;
  }
  // Its stdout is closed; give it the rest of the deadline to exit.
  const int64_t left_ms = std::max<int64_t>(1000, absl::ToInt64Milliseconds(deadline - absl::Now()));
  result.how_ended = child->WaitOrKill(static_cast<int>(std::min<int64_t>(left_ms, 1 << 30)));
  result.exited_zero = result.how_ended == "exit code 0";
  return result;
}

}  // namespace twinkle
