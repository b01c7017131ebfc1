#include "server/usage_meter.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <map>
#include <memory>
#include <string>

#include "core/registry/registry.h"
#include "server/metrics.h"

namespace twinkle {
namespace {

class UsageMeterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (std::filesystem::temp_directory_path() / "twinkle-usage-XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    absl::StatusOr<std::unique_ptr<registry::Registry>> r = registry::Registry::Open(dir_ + "/registry.sqlite");
    ASSERT_TRUE(r.ok()) << r.status();
    registry_ = std::move(*r);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // kind → amount for the tenant, over all time.
  std::map<std::string, int64_t> Totals(const std::string& tenant) {
    std::map<std::string, int64_t> out;
    absl::StatusOr<std::vector<registry::UsageRecord>> rows =
        registry_->ListUsage(tenant, absl::FromUnixSeconds(0), absl::FromUnixSeconds(int64_t{1} << 40));
    EXPECT_TRUE(rows.ok());
    for (const auto& r : *rows) out[r.kind] += r.amount;
    return out;
  }

  // Alice's run `run_id` on `base_model`, with one checkpoint of `bytes` bytes.
  void PutRunWithCheckpoint(const std::string& run_id, const std::string& base_model, int64_t bytes) {
    registry::RunRecord run;
    run.run_id = run_id;
    run.tenant = "alice";
    run.adapter_name = run_id;
    run.base_model = base_model;
    run.lora_config_json = "{}";
    ASSERT_TRUE(registry_->PutRun(run).ok());
    registry::CheckpointRecord c;
    c.tenant = "alice";
    c.run_id = run_id;
    c.checkpoint_id = "weights/x";
    c.kind = "training";
    c.path = "/tmp/x";
    c.size_bytes = bytes;
    ASSERT_TRUE(registry_->PutCheckpoint(c).ok());
  }

  std::string dir_;
  std::unique_ptr<registry::Registry> registry_;
};

sched::StepStats Step(sched::OpKind kind, std::vector<std::tuple<std::string, int64_t, std::string, bool>> ops) {
  sched::StepStats s;
  s.kind = kind;
  for (const auto& [tenant, tokens, name, ok] : ops) {
    s.waits.emplace_back(tenant, absl::ZeroDuration());
    s.op_tokens.push_back(tokens);
    s.op_usage.push_back({7, "run", "sess"});
    s.op_names.push_back(name);
    s.op_ok.push_back(ok);
  }
  return s;
}

TEST_F(UsageMeterTest, StepsAndSamplesAreCountedExactly) {
  UsageMeter meter(*registry_);
  const absl::Time t = absl::FromUnixSeconds(3600 * 100 + 5);
  meter.RecordStep("m", Step(sched::OpKind::kForwardBackward,
                        {{"alice", 11, "forward_backward", true}, {"alice", 5, "forward_backward", false},
                         {"alice", 1, "backward", true}, {"bob", 3, "forward_backward", true}}),
                   t);
  meter.RecordStep("m", Step(sched::OpKind::kForward, {{"alice", 4, "forward", true}}), t);
  meter.RecordStep("m", Step(sched::OpKind::kOther, {{"alice", 0, "optim_step", true}, {"alice", 0, "step", true},
                                                {"alice", 0, "zero_grad", true}, {"alice", 0, "optim_step", false}}),
                   t);
  meter.RecordSample("m", {"alice", 7, "sess", 6, 9}, t);
  ASSERT_TRUE(meter.Flush(t).ok());
  EXPECT_EQ(Totals("alice"), (std::map<std::string, int64_t>{
                                 {"training", 11}, {"forward", 4}, {"optim_steps", 2}, {"prefill", 6}, {"sampled", 9}}));
  EXPECT_EQ(Totals("bob")["training"], 3);
  // Counters are written once: a second flush adds nothing.
  ASSERT_TRUE(meter.Flush(t).ok());
  EXPECT_EQ(Totals("alice")["training"], 11);
  absl::StatusOr<std::vector<registry::UsageRecord>> rows =
      registry_->ListUsage("alice", absl::FromUnixSeconds(3600 * 100), absl::FromUnixSeconds(3600 * 101));
  ASSERT_TRUE(rows.ok());
  for (const auto& r : *rows) {
    EXPECT_EQ(r.bucket, absl::FromUnixSeconds(3600 * 100));  // the hour's start
    EXPECT_EQ(r.key_id, 7);
    EXPECT_EQ(r.base_model, "m");
  }
}

TEST_F(UsageMeterTest, EachCountNamesItsBaseModel) {
  PutRunWithCheckpoint("s1-b", "model-b", 10);
  UsageMeter meter(*registry_);
  const absl::Time t = absl::FromUnixSeconds(3600 * 400);
  ASSERT_TRUE(meter.Flush(t).ok());  // starts the storage clock
  meter.RecordSample("model-a", {"alice", 7, "sess", 6, 9}, t);
  meter.RecordSample("model-b", {"alice", 7, "sess", 1, 2}, t);
  ASSERT_TRUE(meter.Flush(t + absl::Seconds(3)).ok());
  std::map<std::pair<std::string, std::string>, int64_t> by_model;
  absl::StatusOr<std::vector<registry::UsageRecord>> rows =
      registry_->ListUsage("alice", t, t + absl::Hours(1));
  ASSERT_TRUE(rows.ok());
  for (const auto& r : *rows) by_model[{r.base_model, r.kind}] += r.amount;
  EXPECT_EQ(by_model, (std::map<std::pair<std::string, std::string>, int64_t>{
                          {{"model-a", "prefill"}, 6},
                          {{"model-a", "sampled"}, 9},
                          {{"model-b", "prefill"}, 1},
                          {{"model-b", "sampled"}, 2},
                          {{"model-b", "storage_byte_seconds"}, 30}}));  // its run's model
}

TEST_F(UsageMeterTest, StorageAccruesWholeSecondsWithTheRemainderCarried) {
  PutRunWithCheckpoint("s1-a", "m", 1000);
  UsageMeter meter(*registry_);
  const absl::Time t0 = absl::FromUnixSeconds(3600 * 200);
  ASSERT_TRUE(meter.Flush(t0).ok());  // starts the clock
  EXPECT_EQ(Totals("alice")["storage_byte_seconds"], 0);
  ASSERT_TRUE(meter.Flush(t0 + absl::Milliseconds(10500)).ok());
  EXPECT_EQ(Totals("alice")["storage_byte_seconds"], 10000);
  ASSERT_TRUE(meter.Flush(t0 + absl::Seconds(11)).ok());  // 0.5 s carried + 0.5 s = 1 s
  EXPECT_EQ(Totals("alice")["storage_byte_seconds"], 11000);
}

TEST_F(UsageMeterTest, MetricsMirrorOptimizerStepsAndStorageByTenantExactly) {
  PutRunWithCheckpoint("s1-a", "m", 1234);
  Metrics metrics(/*tenant_labels=*/true);
  UsageMeter meter(*registry_);
  meter.SetListener([&metrics](const std::string& tenant, const std::string& kind, int64_t amount) {
    metrics.RecordUsage(tenant, kind, amount);
  });
  const absl::Time t0 = absl::FromUnixSeconds(3600 * 300);
  meter.RecordStep("m", Step(sched::OpKind::kOther, {{"alice", 0, "optim_step", true}, {"alice", 0, "clip_grad_and_step", true},
                                                {"bob", 0, "step", true}, {"alice", 0, "optim_step", false},
                                                {"alice", 0, "zero_grad", true}}),
                   t0);
  meter.RecordStep("m", Step(sched::OpKind::kForwardBackward, {{"alice", 11, "forward_backward", true}}), t0);
  ASSERT_TRUE(meter.Flush(t0).ok());
  ASSERT_TRUE(meter.Flush(t0 + absl::Seconds(7)).ok());
  const std::string text = metrics.Render();
  // The same integers the billing rows hold; no key, session or run label.
  EXPECT_EQ(Totals("alice")["optim_steps"], 2);
  EXPECT_EQ(Totals("alice")["storage_byte_seconds"], 1234 * 7);
  EXPECT_THAT(text, ::testing::HasSubstr("twinkle_tenant_optimizer_steps_total{tenant=\"alice\"} 2\n"));
  EXPECT_THAT(text, ::testing::HasSubstr("twinkle_tenant_optimizer_steps_total{tenant=\"bob\"} 1\n"));
  EXPECT_THAT(text, ::testing::HasSubstr("twinkle_tenant_storage_byte_seconds_total{tenant=\"alice\"} 8638\n"));
  EXPECT_THAT(text, ::testing::Not(::testing::HasSubstr("twinkle_tenant_storage_byte_seconds_total{tenant=\"bob\"}")));
  // Tokens are twinkle_tenant_tokens_total's (from the scheduler), not counted twice here.
  EXPECT_THAT(text, ::testing::Not(::testing::HasSubstr("kind=\"training\"")));
}

}  // namespace
}  // namespace twinkle
