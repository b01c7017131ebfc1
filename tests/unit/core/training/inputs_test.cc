#include "core/training/inputs.h"

#include <cmath>
#include <cstring>
#include <limits>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace twinkle::training {
namespace {

using ::testing::HasSubstr;

template <typename T>
std::vector<T> Frame(const PackedOp& op, const ipc::TensorDesc& desc) {
  const std::string& bytes = op.buffers.at(desc.frame);
  std::vector<T> out(bytes.size() / sizeof(T));
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

ForwardArgs OneSequence(std::vector<int64_t> ids, std::vector<int64_t> labels) {
  ForwardArgs args;
  args.inputs.push_back({std::move(ids), std::move(labels)});
  return args;
}

TEST(PackForwardTest, ShiftsHfLabelsOntoTargetsAndMask) {
  // labels[i] is the token at position i: position i-1 predicts it.
  ForwardArgs args = OneSequence({5, 6, 7, 8}, {-100, -100, 7, 8});
  args.advantages = {2.0f};
  args.old_logps = {{-1.0f, -2.0f}};
  absl::StatusOr<PackedOp> op = PackForward(args, 100, 1000);
  ASSERT_TRUE(op.ok()) << op.status();
  ASSERT_EQ(op->msg.datums.size(), 1u);
  const ipc::DatumMsg& d = op->msg.datums[0];
  EXPECT_EQ(Frame<int64_t>(*op, d.input_tokens), (std::vector<int64_t>{5, 6, 7, 8}));
  // Untrained positions target the next input token (their log-probs are still useful).
  EXPECT_EQ(Frame<int64_t>(*op, d.target_tokens), (std::vector<int64_t>{6, 7, 8, 0}));
  EXPECT_EQ(Frame<float>(*op, d.inputs.at("mask")), (std::vector<float>{0, 1, 1, 0}));
  EXPECT_EQ(Frame<float>(*op, d.inputs.at("advantages")), (std::vector<float>{0, 2, 2, 0}));
  EXPECT_EQ(Frame<float>(*op, d.inputs.at("logprobs")), (std::vector<float>{0, -1, -2, 0}));
  EXPECT_EQ(op->tokens, 4);
  EXPECT_EQ(op->trained_tokens, 2);
}

TEST(PackForwardTest, NoLabelsTrainsEveryNextToken) {
  absl::StatusOr<PackedOp> op = PackForward(OneSequence({1, 2, 3}, {}), 10, 100);
  ASSERT_TRUE(op.ok()) << op.status();
  EXPECT_EQ(Frame<float>(*op, op->msg.datums[0].inputs.at("mask")), (std::vector<float>{1, 1, 0}));
}

TEST(PackForwardTest, EveryBadInputNamesItsField) {
  struct Case {
    ForwardArgs args;
    std::string field;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<Case> cases;
  cases.push_back({ForwardArgs{}, "inputs: empty batch"});
  cases.push_back({OneSequence({}, {}), "inputs[0].input_ids: empty"});
  cases.push_back({OneSequence({1, -1}, {}), "inputs[0].input_ids[1]: token id -1"});
  cases.push_back({OneSequence({1, 10}, {}), "inputs[0].input_ids[1]: token id 10 outside [0, 10)"});
  cases.push_back({OneSequence({1, 2}, {1}), "inputs[0].labels: length 1"});
  cases.push_back({OneSequence({1, 2}, {-100, 12}), "inputs[0].labels[1]"});
  ForwardArgs adv = OneSequence({1, 2}, {});
  adv.advantages = {nan};
  cases.push_back({adv, "advantages[0]: not a finite number"});
  ForwardArgs count = OneSequence({1, 2}, {});
  count.advantages = {1, 2};
  cases.push_back({count, "advantages: 2 values for 1 sequences"});
  ForwardArgs old = OneSequence({1, 2, 3}, {-100, -100, 3});
  old.old_logps = {{-1, -2}};
  cases.push_back({old, "old_logps[0]: 2 values for 1 trained tokens"});
  ForwardArgs inf = OneSequence({1, 2}, {});
  inf.ref_logps = {{std::numeric_limits<float>::infinity()}};
  cases.push_back({inf, "ref_logps[0][0]: not a finite number"});
  cases.push_back({OneSequence(std::vector<int64_t>(9, 1), {}), "more than 8 tokens"});
  for (const Case& c : cases) {
    absl::StatusOr<PackedOp> op = PackForward(c.args, 10, 8);
    ASSERT_FALSE(op.ok()) << c.field;
    EXPECT_EQ(op.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(op.status().message()), HasSubstr(c.field));
  }
}

TEST(PackForwardTest, AppendFramesRenumbersBehindExistingFrames) {
  absl::StatusOr<PackedOp> a = PackForward(OneSequence({1, 2}, {}), 10, 100);
  absl::StatusOr<PackedOp> b = PackForward(OneSequence({3, 4, 5}, {}), 10, 100);
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<std::string> buffers;
  AppendFrames(*a, buffers);
  const ipc::TrainOpMsg second = AppendFrames(*b, buffers);
  const std::string& ids = buffers.at(second.datums[0].input_tokens.frame);
  std::vector<int64_t> got(ids.size() / sizeof(int64_t));
  std::memcpy(got.data(), ids.data(), ids.size());
  EXPECT_EQ(got, (std::vector<int64_t>{3, 4, 5}));
  EXPECT_EQ(buffers.size(), a->buffers.size() + b->buffers.size());
}

}  // namespace
}  // namespace twinkle::training
