// Each loss on inputs small enough to check by hand, and the validation errors.
#include "core/engine/loss/loss.h"

#include <ATen/ATen.h>

#include <cmath>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/engine/loss/loss_test_util.h"

namespace twinkle::engine {
namespace {

using loss_test::Datum;
using loss_test::Error;
using loss_test::ExpectValues;
using loss_test::kLn2;
using loss_test::RunLoss;
using loss_test::Spec;
using loss_test::T;
using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(LossTest, SupportedNames) {
  EXPECT_THAT(
      SupportedLossNames(),
      ::testing::ElementsAre("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo",
                             "stable_reinforce", "twinkle:cross_entropy", "twinkle:grpo", "twinkle:gspo",
                             "twinkle:cispo", "twinkle:bnpo", "twinkle:dr_grpo", "twinkle:dpo"));
}

TEST(LossTest, CrossEntropyAppliesArbitraryWeights) {
  // -(1*-1 + 0.5*-2 + -2*-0.5) = 1; the second datum has no weights: -(-3) = 3.
  std::vector<LossDatum> d = {Datum({-1, -2, -0.5}, {{"weights", T({1, 0.5, -2})}}), Datum({-3})};
  LossResult r = RunLoss(Spec("cross_entropy"), d);
  EXPECT_NEAR(r.total.item<double>(), 4.0, 1e-12);
  EXPECT_NEAR(r.metrics["loss:sum"], 4.0, 1e-12);
  EXPECT_EQ(r.metrics["num_tokens:sum"], 4);
  ExpectValues(r.elementwise[0], {1, 1, -1});
  ExpectValues(d[0].logprobs.grad(), {-1, -0.5, 2});
  ExpectValues(d[1].logprobs.grad(), {-1});
}

TEST(LossTest, ImportanceSampling) {
  // r = [2, 0.5], A = [1, -4]: -(2 - 2) = 0 in total; gradient -r*A.
  std::vector<LossDatum> d = {
      Datum({kLn2, -kLn2}, {{"logprobs", T({0, 0})}, {"advantages", T({1, -4})}})};
  LossResult r = RunLoss(Spec("importance_sampling"), d);
  ExpectValues(r.elementwise[0], {-2, 2});
  EXPECT_NEAR(r.total.item<double>(), 0.0, 1e-12);
  ExpectValues(d[0].logprobs.grad(), {-2, 2});
}

TEST(LossTest, PpoClipsOnlyWhereTheClippedTermIsSmaller) {
  // r = 2, 0.5, 2, 0.5 with A = 1, 1, -1, -1 and the default [0.8, 1.2]:
  // min(2, 1.2) = 1.2 (clipped), min(.5, .8) = .5, min(-2, -1.2) = -2, min(-.5, -.8) = -.8
  // (clipped). Clipped tokens carry no gradient.
  std::vector<LossDatum> d = {
      Datum({kLn2, -kLn2, kLn2, -kLn2},
            {{"logprobs", T({0, 0, 0, 0})}, {"advantages", T({1, 1, -1, -1})}})};
  LossResult r = RunLoss(Spec("ppo"), d);
  ExpectValues(r.elementwise[0], {-1.2, -0.5, 2, 0.8});
  EXPECT_NEAR(r.metrics["loss:sum"], 1.1, 1e-12);
  ExpectValues(d[0].logprobs.grad(), {0, -0.5, 2, 0});
}

TEST(LossTest, PpoPerTokenThresholdsOverrideConfig) {
  // Token 0 gets its own high threshold 3 (unclipped: -2); token 1 uses config hi = 1.5.
  std::vector<LossDatum> d = {Datum(
      {kLn2, kLn2},
      {{"logprobs", T({0, 0})}, {"advantages", T({1, 1})}, {"clip_high_threshold", T({3, 1.5})}})};
  LossResult r = RunLoss(Spec("ppo", {{"clip_high_threshold", 1.5}}), d);
  ExpectValues(r.elementwise[0], {-2, -1.5});
}

TEST(LossTest, CispoStopsGradientThroughTheClippedRatio) {
  // r = [2, 0.5], A = 1: -(2*ln2 + 0.5*(-ln2)); gradient is -clip(r)*A only.
  std::vector<LossDatum> d = {
      Datum({kLn2, -kLn2}, {{"logprobs", T({0, 0})}, {"advantages", T({1, 1})}})};
  LossResult r = RunLoss(Spec("cispo"), d);
  EXPECT_NEAR(r.total.item<double>(), -1.5 * kLn2, 1e-12);
  ExpectValues(d[0].logprobs.grad(), {-2, -0.5});

  std::vector<LossDatum> d2 = {Datum({kLn2}, {{"logprobs", T({0})}, {"advantages", T({1})}})};
  LossResult r2 = RunLoss(Spec("cispo", {{"clip_high_threshold", 1.5}}), d2);
  EXPECT_NEAR(r2.total.item<double>(), -1.5 * kLn2, 1e-12);
  ExpectValues(d2[0].logprobs.grad(), {-1.5});
}

TEST(LossTest, DroWithWeights) {
  // -(lp*A - 0.5*beta*(lp-q)^2) = -(-1*2 - 0.025*1) = 2.025; weight 0 drops token 1.
  std::vector<LossDatum> d = {Datum(
      {-1, -5}, {{"logprobs", T({-2, -1})}, {"advantages", T({2, 3})}, {"weights", T({1, 0})}})};
  LossResult r = RunLoss(Spec("dro"), d);
  ExpectValues(r.elementwise[0], {2.025, 0});
  ExpectValues(d[0].logprobs.grad(), {-(2 - 0.05), 0});
  EXPECT_EQ(r.metrics["num_tokens:sum"], 1);
}

TEST(LossTest, TwinkleCrossEntropyMeanAndSum) {
  auto datums = [] {
    return std::vector<LossDatum>{Datum({-1, -2}, {{"mask", T({1, 0})}}), Datum({-3})};
  };
  std::vector<LossDatum> d = datums();
  LossResult mean = RunLoss(Spec("twinkle:cross_entropy"), d);  // (1 + 3) / 2 tokens
  EXPECT_NEAR(mean.metrics["loss:mean"], 2.0, 1e-12);
  ExpectValues(d[0].logprobs.grad(), {-0.5, 0});

  std::vector<LossDatum> w = datums();
  LossResult window = RunLoss(Spec("twinkle:cross_entropy"), w, {.window_tokens = 8});
  EXPECT_NEAR(window.total.item<double>(), 0.5, 1e-12);
  ExpectValues(window.elementwise[1], {3.0 / 8});

  std::vector<LossDatum> s = datums();
  LossSpec sum = Spec("twinkle:cross_entropy");
  sum.string_config["reduction"] = "sum";
  LossResult r = RunLoss(sum, s);
  EXPECT_NEAR(r.metrics["loss:sum"], 4.0, 1e-12);
  EXPECT_EQ(r.metrics["num_tokens:sum"], 2);
}

TEST(LossTest, TwinkleGrpoIsAMeanOfSequenceMeans) {
  // No old log-probs: ratio 1. Sequence 0: -A = -1 per token; sequence 1: 2 on its two
  // unmasked tokens. Mean of (-1, 2) = 0.5.
  std::vector<LossDatum> d = {
      Datum({-1, -1}, {{"advantages", T({1, 1})}}),
      Datum({-1, -1, -1}, {{"advantages", T({-2, -2, -2})}, {"mask", T({1, 1, 0})}})};
  LossResult r = RunLoss(Spec("twinkle:grpo"), d);
  EXPECT_NEAR(r.metrics["loss:mean"], 0.5, 1e-12);
  ExpectValues(d[0].logprobs.grad(), {-0.25, -0.25});
  ExpectValues(d[1].logprobs.grad(), {0.5, 0.5, 0});

  std::vector<LossDatum> w = {Datum({-1, -1}, {{"advantages", T({1, 1})}})};
  LossResult window = RunLoss(Spec("twinkle:grpo"), w, {.window_sequences = 4});
  EXPECT_NEAR(window.total.item<double>(), -0.25, 1e-12);
}

TEST(LossTest, TwinkleGrpoClipAndKl) {
  // r = 2, A = 1: epsilon 0.2 clips to 1.2; epsilon_high 1.5 lets 2 through.
  auto datum = [](std::map<std::string, at::Tensor> extra = {}) {
    extra.emplace("logprobs", T({0}));
    extra.emplace("advantages", T({1}));
    return std::vector<LossDatum>{Datum({kLn2}, std::move(extra))};
  };
  std::vector<LossDatum> d = datum();
  EXPECT_NEAR(RunLoss(Spec("twinkle:grpo"), d).total.item<double>(), -1.2, 1e-12);
  d = datum();
  EXPECT_NEAR(RunLoss(Spec("twinkle:grpo", {{"epsilon_high", 1.5}}), d).total.item<double>(), -2,
              1e-12);
  // k3 with ref - lp = ln 2: exp(ln2) - ln2 - 1 = 1 - ln2, times beta 0.1.
  d = datum({{"ref_logprobs", T({2 * kLn2})}});
  EXPECT_NEAR(RunLoss(Spec("twinkle:grpo", {{"beta", 0.1}}), d).total.item<double>(),
              -1.2 + 0.1 * (1 - kLn2), 1e-12);
}

TEST(LossTest, ComputesInTheDtypeOfLogprobs) {
  std::vector<LossDatum> f32 = {{T({-1, -2}, at::kFloat), {{"weights", T({1, 1})}}}};
  absl::StatusOr<LossResult> r = ComputeLoss(Spec("cross_entropy"), f32);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->total.scalar_type(), at::kFloat);
  EXPECT_EQ(r->elementwise[0].scalar_type(), at::kFloat);
  std::vector<LossDatum> bf16 = {{T({-1, -2}, at::kBFloat16), {}}};
  r = ComputeLoss(Spec("cross_entropy"), bf16);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->total.scalar_type(), at::kFloat);  // half precision is promoted
}

