// Decoding of Tinker request bodies (server/tinker/tinker_json.h): the JSON depth guard, and
// the inputs tests/fuzz found (or confirmed) to crash or misbehave the coordinator.
#include "server/tinker/tinker_json.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace twinkle::tinker {
namespace {

using ::testing::HasSubstr;

std::string Bytes(const std::vector<int64_t>& v) { return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 8); }
std::string Bytes(const std::vector<float>& v) { return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4); }

v1::Tensor Csr(int64_t rows, int64_t cols, const std::vector<float>& values, const std::vector<int64_t>& crow,
               const std::vector<int64_t>& col) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_FLOAT32);
  t.add_shape(rows);
  t.add_shape(cols);
  t.mutable_sparse_csr()->set_values(Bytes(values));
  t.mutable_sparse_csr()->set_crow_indices(Bytes(crow));
  t.mutable_sparse_csr()->set_col_indices(Bytes(col));
  return t;
}

TEST(TinkerJsonTest, ParseJsonBodyRefusesDeepNestingButCountsOnlyRealBrackets) {
  EXPECT_TRUE(ParseJsonBody("").ok());  // empty = {}
  const std::string at_limit = "{\"a\":" + std::string(kMaxJsonDepth - 1, '[') + std::string(kMaxJsonDepth - 1, ']') + "}";
  EXPECT_TRUE(ParseJsonBody(at_limit).ok());
  const std::string over = "{\"a\":" + std::string(kMaxJsonDepth, '[') + std::string(kMaxJsonDepth, ']') + "}";
  absl::StatusOr<nlohmann::json> refused = ParseJsonBody(over);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("nested deeper than"));
  // Brackets inside strings (escaped quotes included) do not count.
  EXPECT_TRUE(ParseJsonBody("{\"a\":\"\\\"" + std::string(1000, '[') + "\"}").ok());
  EXPECT_FALSE(ParseJsonBody("[1]").ok());  // not an object
}

TEST(TinkerJsonTest, CsrRowPointersAreCheckedBeforeAnyValueIsRead) {
  // Found with tests/fuzz/tinker_proto_fuzz: crow [0, 100, 2] passed the per-row check of row 0
  // (0 <= 100) and read 100 col_indices of 2 (heap-buffer-overflow under ASan).
  absl::StatusOr<std::vector<double>> r = TensorValues(Csr(2, 3, {1, 2}, {0, 100, 2}, {0, 1}), "w", 6);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("bad crow_indices"));
  r = TensorValues(Csr(2, 3, {1, 2}, {-1, 1, 2}, {0, 1}), "w", 6);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("bad crow_indices"));
  // A well-formed one, with an empty first row, still densifies.
  r = TensorValues(Csr(2, 3, {7, 8}, {0, 0, 2}, {0, 2}), "w", 6);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, (std::vector<double>{0, 0, 0, 7, 0, 8}));
}

TEST(TinkerJsonTest, CsrWithTheLargestRowCountIsRefusedWithoutOverflow) {
  // rows + 1 overflowed int64 (undefined behaviour; UBSan reports it) when cols was 0.
  absl::StatusOr<std::vector<double>> r =
      TensorValues(Csr(std::numeric_limits<int64_t>::max(), 0, {}, {0}, {}), "w", 6);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("inconsistent CSR indices"));
}

TEST(TinkerJsonTest, TargetTokensOutsideInt64AreRefused) {
  // Confirmed with tests/fuzz/tinker_json_fuzz: 1e300 was cast to int64 (undefined behaviour;
  // on x86 it became INT64_MIN and the datum was accepted).
  for (const char* big : {"1e300", "9.3e18", "-9.3e18"}) {
    const nlohmann::json datum = nlohmann::json::parse(
        std::string(R"({"model_input": {"chunks": [{"tokens": [1]}]}, "loss_fn_inputs": {"target_tokens": [)") + big +
        "]}}");
    absl::StatusOr<training::TokenDatum> d = DatumFromJson(datum, "data[0]");
    ASSERT_FALSE(d.ok()) << big;
    EXPECT_THAT(d.status().message(), HasSubstr("target_tokens")) << big;
  }
  const nlohmann::json ok = nlohmann::json::parse(
      R"({"model_input": {"chunks": [{"tokens": [1, 2]}]}, "loss_fn_inputs": {"target_tokens": [2, 151643]}})");
  absl::StatusOr<training::TokenDatum> d = DatumFromJson(ok, "data[0]");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->target_tokens, (std::vector<int64_t>{2, 151643}));
}

}  // namespace
}  // namespace twinkle::tinker
