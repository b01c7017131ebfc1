#include "core/engine/optim/optimizer.h"

#include <ATen/ATen.h>

#include <cmath>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace twinkle::engine {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

at::Tensor Param(std::vector<float> values) {
  return at::tensor(values, at::TensorOptions().dtype(at::kFloat)).requires_grad_(true);
}

void SetGrad(at::Tensor& p, std::vector<float> values) {
  p.mutable_grad() = at::tensor(values, at::TensorOptions().dtype(at::kFloat));
}

std::unique_ptr<Optimizer> Make(const std::string& kind, std::vector<at::Tensor> params) {
  auto opt = Optimizer::Create(kind, std::move(params));
  EXPECT_TRUE(opt.ok()) << opt.status();
  return opt.ok() ? *std::move(opt) : nullptr;
}

std::vector<std::string> Names(const Optimizer& opt) {
  std::vector<std::string> names;
  for (const auto& [name, t] : opt.StateTensors()) names.push_back(name);
  return names;
}

TEST(OptimizerTest, CreateRejectsUnknownKindEmptyAndNonFloatParams) {
  auto bad = Optimizer::Create("lion", {Param({1})});
  ASSERT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().ToString(),
              HasSubstr("unknown optimizer 'lion' (accepted: adamw, adam, sgd)"));
  EXPECT_THAT(Optimizer::Create("adamw", {}).status().ToString(),
              HasSubstr("empty parameter list"));
  EXPECT_THAT(Optimizer::Create("sgd", {Param({1}), at::ones({2}, at::kLong)}).status().ToString(),
              HasSubstr("param 1 must be a defined floating-point tensor"));
}

TEST(OptimizerTest, KindIsCaseInsensitive) {
  EXPECT_EQ(Make("AdamW", {Param({1})})->kind(), Optimizer::Kind::kAdamW);
  EXPECT_EQ(Make("Adam", {Param({1})})->kind(), Optimizer::Kind::kAdam);
  EXPECT_EQ(Make("SGD", {Param({1})})->kind(), Optimizer::Kind::kSgd);
}

TEST(OptimizerTest, InvalidHyperparametersNameTheFieldAndChangeNothing) {
  at::Tensor p = Param({1, 2});
  SetGrad(p, {0.5, 0.5});
  auto adam = Make("adamw", {p});
  struct Case {
    OptimizerHyper hyper;
    const char* message;
  };
  std::vector<Case> cases(7);
  cases[0].hyper.learning_rate = -1e-3, cases[0].message = "learning_rate must be finite and >= 0";
  cases[1].hyper.beta1 = 1.0, cases[1].message = "beta1 must be finite and in [0, 1), got 1";
  cases[2].hyper.beta2 = -0.1, cases[2].message = "beta2 must be finite and in [0, 1)";
  cases[3].hyper.eps = 0, cases[3].message = "eps must be finite and > 0, got 0";
  cases[4].hyper.weight_decay = NAN, cases[4].message = "weight_decay must be finite";
  cases[5].hyper.grad_clip_norm = -1, cases[5].message = "grad_clip_norm must be finite and >= 0";
  cases[6].hyper.learning_rate = INFINITY, cases[6].message = "learning_rate must be finite";
  for (const Case& c : cases) {
    absl::StatusOr<StepResult> r = adam->Step(c.hyper);
    ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(std::string(r.status().ToString()), HasSubstr(c.message));
  }
  EXPECT_EQ(adam->step(), 0);
  EXPECT_TRUE(at::equal(p, at::tensor({1.0f, 2.0f})));

  at::Tensor q = Param({1});
  auto sgd = Make("sgd", {q});
  OptimizerHyper h;
  h.momentum = -0.5;
  EXPECT_THAT(sgd->Step(h).status().ToString(), HasSubstr("momentum must be finite and >= 0"));
  h.momentum = 0;
  h.nesterov = true;
  EXPECT_THAT(sgd->Step(h).status().ToString(),
              HasSubstr("nesterov requires momentum > 0 and dampening == 0"));
  h.beta1 = 5;  // Adam-only fields do not matter for SGD
  h.nesterov = false;
  EXPECT_TRUE(sgd->Step(h).ok());
}

TEST(OptimizerTest, MismatchedGradientIsRejected) {
  at::Tensor p = Param({1, 2});
  auto opt = Make("adamw", {p});
  SetGrad(p, {1, 2, 3});
  absl::StatusOr<StepResult> r = opt->Step({});
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().ToString()),
              HasSubstr("gradient of optimizer param 0 is float32[3]"));
  EXPECT_EQ(opt->step(), 0);
}

