// RunToCompletion against real child processes (/bin/sh).
#include "core/engine_client/one_shot.h"

#include <atomic>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace twinkle {
namespace {

using ::testing::HasSubstr;

TEST(RunToCompletionTest, CollectsStdoutAndTheExitStatus) {
  absl::StatusOr<OneShotResult> r = RunToCompletion({"/bin/sh", "-c", "echo '{\"path\": 1}'; exit 0"},
                                                    absl::Seconds(30), nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->exited_zero);
  EXPECT_EQ(r->stdout_text, "{\"path\": 1}\n");

  r = RunToCompletion({"/bin/sh", "-c", "echo failed; exit 3"}, absl::Seconds(30), nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->exited_zero);
  EXPECT_EQ(r->how_ended, "exit code 3");
  EXPECT_EQ(r->stdout_text, "failed\n");
}

TEST(RunToCompletionTest, KillsAChildPastItsDeadline) {
  absl::StatusOr<OneShotResult> r = RunToCompletion({"/bin/sh", "-c", "exec sleep 30"}, absl::Milliseconds(300), nullptr);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
}

TEST(RunToCompletionTest, KillsAChildWhenCancelled) {
  std::atomic<int> polls{0};
  absl::StatusOr<OneShotResult> r =
      RunToCompletion({"/bin/sh", "-c", "exec sleep 30"}, absl::Seconds(60), [&] { return ++polls > 2; });
  EXPECT_EQ(r.status().code(), absl::StatusCode::kCancelled) << r.status();
}

TEST(RunToCompletionTest, RefusesMoreStdoutThanTheLimit) {
  absl::StatusOr<OneShotResult> r =
      RunToCompletion({"/bin/sh", "-c", "head -c 5000 /dev/zero"}, absl::Seconds(30), nullptr, 4096);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  r = RunToCompletion({"/bin/sh", "-c", "head -c 4096 /dev/zero"}, absl::Seconds(30), nullptr, 4096);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->stdout_text.size(), 4096u);
}

TEST(RunToCompletionTest, AMissingBinaryIsNotFound) {
  absl::StatusOr<OneShotResult> r = RunToCompletion({"/nonexistent/twinkle-engine", "export"}, absl::Seconds(5), nullptr);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("/nonexistent/twinkle-engine"));
}

}  // namespace
}  // namespace twinkle
