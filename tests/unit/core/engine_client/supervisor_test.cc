// The supervisor against the real twinkle-engine (started with --test-hooks, so it answers
// the debug methods) on the tiny model that setup makes: what happens to a hung call, a call
// queued behind a slow one, and a request or reply larger than the link carries.

#include "core/engine_client/supervisor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <signal.h>

#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "core/ipc/messages.h"

namespace twinkle {
namespace {

using ::testing::HasSubstr;

SupervisorOptions TestOptions(absl::Duration call_timeout) {
  SupervisorOptions o;
  o.engine_binary = TWINKLE_ENGINE_BINARY;
  o.devices = {"cpu"};
  o.model_dir = TWINKLE_TINY_MODEL;
  o.dtype = "float32";
  o.log_level = "warning";
  o.kv_cache_blocks = 4;
  o.backoff_initial = absl::Milliseconds(50);
  o.call_timeout = call_timeout;
  o.test_hooks = true;
  return o;
}

ipc::Message Debug(const char* method, int64_t milliseconds, int64_t frames = 0) {
  return ipc::MakeRequest(method, ipc::Pack(ipc::DebugRequest{milliseconds, frames}));
}

// Waits for the worker to be ready again after a restart (bounded: the test fails otherwise).
void AwaitReady(Supervisor& supervisor) {
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (!supervisor.AllReady() && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(20));
  ASSERT_TRUE(supervisor.AllReady());
}

TEST(SupervisorTest, CallPastItsDeadlineRestartsTheWorkerAndFailsRetryably) {
  Supervisor supervisor(TestOptions(absl::Milliseconds(500)));
  ASSERT_TRUE(supervisor.Start(nullptr).ok());
  const int64_t pid_before = supervisor.Snapshot()[0].pid;

  absl::StatusOr<ipc::Message> hung = supervisor.CallAndWait(0, Debug(ipc::kMethodDebugSleep, 600000));
  EXPECT_EQ(hung.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(hung.status().message(), HasSubstr("past its deadline"));
  EXPECT_THAT(hung.status().message(), HasSubstr("debug_sleep"));

  AwaitReady(supervisor);
  EXPECT_EQ(supervisor.Snapshot()[0].restarts, 1);
  EXPECT_NE(supervisor.Snapshot()[0].pid, pid_before);
  EXPECT_TRUE(supervisor.CallAndWait(0, Debug(ipc::kMethodDebugSleep, 0)).ok());
  supervisor.Stop(absl::Seconds(5));
}

TEST(SupervisorTest, TimeQueuedBehindAnotherCallDoesNotCountAgainstTheDeadline) {
  // Each call runs 1 s against a 1.6 s deadline; the second waits 1 s behind the first, so
  // timing it from when it was sent would take the worker down.
  Supervisor supervisor(TestOptions(absl::Milliseconds(1600)));
  ASSERT_TRUE(supervisor.Start(nullptr).ok());
  absl::Notification first_done, second_done;
  absl::Status first, second;
  supervisor.Call(0, Debug(ipc::kMethodDebugSleep, 1000), [&](absl::StatusOr<ipc::Message> r) {
    first = r.status();
    first_done.Notify();
  });
  supervisor.Call(0, Debug(ipc::kMethodDebugSleep, 1000), [&](absl::StatusOr<ipc::Message> r) {
    second = r.status();
    second_done.Notify();
  });
  first_done.WaitForNotification();
  second_done.WaitForNotification();
  EXPECT_TRUE(first.ok()) << first;
  EXPECT_TRUE(second.ok()) << second;
  EXPECT_EQ(supervisor.Snapshot()[0].restarts, 0);
  supervisor.Stop(absl::Seconds(5));
}

TEST(SupervisorTest, RequestOverTheLinkLimitFailsAloneAndIsNeverSent) {
  Supervisor supervisor(TestOptions(absl::Seconds(60)));
  ASSERT_TRUE(supervisor.Start(nullptr).ok());
  const ipc::DecodeLimits limits;
  ipc::Message request = Debug(ipc::kMethodDebugSleep, 0);
  request.buffers.resize(limits.max_frames);  // + the envelope frame = limit + 1
  absl::StatusOr<ipc::Message> r = supervisor.CallAndWait(0, std::move(request));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("too large for the engine link"));
  EXPECT_THAT(r.status().message(), HasSubstr("limit is 1048576"));

  request = Debug(ipc::kMethodDebugSleep, 0);
  request.buffers.resize(limits.max_frames - 1);  // exactly at the limit: goes through
  EXPECT_TRUE(supervisor.CallAndWait(0, std::move(request)).ok());
  EXPECT_EQ(supervisor.Snapshot()[0].restarts, 0);
  supervisor.Stop(absl::Seconds(5));
}

TEST(SupervisorTest, ReplyOverTheLinkLimitComesBackAsAnErrorAndTheWorkerStays) {
  Supervisor supervisor(TestOptions(absl::Seconds(60)));
  ASSERT_TRUE(supervisor.Start(nullptr).ok());
  const ipc::DecodeLimits limits;
  absl::StatusOr<ipc::Message> r = supervisor.CallAndWait(
      0, Debug(ipc::kMethodDebugReplyFrames, 0, static_cast<int64_t>(limits.max_frames)));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("reply to debug_reply_frames is too large"));