TEST(LossTest, SpecValidation) {
  EXPECT_THAT(std::string(ValidateLossSpec(Spec("ppo2")).message()),
              AllOf(HasSubstr("unknown loss 'ppo2'"), HasSubstr("'cross_entropy'"),
                    HasSubstr("'twinkle:grpo'")));
  EXPECT_THAT(std::string(ValidateLossSpec(Spec("ppo", {{"clip_low", 0.9}})).message()),
              AllOf(HasSubstr("unknown config key 'clip_low'"),
                    HasSubstr("'clip_low_threshold', 'clip_high_threshold'")));
  EXPECT_THAT(std::string(ValidateLossSpec(Spec("cross_entropy", {{"beta", 1}})).message()),
              HasSubstr("(accepted: none)"));
  EXPECT_THAT(std::string(ValidateLossSpec(Spec("dro", {{"beta", -1}})).message()),
              HasSubstr("beta must be >= 0"));
  EXPECT_THAT(std::string(ValidateLossSpec(Spec("ppo", {{"clip_low_threshold", 1.3}})).message()),
              HasSubstr("clip_low_threshold <= clip_high_threshold"));
  EXPECT_THAT(std::string(ValidateLossSpec(Spec("twinkle:grpo", {{"epsilon", 1.5}})).message()),
              HasSubstr("epsilon must be in [0, 1]"));
  EXPECT_THAT(std::string(ValidateLossSpec(Spec("dro", {{"beta", NAN}})).message()),
              HasSubstr("must be finite"));
  LossSpec reduction = Spec("twinkle:cross_entropy");
  reduction.string_config["reduction"] = "avg";
  EXPECT_THAT(std::string(ValidateLossSpec(reduction).message()), HasSubstr("'avg'"));
  EXPECT_TRUE(ValidateLossSpec(Spec("twinkle:grpo", {{"epsilon", 0.1}, {"beta", 0.04}})).ok());
}

