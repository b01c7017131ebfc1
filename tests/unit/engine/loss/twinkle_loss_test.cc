// Twinkle's GRPO variants (gspo, cispo, bnpo, dr_grpo) and DPO on inputs small enough to check
// by hand, and their validation errors.
#include <ATen/ATen.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/engine/loss/loss.h"
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

double Sigmoid(double x) { return 1 / (1 + std::exp(-x)); }

TEST(TwinkleLossTest, GspoUsesOneRatioPerSequence) {
  // Masked log-ratios 2 ln2 and 0 (the third token is masked out): mean ln2, so r = 2 for the
  // whole sequence. Clipped at 1.2 by default: loss -1.2 and no gradient. With epsilon_high 1.5
  // it is -r (mean of -r*A over tokens), whose gradient is -r/2 per masked token. (GRPO would
  // use token ratios 4 and 1 instead.)
  auto datums = [] {
    return std::vector<LossDatum>{
        Datum({2 * kLn2, 0, 5},
              {{"logprobs", T({0, 0, 0})}, {"advantages", T({1, 1, 1})}, {"mask", T({1, 1, 0})}})};
  };
  std::vector<LossDatum> d = datums();
  LossResult r = RunLoss(Spec("twinkle:gspo"), d);
  EXPECT_NEAR(r.metrics["loss:mean"], -1.2, 1e-12);
  ExpectValues(r.elementwise[0], {-0.6, -0.6, 0});
  ExpectValues(d[0].logprobs.grad(), {0, 0, 0});
  d = datums();
  r = RunLoss(Spec("twinkle:gspo", {{"epsilon_high", 1.5}}), d);
  EXPECT_NEAR(r.total.item<double>(), -2, 1e-12);
  ExpectValues(d[0].logprobs.grad(), {-1, -1, 0});
  d = datums();
  EXPECT_NEAR(RunLoss(Spec("twinkle:grpo", {{"epsilon_high", 1.5}}), d).total.item<double>(), -1.75,
              1e-12);
}

TEST(TwinkleLossTest, CispoIsATokenMeanOfTheClippedReinforceTerm) {
  // Datum 0: r = [2, 0.5], A = 1: -[1.2 ln2, 0.5 (-ln2)] (clipped at 1 + epsilon only).
  // Datum 1: on-policy (r = 1), A = 2, lp = -1: 2. Three tokens.
  auto datums = [] {
    return std::vector<LossDatum>{
        Datum({kLn2, -kLn2}, {{"logprobs", T({0, 0})}, {"advantages", T({1, 1})}}),
        Datum({-1}, {{"advantages", T({2})}})};
  };
  std::vector<LossDatum> d = datums();
  LossResult r = RunLoss(Spec("twinkle:cispo"), d);
  EXPECT_NEAR(r.metrics["loss:mean"], (-0.7 * kLn2 + 2) / 3, 1e-12);
  ExpectValues(r.elementwise[0], {-1.2 * kLn2 / 3, 0.5 * kLn2 / 3});
  ExpectValues(d[0].logprobs.grad(), {-0.4, -0.5 / 3});  // -sg(clip(r))*A / 3
  ExpectValues(d[1].logprobs.grad(), {-2.0 / 3});
  d = datums();
  r = RunLoss(Spec("twinkle:cispo", {{"epsilon", 2}}), d, {.window_tokens = 6});
  EXPECT_NEAR(r.total.item<double>(), (-1.5 * kLn2 + 2) / 6, 1e-12);
}

std::vector<LossDatum> OnPolicyDatums() {
  // On-policy: every ratio is 1, per-token loss -A, gradient -A (before normalisation).
  return {
      Datum({-1, -1}, {{"advantages", T({1, 1})}}),
      Datum({-1, -1, -1, -1}, {{"advantages", T({-2, -2, -2, -2})}, {"mask", T({1, 1, 1, 0})}})};
}