  absl::StatusOr<ipc::Message> at_limit = supervisor.CallAndWait(
      0, Debug(ipc::kMethodDebugReplyFrames, 0, static_cast<int64_t>(limits.max_frames) - 1));
  ASSERT_TRUE(at_limit.ok()) << at_limit.status();
  EXPECT_EQ(at_limit->buffers.size(), limits.max_frames - 1);
  EXPECT_EQ(supervisor.Snapshot()[0].restarts, 0);
  EXPECT_EQ(supervisor.Snapshot()[0].ready, true);
  supervisor.Stop(absl::Seconds(5));
}

TEST(SupervisorTest, DebugMethodsNeedTestHooks) {
  SupervisorOptions o = TestOptions(absl::Seconds(60));
  o.test_hooks = false;
  Supervisor supervisor(o);
  ASSERT_TRUE(supervisor.Start(nullptr).ok());
  absl::StatusOr<ipc::Message> r = supervisor.CallAndWait(0, Debug(ipc::kMethodDebugSleep, 0));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented);
  supervisor.Stop(absl::Seconds(5));
}

// Waits until `done` holds (bounded: the test fails otherwise).
template <typename F>
void AwaitTrue(F done) {
  const absl::Time give_up = absl::Now() + absl::Seconds(90);
  while (!done() && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(20));
  ASSERT_TRUE(done());
}

// Data parallelism (docs/device_pool.md): a CPU rank other than 0 that dies restarts alone;
// rank 0 keeps its process (and its engine generation) and is told to rejoin the group at
// the next epoch; both serve again.
SupervisorOptions DataParallelPair() {
  SupervisorOptions o = TestOptions(absl::Seconds(60));
  o.devices = {"cpu", "cpu"};
  o.data_parallel = true;
  o.collective_timeout = absl::Seconds(60);
  return o;
}

TEST(SupervisorTest, DataParallelRankRestartsAlone) {
  Supervisor supervisor(DataParallelPair());
  ASSERT_TRUE(supervisor.Start(nullptr).ok());
  const std::vector<WorkerSnapshot> before = supervisor.Snapshot();
  ASSERT_EQ(before.size(), 2u);
  const uint64_t generation0 = supervisor.engine_generation(0);
  const uint64_t generation1 = supervisor.engine_generation(1);
  uint64_t served_before = 0;
  ASSERT_TRUE(supervisor.CallAndWait(1, Debug(ipc::kMethodDebugSleep, 0), &served_before).ok());
  EXPECT_EQ(served_before, generation1);
  ASSERT_EQ(kill(static_cast<pid_t>(before[1].pid), SIGKILL), 0);
  AwaitTrue([&] { return supervisor.Snapshot()[1].restarts >= 1 && supervisor.AllReady(); });
  const std::vector<WorkerSnapshot> after = supervisor.Snapshot();
  EXPECT_EQ(after[0].pid, before[0].pid) << "rank 0 keeps its process";
  EXPECT_EQ(after[0].restarts, 0);
  EXPECT_NE(after[1].pid, before[1].pid);
  EXPECT_EQ(supervisor.engine_generation(0), generation0);
  EXPECT_NE(supervisor.engine_generation(1), generation1);
  EXPECT_TRUE(supervisor.CallAndWait(0, Debug(ipc::kMethodDebugSleep, 0)).ok());
  // A reply names the process that sent it: the restarted rank 1's generation now.
  uint64_t served = 0;
  EXPECT_TRUE(supervisor.CallAndWait(1, Debug(ipc::kMethodDebugSleep, 0), &served).ok());
  EXPECT_EQ(served, supervisor.engine_generation(1));
  EXPECT_NE(served, generation1);
  supervisor.Stop(absl::Seconds(5));
}

// Rank 0 serves the rendezvous store: its death takes the group down; both restart on a
// new rendezvous port and serve again.
TEST(SupervisorTest, DataParallelRankZeroRestartsTheGroup) {
  Supervisor supervisor(DataParallelPair());
  ASSERT_TRUE(supervisor.Start(nullptr).ok());
  const std::vector<WorkerSnapshot> before = supervisor.Snapshot();
  ASSERT_EQ(kill(static_cast<pid_t>(before[0].pid), SIGKILL), 0);
  AwaitTrue([&] {
    const std::vector<WorkerSnapshot> now = supervisor.Snapshot();
    return now[0].restarts >= 1 && now[1].restarts >= 1 && supervisor.AllReady();
  });
  const std::vector<WorkerSnapshot> after = supervisor.Snapshot();
  EXPECT_NE(after[0].pid, before[0].pid);
  EXPECT_NE(after[1].pid, before[1].pid) << "rank 1 must leave the group rank 0 served too";
  EXPECT_TRUE(supervisor.CallAndWait(0, Debug(ipc::kMethodDebugSleep, 0)).ok());
  EXPECT_TRUE(supervisor.CallAndWait(1, Debug(ipc::kMethodDebugSleep, 0)).ok());
  supervisor.Stop(absl::Seconds(5));
}

// Without data parallelism (the sampler pool, or data_parallel off) workers stay independent.
TEST(SupervisorTest, IndependentWorkersRestartAlone) {
  SupervisorOptions o = TestOptions(absl::Seconds(60));
  o.devices = {"cpu", "cpu"};
  Supervisor supervisor(o);
  ASSERT_TRUE(supervisor.Start(nullptr).ok());
  const std::vector<WorkerSnapshot> before = supervisor.Snapshot();
  ASSERT_EQ(kill(static_cast<pid_t>(before[1].pid), SIGKILL), 0);
  AwaitTrue([&] { return supervisor.Snapshot()[1].restarts == 1 && supervisor.AllReady(); });
  EXPECT_EQ(supervisor.Snapshot()[0].pid, before[0].pid);
  EXPECT_EQ(supervisor.Snapshot()[0].restarts, 0);
  supervisor.Stop(absl::Seconds(5));
}

}  // namespace
}  // namespace twinkle
