#include "core/engine_client/worker_process.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"

namespace twinkle {
namespace {

std::string DescribeWaitStatus(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exit code ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return absl::StrCat("signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)), ")");
  }
  return absl::StrCat("wait status ", status);
}

}  // namespace

absl::StatusOr<WorkerProcess> WorkerProcess::Spawn(const std::vector<std::string>& argv, int stdout_fd) {
  if (argv.empty()) return absl::InvalidArgumentError("empty worker command line");
  if (access(argv[0].c_str(), X_OK) != 0) {
    return absl::NotFoundError(absl::StrCat("engine binary ", argv[0], " is not executable: ",
                                            std::strerror(errno)));
  }
  // Everything the child touches is prepared before fork: after fork only async-signal-safe
  // calls are allowed in a multi-threaded parent.
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t parent = getpid();

  const pid_t pid = fork();
  if (pid < 0) return absl::ResourceExhaustedError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    // Own process group: a terminal's Ctrl-C reaches the coordinator only, which then
    // drains and stops its workers in order instead of losing them mid-step.
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);  // the parent died before prctl took effect
    // The coordinator blocks SIGTERM/SIGINT for its signal thread; the child starts clean.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    if (stdout_fd >= 0 && dup2(stdout_fd, STDOUT_FILENO) < 0) _exit(127);
    execv(args[0], args.data());
    _exit(127);
  }
  return WorkerProcess(pid);
}

std::optional<std::string> WorkerProcess::PollExit() {
  if (pid_ <= 0) return std::nullopt;
  int status = 0;
  const pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == 0) return std::nullopt;
  pid_ = -1;
  if (r < 0) return absl::StrCat("lost track of the process: ", std::strerror(errno));
  return DescribeWaitStatus(status);
}

void WorkerProcess::Kill(int signal) {
  if (pid_ <= 0) return;
  ::kill(pid_, signal);
  if (signal == SIGKILL) {
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
  }
}

std::string WorkerProcess::WaitOrKill(int timeout_ms) {
  for (int waited = 0; waited < timeout_ms; waited += 10) {
    if (std::optional<std::string> how = PollExit()) return *how;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (pid_ <= 0) return "not running";
  Kill(SIGKILL);
  return "killed after the shutdown grace period";
}

}  // namespace twinkle