TEST(TwinkleLossTest, BnpoDividesByAllMaskedTokens) {
  // (-1 - 1 + 2 + 2 + 2) / 5 tokens = 0.8 (GRPO's mean of sequence means would be 0.5).
  std::vector<LossDatum> d = OnPolicyDatums();
  LossResult r = RunLoss(Spec("twinkle:bnpo"), d);
  EXPECT_NEAR(r.metrics["loss:mean"], 0.8, 1e-12);
  EXPECT_EQ(r.metrics["num_tokens:sum"], 5);
  ExpectValues(d[0].logprobs.grad(), {-0.2, -0.2});
  ExpectValues(d[1].logprobs.grad(), {0.4, 0.4, 0.4, 0});
  d = OnPolicyDatums();
  EXPECT_NEAR(RunLoss(Spec("twinkle:bnpo"), d, {.window_tokens = 10}).total.item<double>(), 0.4,
              1e-12);
  EXPECT_THAT(Error(Spec("twinkle:bnpo"), OnPolicyDatums(), {.window_tokens = 4}),
              HasSubstr("window_tokens 4 is smaller than this call's 5 tokens"));
}

TEST(TwinkleLossTest, DrGrpoDividesBySequencesTimesMaxCompletionLength) {
  std::vector<LossDatum> d = OnPolicyDatums();
  LossResult r = RunLoss(Spec("twinkle:dr_grpo", {{"max_completion_length", 4}}), d);
  EXPECT_NEAR(r.metrics["loss:mean"], 4.0 / (2 * 4), 1e-12);
  ExpectValues(d[0].logprobs.grad(), {-0.125, -0.125});
  ExpectValues(r.elementwise[1], {0.25, 0.25, 0.25, 0});
  d = OnPolicyDatums();
  EXPECT_NEAR(RunLoss(Spec("twinkle:dr_grpo"), d).total.item<double>(), 4.0 / (2 * 1024), 1e-15);
  d = OnPolicyDatums();
  r = RunLoss(Spec("twinkle:dr_grpo", {{"max_completion_length", 4}}), d, {.window_sequences = 4});
  EXPECT_NEAR(r.total.item<double>(), 4.0 / (4 * 4), 1e-12);
}

// One pair: chosen lp [-1, -2] (pi = -3) with reference [-1.5, -2.5] (rho = -4); rejected lp
// [-3] with reference [-2]. Chosen log-ratio +1, rejected -1: z = beta * 2.
std::vector<LossDatum> Pair(std::map<std::string, at::Tensor> chosen_extra = {}) {
  chosen_extra.emplace("ref_logprobs", T({-1.5, -2.5}));
  return {Datum({-1, -2}, std::move(chosen_extra)), Datum({-3}, {{"ref_logprobs", T({-2})}})};
}

LossSpec Dpo(std::map<std::string, double> config, std::string type = "sigmoid") {
  LossSpec spec = Spec("twinkle:dpo", std::move(config));
  spec.string_config["loss_type"] = std::move(type);
  return spec;
}

TEST(TwinkleLossTest, DpoSigmoid) {
  // beta 0.5: z = 1, loss = -log sigmoid(1); dloss/dz = -sigmoid(-1), times +-beta per token.
  std::vector<LossDatum> d = Pair();
  LossResult r = RunLoss(Dpo({{"beta", 0.5}}), d);
  const double loss = std::log1p(std::exp(-1.0)), g = 0.5 * Sigmoid(-1);
  EXPECT_NEAR(r.metrics["loss:mean"], loss, 1e-12);
  EXPECT_NEAR(r.metrics["reward_margin:mean"], 1, 1e-12);
  EXPECT_EQ(r.metrics["reward_accuracy:mean"], 1);
  EXPECT_EQ(r.metrics["num_sequences:sum"], 2);
  EXPECT_EQ(r.metrics["num_tokens:sum"], 3);
  ExpectValues(d[0].logprobs.grad(), {-g, -g});
  ExpectValues(d[1].logprobs.grad(), {g});
  // The pair's loss is spread evenly over its three tokens.
  ExpectValues(r.elementwise[0], {loss / 3, loss / 3});
  ExpectValues(r.elementwise[1], {loss / 3});
  // Label smoothing 0.1: 0.9 (-log sigmoid(1)) + 0.1 (-log sigmoid(-1)).
  d = Pair();
  EXPECT_NEAR(RunLoss(Dpo({{"beta", 0.5}, {"label_smoothing", 0.1}}), d).total.item<double>(),
              0.9 * loss + 0.1 * std::log1p(std::exp(1.0)), 1e-12);
  // Default beta 0.1: z = 0.2.
  d = Pair();
  EXPECT_NEAR(RunLoss(Spec("twinkle:dpo"), d).total.item<double>(), std::log1p(std::exp(-0.2)),
              1e-12);
}