TEST(OptimizerTest, NonFiniteGradientNormChangesNothing) {
  at::Tensor p = Param({1, 2});
  at::Tensor q = Param({3});
  auto opt = Make("adamw", {p, q});
  SetGrad(p, {0.1f, 0.2f});
  ASSERT_TRUE(opt->Step({}).ok());
  const at::Tensor p_before = p.detach().clone();
  const at::Tensor m_before = opt->StateTensors()[1].second.clone();
  SetGrad(p, {0.1f, NAN});
  SetGrad(q, {1});
  OptimizerHyper h;
  h.weight_decay = 0.1;
  absl::StatusOr<StepResult> r = opt->Step(h);
  ASSERT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(r.status().ToString()),
              HasSubstr("gradient norm is nan; step 2 not applied"));
  EXPECT_EQ(opt->step(), 1);
  EXPECT_TRUE(at::equal(p, p_before));
  EXPECT_TRUE(at::equal(opt->StateTensors()[1].second, m_before));
  EXPECT_TRUE(p.grad().defined());  // the caller decides what to do with them

  SetGrad(p, {INFINITY, 0});
  EXPECT_EQ(opt->Step(h).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(OptimizerTest, AdamWFirstStepByHand) {
  // Step 1: bias-corrected m̂ = g and √v̂ = |g|, so p ← p·(1 − lr·wd) − lr·g/(|g| + eps).
  at::Tensor p = Param({1.0f, -2.0f});
  auto opt = Make("adamw", {p});
  SetGrad(p, {0.5f, -4.0f});
  OptimizerHyper h;
  h.learning_rate = 0.1;
  h.weight_decay = 0.5;
  absl::StatusOr<StepResult> r = opt->Step(h);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->step, 1);
  EXPECT_DOUBLE_EQ(r->learning_rate, 0.1);
  EXPECT_NEAR(r->grad_norm, std::sqrt(0.25 + 16.0), 1e-6);
  EXPECT_NEAR(p[0].item<double>(), 1.0 * 0.95 - 0.1, 1e-6);
  EXPECT_NEAR(p[1].item<double>(), -2.0 * 0.95 + 0.1, 1e-6);
  EXPECT_TRUE(p.grad().defined());  // Step does not zero gradients
  opt->ZeroGrad();
  EXPECT_FALSE(p.grad().defined());
}

TEST(OptimizerTest, StepWithoutGradientsStillDecays) {
  at::Tensor p = Param({2.0f});
  auto opt = Make("adamw", {p});
  OptimizerHyper h;
  h.learning_rate = 0.1;
  h.weight_decay = 0.5;
  absl::StatusOr<StepResult> r = opt->Step(h);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->grad_norm, 0.0);
  EXPECT_EQ(opt->step(), 1);
  EXPECT_FLOAT_EQ(p.item<float>(), 2.0f * 0.95f);  // zero moments: only the decay moves it
}

TEST(OptimizerTest, ClippingReportsPreClipNormAndLeavesGradients) {
  at::Tensor p = Param({0, 0});
  auto opt = Make("sgd", {p});
  SetGrad(p, {3, 4});
  OptimizerHyper h;
  h.learning_rate = 1.0;
  h.grad_clip_norm = 1.0;
  absl::StatusOr<StepResult> r = opt->Step(h);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_DOUBLE_EQ(r->grad_norm, 5.0);
  EXPECT_NEAR(p[0].item<double>(), -0.6, 1e-6);
  EXPECT_NEAR(p[1].item<double>(), -0.8, 1e-6);
  EXPECT_TRUE(at::equal(p.grad(), at::tensor({3.0f, 4.0f})));
  h.grad_clip_norm = 100;  // above the norm: no scaling
  ASSERT_TRUE(opt->Step(h).ok());
  EXPECT_NEAR(p[0].item<double>(), -3.6, 1e-6);
}

TEST(OptimizerTest, ClipGradNormScalesInPlaceLikeTorch) {
  at::Tensor p = Param({0, 0});
  at::Tensor q = Param({0});
  at::Tensor unused = Param({7});  // no gradient: takes no part, as in torch
  auto opt = Make("sgd", {p, q, unused});
  SetGrad(p, {3, 4});
  SetGrad(q, {12});
  absl::StatusOr<double> norm = opt->ClipGradNorm(6.5, GradNormType::kL2);
  ASSERT_TRUE(norm.ok()) << norm.status();
  EXPECT_NEAR(*norm, 13.0, 1e-5);
  const double coef = 6.5 / (13.0 + 1e-6);
  EXPECT_NEAR(p.grad()[0].item<double>(), 3 * coef, 1e-6);
  EXPECT_NEAR(q.grad()[0].item<double>(), 12 * coef, 1e-6);
  EXPECT_FALSE(unused.grad().defined());

  SetGrad(p, {3, -4});
  SetGrad(q, {1});
  norm = opt->ClipGradNorm(2, GradNormType::kInf);
  ASSERT_TRUE(norm.ok()) << norm.status();
  EXPECT_DOUBLE_EQ(*norm, 4.0);
  EXPECT_NEAR(p.grad()[1].item<double>(), -2.0, 1e-6);

  // max_norm above the norm: the factor clamps to exactly 1, the gradients stay bit for bit.
  const at::Tensor p_kept = p.grad().clone(), q_kept = q.grad().clone();
  ASSERT_TRUE(opt->ClipGradNorm(100, GradNormType::kL2).ok());
  EXPECT_TRUE(at::equal(p.grad(), p_kept));
  EXPECT_TRUE(at::equal(q.grad(), q_kept));
  EXPECT_EQ(opt->step(), 0);  // clipping is not a step
}

