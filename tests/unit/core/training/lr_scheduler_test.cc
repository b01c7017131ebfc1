#include "core/training/lr_scheduler.h"

#include <cmath>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace twinkle::training {
namespace {

using ::testing::HasSubstr;

absl::StatusOr<std::unique_ptr<LrScheduler>> Make(const std::string& name,
                                                  std::map<std::string, double> config = {}) {
  return LrScheduler::Create({name, std::move(config)});
}

TEST(LrSchedulerTest, UnknownNameListsAccepted) {
  auto s = Make("step");
  ASSERT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().ToString(), HasSubstr("unknown lr scheduler 'step'"));
  EXPECT_THAT(s.status().ToString(), HasSubstr("constant, linear (LinearLR), cosine"));
  EXPECT_THAT(s.status().ToString(), HasSubstr("linear_warmup (LinearWarmupScheduler)"));
}

TEST(LrSchedulerTest, UnknownKeyListsAccepted) {
  auto s = Make("cosine", {{"T_max", 10}, {"tmax", 3}});
  ASSERT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().ToString(), HasSubstr("unknown config key 'tmax'"));
  EXPECT_THAT(s.status().ToString(), HasSubstr("accepted: T_max, eta_min"));
  EXPECT_THAT(Make("constant", {{"x", 1}}).status().ToString(), HasSubstr("accepted: none"));
}

TEST(LrSchedulerTest, MissingRequiredKey) {
  auto s = Make("cosine_warmup", {{"num_warmup_steps", 2}});
  ASSERT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().ToString(), HasSubstr("num_training_steps is required"));
  EXPECT_THAT(Make("cosine").status().ToString(), HasSubstr("T_max is required"));
}

TEST(LrSchedulerTest, OutOfRangeValuesNameTheKey) {
  EXPECT_THAT(Make("linear", {{"start_factor", 0}}).status().ToString(),
              HasSubstr("start_factor must be > 0 and <= 1, got 0"));
  EXPECT_THAT(Make("linear", {{"end_factor", 1.5}}).status().ToString(), HasSubstr("end_factor"));
  EXPECT_THAT(Make("linear", {{"total_iters", 2.5}}).status().ToString(),
              HasSubstr("total_iters must be a whole number >= 1, got 2.5"));
  EXPECT_THAT(Make("cosine", {{"T_max", 0}}).status().ToString(), HasSubstr("T_max"));
  EXPECT_THAT(Make("cosine", {{"T_max", 5}, {"eta_min", NAN}}).status().ToString(),
              HasSubstr("eta_min"));
  EXPECT_THAT(Make("linear_warmup", {{"num_warmup_steps", -1}, {"num_training_steps", 5}})
                  .status()
                  .ToString(),
              HasSubstr("num_warmup_steps must be a whole number >= 0, got -1"));
}

TEST(LrSchedulerTest, NamesAreCaseInsensitiveWithTwinkleAliases) {
  auto a = Make("CosineWarmupScheduler", {{"num_warmup_steps", 1}, {"num_training_steps", 4}});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->kind(), LrScheduler::Kind::kCosineWarmup);
  auto b = Make("LINEARLR");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->kind(), LrScheduler::Kind::kLinear);
  auto c = Make("Constant");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->LearningRate(0.25, 17), 0.25);
}

TEST(LrSchedulerTest, LinearDefaultsMatchTorch) {
  auto s = Make("linear");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_DOUBLE_EQ((*s)->LearningRate(0.3, 0), 0.1);  // start_factor 1/3
  EXPECT_DOUBLE_EQ((*s)->LearningRate(0.3, 5), 0.3);  // total_iters 5
  EXPECT_DOUBLE_EQ((*s)->LearningRate(0.3, 50), 0.3);
  EXPECT_NEAR((*s)->LearningRate(0.3, 1), 0.3 * (1.0 / 3 + (2.0 / 3) / 5), 1e-15);
}

TEST(LrSchedulerTest, CosineReachesEtaMinAtTMaxAndRisesAfter) {
  auto s = Make("cosine", {{"T_max", 10}, {"eta_min", 0.01}});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_DOUBLE_EQ((*s)->LearningRate(1.0, 0), 1.0);
  EXPECT_NEAR((*s)->LearningRate(1.0, 5), 0.505, 1e-12);
  EXPECT_NEAR((*s)->LearningRate(1.0, 10), 0.01, 1e-12);
  EXPECT_NEAR((*s)->LearningRate(1.0, 15), 0.505, 1e-12);
}

TEST(LrSchedulerTest, WarmupSchedules) {
  auto cos = Make("cosine_warmup", {{"num_warmup_steps", 4}, {"num_training_steps", 12}});
  ASSERT_TRUE(cos.ok()) << cos.status();
  EXPECT_EQ((*cos)->LearningRate(2.0, 0), 0.0);
  EXPECT_DOUBLE_EQ((*cos)->LearningRate(2.0, 1), 0.5);
  EXPECT_DOUBLE_EQ((*cos)->LearningRate(2.0, 4), 2.0);
  EXPECT_NEAR((*cos)->LearningRate(2.0, 8), 1.0, 1e-12);  // half way through the decay
  EXPECT_NEAR((*cos)->LearningRate(2.0, 12), 0.0, 1e-12);
  auto lin = Make("linear_warmup", {{"num_warmup_steps", 2}, {"num_training_steps", 6}});
  ASSERT_TRUE(lin.ok()) << lin.status();
  EXPECT_DOUBLE_EQ((*lin)->LearningRate(1.0, 1), 0.5);
  EXPECT_DOUBLE_EQ((*lin)->LearningRate(1.0, 2), 1.0);
  EXPECT_DOUBLE_EQ((*lin)->LearningRate(1.0, 4), 0.5);
  EXPECT_EQ((*lin)->LearningRate(1.0, 9), 0.0);  // clamped at zero past the end
}

}  // namespace
}  // namespace twinkle::training