TEST(TwinkleLossTest, DpoHingeIpoKtoPair) {
  // beta 0.25: z = 0.5. hinge: relu(1 - 0.5) = 0.5, dz/dlp = +-0.25.
  std::vector<LossDatum> d = Pair();
  EXPECT_NEAR(RunLoss(Dpo({{"beta", 0.25}}, "hinge"), d).total.item<double>(), 0.5, 1e-12);
  ExpectValues(d[0].logprobs.grad(), {-0.25, -0.25});
  // ipo: (0.5 - 1/(2 * 0.25))^2 = 2.25; dloss/dz = 2 (0.5 - 2) = -3.
  d = Pair();
  EXPECT_NEAR(RunLoss(Dpo({{"beta", 0.25}}, "ipo"), d).total.item<double>(), 2.25, 1e-12);
  ExpectValues(d[1].logprobs.grad(), {0.75});
  // kto_pair, beta 0.5: 1 - sigmoid(0.5 * 1) + sigmoid(0.5 * -1).
  d = Pair();
  EXPECT_NEAR(RunLoss(Dpo({{"beta", 0.5}}, "kto_pair"), d).total.item<double>(),
              1 - Sigmoid(0.5) + Sigmoid(-0.5), 1e-12);
}

TEST(TwinkleLossTest, DpoSftReferenceFreeMaskAndPairs) {
  // sft_weight 2 adds 2 * CE(chosen) = 2 * (1 + 2) / 2 = 3; chosen tokens get -2/2 more
  // gradient and 2 * -lp / 2 more elementwise.
  std::vector<LossDatum> d = Pair();
  LossResult r = RunLoss(Dpo({{"beta", 0.5}, {"sft_weight", 2}}), d);
  const double loss = std::log1p(std::exp(-1.0)), g = 0.5 * Sigmoid(-1);
  EXPECT_NEAR(r.metrics["loss:mean"], loss + 3, 1e-12);
  EXPECT_NEAR(r.metrics["sft_loss:mean"], 1.5, 1e-12);
  ExpectValues(d[0].logprobs.grad(), {-g - 1, -g - 1});
  ExpectValues(r.elementwise[0], {loss / 3 + 1, loss / 3 + 2});
  // reference_free: z = 0.5 * (-3 - -3) = 0, loss log 2 (ref_logprobs ignored, may be absent).
  std::vector<LossDatum> free = {Datum({-1, -2}), Datum({-3})};
  EXPECT_NEAR(RunLoss(Dpo({{"beta", 0.5}, {"reference_free", 1}}), free).total.item<double>(),
              std::log(2.0), 1e-12);
  // A mask drops chosen token 1 from pi and rho: log-ratio 0.5, z = 0.75; the pair's loss
  // sits on its two counted tokens.
  d = Pair({{"mask", T({1, 0})}});
  r = RunLoss(Dpo({{"beta", 0.5}}), d);
  const double masked = std::log1p(std::exp(-0.75));
  ExpectValues(r.elementwise[0], {masked / 2, 0});
  ExpectValues(d[0].logprobs.grad(), {-0.5 * Sigmoid(-0.75), 0});
  // Two pairs, the second reversed (z = -1): the mean of both losses; window of 3 pairs.
  auto pairs = [] {
    std::vector<LossDatum> both = Pair();
    std::vector<LossDatum> reversed = Pair();
    both.push_back(std::move(reversed[1]));
    both.push_back(std::move(reversed[0]));
    return both;
  };
  d = pairs();
  r = RunLoss(Dpo({{"beta", 0.5}}), d);
  EXPECT_NEAR(r.total.item<double>(), (loss + std::log1p(std::exp(1.0))) / 2, 1e-12);
  EXPECT_EQ(r.metrics["reward_accuracy:mean"], 0.5);
  d = pairs();
  r = RunLoss(Dpo({{"beta", 0.5}}), d, {.window_sequences = 6});
  EXPECT_NEAR(r.total.item<double>(), (loss + std::log1p(std::exp(1.0))) / 3, 1e-12);
}

