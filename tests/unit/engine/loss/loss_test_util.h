#pragma once
// Helpers shared by the loss unit tests (loss_test.cc, twinkle_loss_test.cc).
#include <ATen/ATen.h>

#include <cmath>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/engine/loss/loss.h"
#include "gtest/gtest.h"

namespace twinkle::engine::loss_test {

inline const double kLn2 = std::log(2.0);

inline at::Tensor T(std::vector<double> values, c10::ScalarType dtype = at::kDouble) {
  return at::tensor(values, at::TensorOptions().dtype(at::kDouble)).to(dtype);
}

// A datum whose logprobs is a grad-requiring leaf, so tests can check gradients.
inline LossDatum Datum(std::vector<double> lp, std::map<std::string, at::Tensor> inputs = {}) {
  return LossDatum{T(std::move(lp)).requires_grad_(true), std::move(inputs)};
}

inline LossSpec Spec(std::string name, std::map<std::string, double> config = {}) {
  return LossSpec{std::move(name), std::move(config), {}};
}

inline LossResult RunLoss(const LossSpec& spec, std::vector<LossDatum>& datums,
                          LossContext context = {}) {
  absl::StatusOr<LossResult> r = ComputeLoss(spec, datums, context);
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return {};
  r->total.backward();
  return *std::move(r);
}

inline void ExpectValues(const at::Tensor& t, std::vector<double> want) {
  ASSERT_EQ(t.numel(), static_cast<int64_t>(want.size()));
  const at::Tensor d = t.to(at::kDouble).contiguous();
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(d[i].item<double>(), want[i], 1e-12) << "element " << i;
  }
}

inline std::string Error(const LossSpec& spec, const std::vector<LossDatum>& datums,
                         LossContext context = {}) {
  absl::StatusOr<LossResult> r = ComputeLoss(spec, datums, context);
  EXPECT_FALSE(r.ok());
  if (r.ok()) return "";
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  return std::string(r.status().message());
}

}  // namespace twinkle::engine::loss_test
