// The split of a fused forward_backward over ranks (data parallelism, docs/device_pool.md)
// or into passes under an activation-memory budget (docs/architecture.md, "Training
// memory"), and the merge of the parts' replies (core/ipc/forward_split.h). The engines' side (the all-reduce, the numbers) is
// tested in tests/engine/test_data_parallel.py and tests/e2e/test_data_parallel.py.

#include "core/engine_client/data_parallel_link.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/ipc/messages.h"
#include "core/ipc/training_messages.h"

namespace twinkle {
namespace {

// An int64 [len] token tensor whose frame holds `tag` in every element.
ipc::TensorDesc Tokens(int64_t len, int64_t tag, std::vector<std::string>& buffers) {
  std::vector<int64_t> values(static_cast<size_t>(len), tag);
  buffers.emplace_back(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(int64_t));
  return ipc::TensorDesc{"int64", {len}, static_cast<uint32_t>(buffers.size() - 1)};
}

int64_t Tag(const ipc::TensorDesc& desc, const std::vector<std::string>& buffers) {
  int64_t v = 0;
  std::memcpy(&v, buffers.at(desc.frame).data(), sizeof(v));
  return v;
}

ipc::DatumMsg Datum(int64_t len, int64_t tag, std::vector<std::string>& buffers) {
  ipc::DatumMsg d;
  d.input_tokens = Tokens(len, tag, buffers);
  d.target_tokens = Tokens(len, tag + 1000, buffers);
  return d;
}

// Three ops: "a" with a sum loss and 4 datums (splits), "b" with Twinkle's DPO (a pair
// loss: stays whole) and 2 datums, base-only rows without a loss (split).
ipc::Message FusedRequest() {
  std::vector<std::string> buffers;
  ipc::ForwardRequest req;
  ipc::TrainOpMsg a;
  a.adapter_id = "a";
  a.loss.name = "cross_entropy";
  for (int64_t i = 0; i < 4; ++i) a.datums.push_back(Datum(10 + i, 100 + i, buffers));
  ipc::TrainOpMsg b;
  b.adapter_id = "b";
  b.loss.name = "twinkle:dpo";
  for (int64_t i = 0; i < 2; ++i) b.datums.push_back(Datum(7, 200 + i, buffers));
  ipc::TrainOpMsg base;
  base.datums.push_back(Datum(5, 300, buffers));
  req.ops = {a, b, base};
  return ipc::MakeRequest(ipc::kMethodForwardBackward, ipc::Pack(req), std::move(buffers));
}

TEST(DataParallelSplit, SplitsSumLossesByDatumAndKeepsOtherLossesWhole) {
  const ipc::Message request = FusedRequest();
  absl::StatusOr<ForwardSplit> split = SplitForward(request, 2);
  ASSERT_TRUE(split.ok()) << split.status();
  ASSERT_EQ(split->requests.size(), 2u);
  // Greedy by tokens: a0(10)->r0, a1(11)->r1, a2(12)->r0 (10<11), a3(13)->r1 (22<24),
  // b(14, whole)->r0 (22<24), base(5)->r1 (24<36).
  EXPECT_EQ(split->tokens, (std::vector<int64_t>{36, 29}));
  std::vector<std::vector<std::vector<int64_t>>> tags(2);  // rank -> op -> datum tags
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_TRUE(split->has_request[r]);
    absl::StatusOr<ipc::ForwardRequest> part =
        ipc::Unpack<ipc::ForwardRequest>(split->requests[r].envelope.body, "part");
    ASSERT_TRUE(part.ok());
    // Both ranks all-reduce both trained adapters, in op order (base rows train nothing).
    EXPECT_EQ(part->allreduce_adapters, (std::vector<std::string>{"a", "b"}));
    for (const ipc::TrainOpMsg& op : part->ops) {
      tags[r].emplace_back();
      for (const ipc::DatumMsg& d : op.datums) {
        tags[r].back().push_back(Tag(d.input_tokens, split->requests[r].buffers));
        EXPECT_EQ(Tag(d.target_tokens, split->requests[r].buffers), tags[r].back().back() + 1000);
      }
    }
  }
  EXPECT_EQ(tags[0], (std::vector<std::vector<int64_t>>{{100, 102}, {200, 201}}));
  EXPECT_EQ(tags[1], (std::vector<std::vector<int64_t>>{{101, 103}, {300}}));
}

TEST(DataParallelSplit, ForwardOnlySendsNothingToARankWithoutRows) {
  std::vector<std::string> buffers;
  ipc::ForwardRequest req;
  ipc::TrainOpMsg op;
  op.adapter_id = "a";
  op.datums.push_back(Datum(4, 1, buffers));
  req.ops = {op};
  absl::StatusOr<ForwardSplit> split =
      SplitForward(ipc::MakeRequest(ipc::kMethodForward, ipc::Pack(req), buffers), 3);
  ASSERT_TRUE(split.ok());
  EXPECT_EQ(split->has_request, (std::vector<bool>{true, false, false}));
  // forward_backward: every rank joins the all-reduce, rows or not.
  req.ops[0].loss.name = "cross_entropy";
  split = SplitForward(ipc::MakeRequest(ipc::kMethodForwardBackward, ipc::Pack(req), buffers), 3);
  ASSERT_TRUE(split.ok());
  EXPECT_EQ(split->has_request, (std::vector<bool>{true, true, true}));
}

TEST(DataParallelSplit, OneRankIsTheRequestAsItWas) {
  const ipc::Message request = FusedRequest();
  absl::StatusOr<ForwardSplit> split = SplitForward(request, 1);
  ASSERT_TRUE(split.ok());
  absl::StatusOr<ipc::ForwardRequest> part =
      ipc::Unpack<ipc::ForwardRequest>(split->requests[0].envelope.body, "part");
  ASSERT_TRUE(part.ok());
  EXPECT_TRUE(part->allreduce_adapters.empty());
  ASSERT_EQ(part->ops.size(), 3u);
  EXPECT_EQ(part->ops[0].datums.size(), 4u);
}

TEST(DataParallelSplit, RefusesBadInput) {
  EXPECT_FALSE(SplitForward(ipc::MakeRequest(ipc::kMethodOptimStep, ""), 2).ok());
  ipc::ForwardRequest req;
  ipc::TrainOpMsg op;
  op.datums.push_back(ipc::DatumMsg{ipc::TensorDesc{"int64", {3}, 7}, {}, {}});  // no frame 7
  req.ops = {op};
  absl::StatusOr<ForwardSplit> split = SplitForward(ipc::MakeRequest(ipc::kMethodForward, ipc::Pack(req)), 2);
  ASSERT_FALSE(split.ok());
  EXPECT_NE(split.status().message().find("frame 7"), std::string::npos);
}

// A rank's reply: per datum, a float32 "logprobs" frame of its tag; per op, metrics.
ipc::Message FakeReply(const ipc::Message& part_request) {
  absl::StatusOr<ipc::ForwardRequest> part =
      ipc::Unpack<ipc::ForwardRequest>(part_request.envelope.body, "part");
  ipc::Message reply;
  ipc::ForwardReply body;
  for (const ipc::TrainOpMsg& op : part->ops) {
    ipc::OpResultMsg result;
    int64_t tokens = 0;
    for (const ipc::DatumMsg& d : op.datums) {
      const float tag = static_cast<float>(Tag(d.input_tokens, part_request.buffers));
      const int64_t len = d.input_tokens.shape[0];
      tokens += len;
      std::vector<float> values(static_cast<size_t>(len), tag);
      reply.buffers.emplace_back(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
      result.logprobs.push_back({"float32", {len}, static_cast<uint32_t>(reply.buffers.size() - 1)});
    }
    result.metrics = {{"loss:sum", static_cast<double>(tokens)},
                      {"clip:max", static_cast<double>(tokens)},
                      {"ratio:mean", static_cast<double>(op.datums.size())}};
    body.ops.push_back(result);
  }
  reply.envelope.body = ipc::Pack(body);
  return reply;
}

// Every part answered by FakeReply, merged: the merged message and its body.
struct Merged {
  ipc::Message message;
  ipc::ForwardReply body;
};
absl::StatusOr<Merged> MergeFakeReplies(const ForwardSplit& split) {
  std::vector<ipc::Message> replies;
  for (const ipc::Message& m : split.requests) replies.push_back(FakeReply(m));
  absl::StatusOr<ipc::Message> merged = MergeForward(split, std::move(replies));
  if (!merged.ok()) return merged.status();
  absl::StatusOr<ipc::ForwardReply> body = ipc::Unpack<ipc::ForwardReply>(merged->envelope.body, "merged");
  if (!body.ok()) return body.status();
  return Merged{*std::move(merged), *std::move(body)};
}

TEST(DataParallelMerge, PutsEveryDatumBackInPlaceAndMergesMetrics) {
  absl::StatusOr<ForwardSplit> split = SplitForward(FusedRequest(), 2);
  ASSERT_TRUE(split.ok());
  absl::StatusOr<Merged> merged_or = MergeFakeReplies(*split);
  ASSERT_TRUE(merged_or.ok()) << merged_or.status();
  const ipc::Message* merged = &merged_or->message;
  const ipc::ForwardReply* body = &merged_or->body;
  ASSERT_EQ(body->ops.size(), 3u);
  const std::vector<std::vector<float>> want = {{100, 101, 102, 103}, {200, 201}, {300}};
  for (size_t o = 0; o < 3; ++o) {
    ASSERT_EQ(body->ops[o].logprobs.size(), want[o].size());
    for (size_t d = 0; d < want[o].size(); ++d) {
      float v = 0;
      std::memcpy(&v, merged->buffers.at(body->ops[o].logprobs[d].frame).data(), sizeof(v));
      EXPECT_EQ(v, want[o][d]) << "op " << o << " datum " << d;
    }
  }
  // Op "a" ran on both ranks: rank 0 rows 10+12, rank 1 rows 11+13.
  const std::map<std::string, double>& m = body->ops[0].metrics;
  EXPECT_EQ(m.at("loss:sum"), 46.0);
  EXPECT_EQ(m.at("clip:max"), 24.0);
  EXPECT_DOUBLE_EQ(m.at("ratio:mean"), 2.0);  // both ranks 2 datums: the weighted mean is 2
  // Op "b" ran whole on one rank: its metrics as that rank gave them.
  EXPECT_EQ(body->ops[1].metrics.at("loss:sum"), 14.0);
}

// Passes: 1 KiB per token, no fixed or quadratic term, so a 30-token budget is 30 KiB.
constexpr ActivationCost kKiBPerToken{0, 1 << 10, 0};

std::vector<std::vector<std::vector<int64_t>>> PartTags(const ForwardSplit& split) {
  std::vector<std::vector<std::vector<int64_t>>> tags;  // part -> op -> datum tags
  for (const ipc::Message& m : split.requests) {
    absl::StatusOr<ipc::ForwardRequest> part = ipc::Unpack<ipc::ForwardRequest>(m.envelope.body, "part");
    EXPECT_TRUE(part.ok());
    EXPECT_TRUE(part->allreduce_adapters.empty());
    EXPECT_EQ(part->max_pass_bytes, 0);
    tags.emplace_back();
    for (const ipc::TrainOpMsg& op : part->ops) {
      tags.back().emplace_back();
      for (const ipc::DatumMsg& d : op.datums) tags.back().back().push_back(Tag(d.input_tokens, m.buffers));
    }
  }
  return tags;
}

TEST(ForwardPasses, FillsEachPassInOrderUpToTheBudgetKeepingNonSumLossesWhole) {
  // a: 10, 11, 12, 13 tokens (by datum); b: 2 x 7 = 14 (whole); base: 5. Budget 30 KiB:
  // pass 1 a0+a1 (21; +12 = 33 > 30), pass 2 a2+a3 (25; +14 = 39), pass 3 b+base (19).
  absl::StatusOr<ForwardSplit> split = SplitForwardIntoPasses(FusedRequest(), kKiBPerToken, 30 << 10);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(split->tokens, (std::vector<int64_t>{21, 25, 19}));
  EXPECT_EQ(split->has_request, (std::vector<bool>{true, true, true}));
  EXPECT_EQ(PartTags(*split), (std::vector<std::vector<std::vector<int64_t>>>{
                                  {{100, 101}}, {{102, 103}}, {{200, 201}, {300}}}));
  // The merge puts the passes' replies back as one reply: op a's loss:sum adds over passes.
  absl::StatusOr<Merged> merged = MergeFakeReplies(*split);
  ASSERT_TRUE(merged.ok()) << merged.status();
  const ipc::ForwardReply* body = &merged->body;
  ASSERT_EQ(body->ops.size(), 3u);
  EXPECT_EQ(body->ops[0].logprobs.size(), 4u);
  EXPECT_EQ(body->ops[0].metrics.at("loss:sum"), 46.0);
  EXPECT_EQ(body->ops[1].metrics.at("loss:sum"), 14.0);
}

TEST(ForwardPasses, AUnitAboveTheBudgetGetsAPassOfItsOwn) {
  // Budget 12 KiB: a0 (10), a1 (11), a2 (12) each alone, a3 (13) over it alone, b (14)
  // over it alone, base (5) alone as well (14 + 5 > 12).
  absl::StatusOr<ForwardSplit> split = SplitForwardIntoPasses(FusedRequest(), kKiBPerToken, 12 << 10);
  ASSERT_TRUE(split.ok());
  EXPECT_EQ(split->tokens, (std::vector<int64_t>{10, 11, 12, 13, 14, 5}));
  // A budget the whole request fits: one pass, the request as it was.
  split = SplitForwardIntoPasses(FusedRequest(), kKiBPerToken, 65 << 10);
  ASSERT_TRUE(split.ok());
  EXPECT_EQ(split->tokens, (std::vector<int64_t>{65}));
  EXPECT_FALSE(SplitForwardIntoPasses(ipc::MakeRequest(ipc::kMethodOptimStep, ""), kKiBPerToken, 1).ok());
}

TEST(DataParallelSplit, EachRankKeepsThePassBudget) {
  ipc::Message request = FusedRequest();
  absl::StatusOr<ipc::ForwardRequest> req = ipc::Unpack<ipc::ForwardRequest>(request.envelope.body, "req");
  ASSERT_TRUE(req.ok());
  req->max_pass_bytes = 123;
  request.envelope.body = ipc::Pack(*req);
  absl::StatusOr<ForwardSplit> split = SplitForward(request, 2);
  ASSERT_TRUE(split.ok());
  for (const ipc::Message& m : split->requests) {
    EXPECT_EQ(ipc::Unpack<ipc::ForwardRequest>(m.envelope.body, "part")->max_pass_bytes, 123);
  }
}

// Adapter sharding: an op pinned to its adapter's home rank runs there whole and is not
// all-reduced; only the spread ops' adapters are, and then every rank gets a request.
TEST(DataParallelSplit, PinnedOpsRunWholeOnTheirRankWithoutACollective) {
  const ipc::Message request = FusedRequest();
  absl::StatusOr<ForwardSplit> split = SplitForward(request, 2, {1, 0, kSpreadOverRanks});
  ASSERT_TRUE(split.ok()) << split.status();
  // "a" (46 tokens) whole on rank 1, "b" (14) on rank 0, the base row (5) to the emptier rank 0.
  EXPECT_EQ(split->tokens, (std::vector<int64_t>{19, 46}));
  for (size_t r = 0; r < 2; ++r) {
    ASSERT_TRUE(split->has_request[r]);
    absl::StatusOr<ipc::ForwardRequest> part =
        ipc::Unpack<ipc::ForwardRequest>(split->requests[r].envelope.body, "part");
    ASSERT_TRUE(part.ok());
    EXPECT_TRUE(part->allreduce_adapters.empty()) << "no adapter is spread";
  }
  absl::StatusOr<ipc::ForwardRequest> rank1 = ipc::Unpack<ipc::ForwardRequest>(split->requests[1].envelope.body, "p");
  ASSERT_EQ(rank1->ops.size(), 1u);
  EXPECT_EQ(rank1->ops[0].adapter_id, "a");
  EXPECT_EQ(rank1->ops[0].datums.size(), 4u);

  // "a" spread, "b" pinned to rank 1: only "a" is all-reduced, on both ranks.
  split = SplitForward(request, 2, {kSpreadOverRanks, 1, kSpreadOverRanks});
  ASSERT_TRUE(split.ok()) << split.status();
  for (size_t r = 0; r < 2; ++r) {
    absl::StatusOr<ipc::ForwardRequest> part =
        ipc::Unpack<ipc::ForwardRequest>(split->requests[r].envelope.body, "part");
    EXPECT_EQ(part->allreduce_adapters, (std::vector<std::string>{"a"}));
  }
  // The merge puts every datum back whatever rank ran it.
  std::vector<ipc::Message> replies;
  for (size_t r = 0; r < 2; ++r) {
    absl::StatusOr<ipc::ForwardRequest> part =
        ipc::Unpack<ipc::ForwardRequest>(split->requests[r].envelope.body, "part");
    ipc::ForwardReply reply;
    for (const ipc::TrainOpMsg& op : part->ops) {
      ipc::OpResultMsg result;
      for (size_t d = 0; d < op.datums.size(); ++d) result.logprobs.push_back(op.datums[d].input_tokens);
      reply.ops.push_back(result);
    }
    replies.push_back(ipc::MakeRequest("reply", ipc::Pack(reply), split->requests[r].buffers));
  }
  absl::StatusOr<ipc::Message> merged = MergeForward(*split, std::move(replies));
  ASSERT_TRUE(merged.ok()) << merged.status();
  absl::StatusOr<ipc::ForwardReply> out = ipc::Unpack<ipc::ForwardReply>(merged->envelope.body, "merged");
  ASSERT_EQ(out->ops.size(), 3u);
  for (size_t d = 0; d < 4; ++d) EXPECT_EQ(Tag(out->ops[0].logprobs[d], merged->buffers), 100 + static_cast<int64_t>(d));
  for (size_t d = 0; d < 2; ++d) EXPECT_EQ(Tag(out->ops[1].logprobs[d], merged->buffers), 200 + static_cast<int64_t>(d));
  EXPECT_EQ(Tag(out->ops[2].logprobs[0], merged->buffers), 300);
}

TEST(DataParallelSplit, RefusesOpRanksThatDoNotFit) {
  const ipc::Message request = FusedRequest();
  EXPECT_FALSE(SplitForward(request, 2, {0, 1}).ok());  // 2 ranks for 3 ops
  absl::StatusOr<ForwardSplit> split = SplitForward(request, 2, {0, 2, 0});
  ASSERT_FALSE(split.ok());
  EXPECT_NE(split.status().message().find("op 1 placed on rank 2 of 2"), std::string::npos) << split.status();
}

TEST(DataParallelSplit, SumLossesAreTheTinkerOnes) {
  for (const char* name : {"", "cross_entropy", "importance_sampling", "ppo", "cispo", "dro"}) {
    EXPECT_TRUE(LossSplitsOverDatums(name)) << name;
  }
  for (const char* name : {"twinkle:cross_entropy", "twinkle:dpo", "twinkle:grpo", "custom"}) {
    EXPECT_FALSE(LossSplitsOverDatums(name)) << name;
  }
}

}  // namespace
}  // namespace twinkle