TEST(LossTest, InputValidation) {
  std::vector<LossDatum> missing = {Datum({-1}, {{"logprobs", T({-1})}, {"advantages", T({1})}}),
                                    Datum({-1}, {{"logprobs", T({-1})}})};
  EXPECT_THAT(Error(Spec("ppo"), missing),
              AllOf(HasSubstr("datum 1"), HasSubstr("missing required input 'advantages'")));
  std::vector<LossDatum> shape = {Datum({-1, -2}, {{"weights", T({1})}})};
  EXPECT_THAT(Error(Spec("cross_entropy"), shape),
              AllOf(HasSubstr("datum 0"), HasSubstr("'weights' has shape [1], expected [2]")));
  std::vector<LossDatum> inf = {Datum({-1}, {{"weights", T({INFINITY})}})};
  EXPECT_THAT(Error(Spec("cross_entropy"), inf), HasSubstr("'weights' has non-finite values"));
  std::vector<LossDatum> nan_lp = {Datum({NAN})};
  EXPECT_THAT(Error(Spec("cross_entropy"), nan_lp), HasSubstr("logprobs are not all finite"));
  std::vector<LossDatum> unknown = {Datum({-1}, {{"advantage", T({1})}})};
  EXPECT_THAT(Error(Spec("cross_entropy"), unknown),
              AllOf(HasSubstr("unknown input 'advantage'"), HasSubstr("'weights'")));
  std::vector<LossDatum> mask = {Datum({-1}, {{"mask", T({0.5})}})};
  EXPECT_THAT(Error(Spec("twinkle:cross_entropy"), mask), HasSubstr("must be 0 or 1"));
  std::vector<LossDatum> clip = {
      Datum({-1}, {{"logprobs", T({-1})}, {"advantages", T({1})}, {"clip_low_threshold", T({2})}})};
  EXPECT_THAT(Error(Spec("ppo"), clip), HasSubstr("0 <= low <= high"));
  EXPECT_THAT(Error(Spec("cross_entropy"), {}), HasSubstr("at least one datum"));
  std::vector<LossDatum> two = {Datum({-1, -1})};
  EXPECT_THAT(Error(Spec("twinkle:cross_entropy"), two, {.window_tokens = 1}),
              HasSubstr("window_tokens 1 is smaller"));
}

}  // namespace
}  // namespace twinkle::engine