TEST(OptimizerTest, ClipGradNormEdgeCases) {
  at::Tensor p = Param({1, 2});
  auto opt = Make("adamw", {p});
  absl::StatusOr<double> norm = opt->ClipGradNorm(1, GradNormType::kL2);
  ASSERT_TRUE(norm.ok());
  EXPECT_EQ(*norm, 0.0);  // no gradients at all: torch returns 0 too

  SetGrad(p, {NAN, 1});
  norm = opt->ClipGradNorm(1, GradNormType::kL2);
  ASSERT_TRUE(norm.ok());
  EXPECT_TRUE(std::isnan(*norm));
  EXPECT_EQ(p.grad()[1].item<float>(), 1.0f);  // left for Step to refuse, not turned into NaN

  SetGrad(p, {1, 1});
  EXPECT_THAT(opt->ClipGradNorm(-1, GradNormType::kL2).status().ToString(),
              HasSubstr("max_norm must be >= 0, got -1"));
  EXPECT_EQ(opt->ClipGradNorm(NAN, GradNormType::kL2).status().code(),
            absl::StatusCode::kInvalidArgument);
  SetGrad(p, {1, 1, 1});
  EXPECT_THAT(opt->ClipGradNorm(1, GradNormType::kL2).status().ToString(),
              HasSubstr("gradient of optimizer param 0 is float32[3]"));

  EXPECT_EQ(*ParseGradNormType(2), GradNormType::kL2);
  EXPECT_EQ(*ParseGradNormType(INFINITY), GradNormType::kInf);
  EXPECT_THAT(ParseGradNormType(1).status().ToString(), HasSubstr("norm_type must be 2 or inf, got 1"));
  EXPECT_EQ(ParseGradNormType(-INFINITY).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(OptimizerTest, KindName) {
  EXPECT_STREQ(Make("AdamW", {Param({1})})->kind_name(), "adamw");
  EXPECT_STREQ(Make("Adam", {Param({1})})->kind_name(), "adam");
  EXPECT_STREQ(Make("SGD", {Param({1})})->kind_name(), "sgd");
}

TEST(OptimizerTest, SgdMomentumByHand) {
  at::Tensor p = Param({0});
  auto opt = Make("sgd", {p});
  OptimizerHyper h;
  h.learning_rate = 1.0;
  h.momentum = 0.9;
  EXPECT_THAT(Names(*opt), ElementsAre("step"));
  SetGrad(p, {1});
  ASSERT_TRUE(opt->Step(h).ok());  // buf = g = 1
  EXPECT_FLOAT_EQ(p.item<float>(), -1.0f);
  ASSERT_TRUE(opt->Step(h).ok());  // buf = 0.9 + 1 = 1.9
  EXPECT_FLOAT_EQ(p.item<float>(), -2.9f);
  EXPECT_THAT(Names(*opt), ElementsAre("step", "momentum_buffer.0"));
}

TEST(OptimizerTest, StateNamesAndOrder) {
  auto opt = Make("adam", {Param({1}), Param({1, 2})});
  EXPECT_THAT(Names(*opt),
              ElementsAre("step", "exp_avg.0", "exp_avg_sq.0", "exp_avg.1", "exp_avg_sq.1"));
  const at::Tensor step = opt->StateTensors()[0].second;
  EXPECT_EQ(step.dim(), 0);
  EXPECT_EQ(step.scalar_type(), at::kLong);
}

// Trains `a` three steps, copies its params and state into a fresh optimizer, then steps
// both with the same gradients: they must stay identical.
void CheckRoundTrip(const std::string& kind) {
  SCOPED_TRACE(kind);
  at::manual_seed(7);
  std::vector<at::Tensor> pa = {at::randn({3, 2}).requires_grad_(true),
                                at::randn({4}).requires_grad_(true)};
  auto a = Make(kind, pa);
  OptimizerHyper h;
  h.learning_rate = 0.05;
  h.weight_decay = 0.01;
  h.momentum = 0.8;
  for (int s = 0; s < 3; ++s) {
    for (at::Tensor& p : pa) p.mutable_grad() = at::randn_like(p);
    ASSERT_TRUE(a->Step(h).ok());
  }
  std::vector<at::Tensor> pb;
  for (const at::Tensor& p : pa) pb.push_back(p.detach().clone().requires_grad_(true));
  auto b = Make(kind, pb);
  std::vector<std::pair<std::string, at::Tensor>> saved;
  for (const auto& [name, t] : a->StateTensors()) saved.emplace_back(name, t.clone());
  ASSERT_TRUE(b->LoadState(saved).ok());
  EXPECT_EQ(b->step(), 3);
  for (int s = 0; s < 2; ++s) {
    for (size_t i = 0; i < pa.size(); ++i) {
      pa[i].mutable_grad() = at::randn_like(pa[i]);
      pb[i].mutable_grad() = pa[i].grad().clone();
    }
    ASSERT_TRUE(a->Step(h).ok());
    ASSERT_TRUE(b->Step(h).ok());
  }
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(at::equal(pa[i], pb[i]));
  const auto sa = a->StateTensors(), sb = b->StateTensors();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sa[i].first, sb[i].first);
    EXPECT_TRUE(at::equal(sa[i].second, sb[i].second)) << sa[i].first;
  }
}