TEST(TwinkleLossTest, Validation) {
  EXPECT_THAT(std::string(ValidateLossSpec(Spec("twinkle:gspo", {{"epsilon", -0.1}})).message()),
              HasSubstr("epsilon must be in [0, 1]"));
  EXPECT_TRUE(ValidateLossSpec(Spec("twinkle:cispo", {{"epsilon", 3}})).ok());  // upper clip only
  EXPECT_THAT(std::string(ValidateLossSpec(Spec("twinkle:cispo", {{"epsilon", -1}})).message()),
              HasSubstr("epsilon must be >= 0"));
  EXPECT_THAT(std::string(ValidateLossSpec(Spec("twinkle:bnpo", {{"beta", -1}})).message()),
              HasSubstr("beta must be >= 0"));
  EXPECT_THAT(
      std::string(
          ValidateLossSpec(Spec("twinkle:dr_grpo", {{"max_completion_length", 2.5}})).message()),
      HasSubstr("max_completion_length must be a positive integer, got 2.5"));
  EXPECT_THAT(
      std::string(ValidateLossSpec(Spec("twinkle:grpo", {{"max_completion_length", 8}})).message()),
      HasSubstr("unknown config key 'max_completion_length'"));
  EXPECT_THAT(std::string(ValidateLossSpec(Dpo({}, "kto")).message()),
              AllOf(HasSubstr("loss_type must be one of"), HasSubstr("'kto_pair'"),
                    HasSubstr("got 'kto'")));
  EXPECT_THAT(std::string(ValidateLossSpec(Dpo({{"label_smoothing", 0.1}}, "ipo")).message()),
              HasSubstr("label_smoothing > 0 needs loss_type 'sigmoid'"));
  EXPECT_THAT(std::string(ValidateLossSpec(Dpo({{"beta", 0}})).message()),
              HasSubstr("beta must be > 0"));
  EXPECT_THAT(std::string(ValidateLossSpec(Dpo({{"reference_free", 0.5}})).message()),
              HasSubstr("reference_free must be 0 or 1"));
  EXPECT_THAT(std::string(ValidateLossSpec(Dpo({{"sft_weight", -1}})).message()),
              HasSubstr("sft_weight must be >= 0"));
  EXPECT_THAT(std::string(ValidateLossSpec(Spec("twinkle:dpo", {{"loss_type", 1}})).message()),
              HasSubstr("loss_type must be a string"));

  std::vector<LossDatum> odd = Pair();
  odd.push_back(Datum({-1}, {{"ref_logprobs", T({-1})}}));
  EXPECT_THAT(Error(Spec("twinkle:dpo"), odd),
              AllOf(HasSubstr("even number of datums"), HasSubstr("got 3")));
  std::vector<LossDatum> no_ref = {Datum({-1}, {{"ref_logprobs", T({-1})}}), Datum({-1})};
  EXPECT_THAT(Error(Spec("twinkle:dpo"), no_ref),
              AllOf(HasSubstr("datum 1"), HasSubstr("missing input 'ref_logprobs'")));
  EXPECT_THAT(Error(Spec("twinkle:dpo"), Pair(), {.window_sequences = 3}),
              HasSubstr("window_sequences must be even"));
  EXPECT_THAT(Error(Spec("twinkle:dpo"), Pair({{"weights", T({1, 0.5})}})),
              HasSubstr("must be 0 or 1"));
  EXPECT_THAT(Error(Spec("twinkle:gspo"), {Datum({-1}, {{"logprobs", T({-1})}})}),
              HasSubstr("missing required input 'advantages'"));
}

}  // namespace
}  // namespace twinkle::engine
