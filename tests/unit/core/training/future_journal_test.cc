#include "core/training/future_journal.h"

#include <filesystem>
#include <memory>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/registry/registry.h"

namespace twinkle::training {
namespace {

using ::testing::HasSubstr;

// A registry file of its own per test, opened again for each "boot" as a restarted server does.
class FutureJournalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::unique_ptr<registry::Registry> OpenRegistry() {
    absl::StatusOr<std::unique_ptr<registry::Registry>> r = registry::Registry::Open((dir_ / "r.sqlite").string());
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *std::move(r) : nullptr;
  }

  std::filesystem::path dir_;
};

TEST_F(FutureJournalTest, ResultsOutliveARestartAndUnfinishedOnesReportTheRestart) {
  uint64_t training_id = 0, sampling_id = 0, in_flight_id = 0, failed_id = 0;
  {
    std::unique_ptr<registry::Registry> registry = OpenRegistry();
    absl::StatusOr<std::unique_ptr<RegistryFutureJournal>> journal = RegistryFutureJournal::Open(*registry);
    ASSERT_TRUE(journal.ok()) << journal.status();
    training_id = (*journal)->first_id();
    sampling_id = training_id + 1;
    in_flight_id = training_id + 2;
    failed_id = training_id + 3;
    for (uint64_t id : {training_id, sampling_id, in_flight_id, failed_id}) (*journal)->Created(id, "alice");
    OpOutput out;
    out.loss = 2.5;
    out.metrics["loss:sum"] = 7.0;
    (*journal)->Completed(training_id, "alice", FutureResult(out));
    // A result the journal has no JSON form for (a sampling output, say).
    (*journal)->Completed(sampling_id, "alice", FutureResult(sampling::SampleOutput{}));
    (*journal)->Completed(failed_id, "alice", FutureResult(absl::InvalidArgumentError("bad token")));
    (*journal)->Flush();
  }
  std::unique_ptr<registry::Registry> registry = OpenRegistry();
  absl::StatusOr<std::unique_ptr<RegistryFutureJournal>> journal = RegistryFutureJournal::Open(*registry);
  ASSERT_TRUE(journal.ok()) << journal.status();
  EXPECT_GT((*journal)->first_id(), failed_id);

  absl::StatusOr<FutureResult> training = (*journal)->Lookup(training_id, "alice");
  ASSERT_TRUE(training.ok() && training->ok()) << training.status();
  const OpOutput* out = std::get_if<OpOutput>(&**training);
  ASSERT_NE(out, nullptr);
  EXPECT_EQ(out->loss, 2.5);
  EXPECT_EQ(out->metrics.at("loss:sum"), 7.0);

  // Finished, but its result lived in memory only: a clear NOT_FOUND, not an empty result.
  absl::StatusOr<FutureResult> sampling = (*journal)->Lookup(sampling_id, "alice");
  ASSERT_TRUE(sampling.ok()) << sampling.status();
  EXPECT_EQ(sampling->status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(sampling->status().message(), HasSubstr("kept in memory only"));

  absl::StatusOr<FutureResult> in_flight = (*journal)->Lookup(in_flight_id, "alice");
  ASSERT_TRUE(in_flight.ok()) << in_flight.status();
  EXPECT_EQ(in_flight->status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(in_flight->status().message(), HasSubstr("interrupted by a restart"));
  EXPECT_TRUE(IsInterruptedByRestart(in_flight->status()));

  absl::StatusOr<FutureResult> failed = (*journal)->Lookup(failed_id, "alice");
  ASSERT_TRUE(failed.ok()) << failed.status();
  EXPECT_EQ(failed->status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(failed->status().message(), "bad token");

  // Another tenant learns nothing about alice's futures.
  absl::StatusOr<FutureResult> other = (*journal)->Lookup(training_id, "bob");
  EXPECT_FALSE(other.ok() && other->ok());
}

// A Tinker request id's future holds the encoded answer (JSON and protobuf bytes, which may
// hold any byte); a dropped one reads as the drop's error; a released one is forgotten; one
// that failed only because the server was stopping reads as interrupted after the restart.
TEST_F(FutureJournalTest, EncodedAnswersDropsAndShutdownFailuresOutliveARestart) {
  uint64_t encoded_id = 0, dropped_id = 0, released_id = 0, stopping_id = 0, stopped_ok_id = 0;
  const std::string proto("\0\x01\xff tensor bytes", 17);
  {
    std::unique_ptr<registry::Registry> registry = OpenRegistry();
    absl::StatusOr<std::unique_ptr<RegistryFutureJournal>> journal = RegistryFutureJournal::Open(*registry);
    ASSERT_TRUE(journal.ok()) << journal.status();
    encoded_id = (*journal)->first_id();
    dropped_id = encoded_id + 1;
    released_id = encoded_id + 2;
    stopping_id = encoded_id + 3;
    stopped_ok_id = encoded_id + 4;
    for (uint64_t id : {encoded_id, dropped_id, released_id, stopping_id, stopped_ok_id}) {
      (*journal)->Created(id, "alice");
    }
    (*journal)->Completed(encoded_id, "alice", FutureResult(EncodedResult{R"({"loss":1.5})", proto}));
    (*journal)->Completed(dropped_id, "alice", FutureResult(EncodedResult{"{}", ""}));
    (*journal)->Dropped(dropped_id, "alice", absl::FailedPreconditionError("dropped over sessions.max_retained_results"));
    (*journal)->Completed(released_id, "alice", FutureResult(OpOutput{}));
    (*journal)->Dropped(released_id, "alice", absl::OkStatus());
    (*journal)->BeginShutdown();
    (*journal)->Completed(stopping_id, "alice", FutureResult(absl::UnavailableError("server is shutting down")));
    OpOutput finished;
    finished.loss = 4.0;
    (*journal)->Completed(stopped_ok_id, "alice", FutureResult(finished));
    (*journal)->Flush();
  }
  std::unique_ptr<registry::Registry> registry = OpenRegistry();
  absl::StatusOr<std::unique_ptr<RegistryFutureJournal>> journal = RegistryFutureJournal::Open(*registry);
  ASSERT_TRUE(journal.ok()) << journal.status();

  absl::StatusOr<FutureResult> encoded = (*journal)->Lookup(encoded_id, "alice");
  ASSERT_TRUE(encoded.ok() && encoded->ok()) << encoded.status();
  const EncodedResult* answer = std::get_if<EncodedResult>(&**encoded);
  ASSERT_NE(answer, nullptr);
  EXPECT_EQ(answer->json, R"({"loss":1.5})");
  EXPECT_EQ(answer->proto, proto);

  absl::StatusOr<FutureResult> dropped = (*journal)->Lookup(dropped_id, "alice");
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  EXPECT_EQ(dropped->status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(dropped->status().message(), HasSubstr("sessions.max_retained_results"));

  // Released: its row is gone; an id of an earlier boot without a row reads as interrupted
  // (the journal cannot tell it from one whose pending row was never written).
  absl::StatusOr<FutureResult> released = (*journal)->Lookup(released_id, "alice");
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_TRUE(IsInterruptedByRestart(released->status())) << released->status();

  absl::StatusOr<FutureResult> stopping = (*journal)->Lookup(stopping_id, "alice");
  ASSERT_TRUE(stopping.ok()) << stopping.status();
  EXPECT_TRUE(IsInterruptedByRestart(stopping->status())) << stopping->status();

  absl::StatusOr<FutureResult> stopped_ok = (*journal)->Lookup(stopped_ok_id, "alice");
  ASSERT_TRUE(stopped_ok.ok() && stopped_ok->ok()) << stopped_ok.status();
  EXPECT_EQ(std::get<OpOutput>(**stopped_ok).loss, 4.0);
}

// A drop the writer has not stored yet is already what Lookup answers (the store has
// forgotten the result, so the registry's older row must not answer for it).
TEST_F(FutureJournalTest, LookupSeesWritesNotYetInTheRegistry) {
  std::unique_ptr<registry::Registry> registry = OpenRegistry();
  absl::StatusOr<std::unique_ptr<RegistryFutureJournal>> journal = RegistryFutureJournal::Open(*registry);
  ASSERT_TRUE(journal.ok()) << journal.status();
  const uint64_t id = (*journal)->first_id();
  for (int round = 0; round < 50; ++round) {
    const uint64_t r = id + static_cast<uint64_t>(round);
    (*journal)->Created(r, "alice");
    (*journal)->Completed(r, "alice", FutureResult(EncodedResult{"{}", ""}));
    (*journal)->Flush();  // the result is in the registry
    (*journal)->Dropped(r, "alice", absl::FailedPreconditionError("dropped over sessions.max_retained_results"));
    absl::StatusOr<FutureResult> got = (*journal)->Lookup(r, "alice");  // written or not yet
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->status().code(), absl::StatusCode::kFailedPrecondition) << round;
  }
}

}  // namespace
}  // namespace twinkle::training