TEST(OptimizerTest, StateRoundTrip) {
  CheckRoundTrip("adamw");
  CheckRoundTrip("adam");
  CheckRoundTrip("sgd");
}

TEST(OptimizerTest, LoadStateValidatesAndIsAllOrNothing) {
  auto opt = Make("adamw", {Param({1, 2}), Param({3})});
  auto good = opt->StateTensors();
  good[0].second = at::scalar_tensor(4, at::kLong);
  good[1].second = at::ones({2});
  auto expect_error = [&](std::vector<std::pair<std::string, at::Tensor>> state,
                          const char* message) {
    absl::Status s = opt->LoadState(state);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << message;
    EXPECT_THAT(std::string(s.message()), HasSubstr(message));
    EXPECT_EQ(opt->step(), 0);  // untouched
    EXPECT_TRUE(at::equal(opt->StateTensors()[1].second, at::zeros({2})));
  };
  auto without = [&](size_t index) {
    auto s = good;
    s.erase(s.begin() + static_cast<long>(index));
    return s;
  };
  expect_error(without(0), "'step' is missing");
  expect_error(without(3), "'exp_avg.1' is missing");
  auto s = good;
  s[0].second = at::scalar_tensor(4.0, at::kFloat);
  expect_error(s, "'step' must be a 0-d int64 tensor, got float32[] on cpu");
  s = good;
  s[0].second = at::scalar_tensor(-1, at::kLong);
  expect_error(s, "'step' is negative");
  s = good;
  s[2].second = at::zeros({3});
  expect_error(s, "'exp_avg_sq.0' is float32[3], expected float32[2]");
  s = good;
  s[1].second = at::zeros({2}, at::kDouble);
  expect_error(s, "'exp_avg.0' is float64[2], expected float32[2]");
  s = good;
  s.emplace_back("momentum_buffer.0", at::zeros({2}));
  expect_error(s, "unknown optimizer state 'momentum_buffer.0'");
  s = good;
  s.emplace_back("exp_avg.0", at::zeros({2}));
  expect_error(s, "'exp_avg.0' appears twice");

  ASSERT_TRUE(opt->LoadState(good).ok());
  EXPECT_EQ(opt->step(), 4);
  EXPECT_TRUE(at::equal(opt->StateTensors()[1].second, at::ones({2})));
  // The loaded tensors are copied, not aliased.
  good[1].second.fill_(7);
  EXPECT_TRUE(at::equal(opt->StateTensors()[1].second, at::ones({2})));
}

TEST(OptimizerTest, SgdLoadStateWithoutMomentumBuffers) {
  at::Tensor p = Param({0});
  auto opt = Make("sgd", {p});
  OptimizerHyper h;
  h.momentum = 0.9;
  SetGrad(p, {1});
  ASSERT_TRUE(opt->Step(h).ok());
  EXPECT_THAT(Names(*opt), ElementsAre("step", "momentum_buffer.0"));
  ASSERT_TRUE(opt->LoadState({{"step", at::scalar_tensor(0, at::kLong)}}).ok());
  EXPECT_THAT(Names(*opt), ElementsAre("step"));
}

}  // namespace
}  // namespace twinkle::engine
