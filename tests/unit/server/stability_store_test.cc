// StabilityStore: StableReinforce's per-tenant records and the resolution of provenance spans.
#include "server/tinker/stability_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <vector>

namespace twinkle::tinker {
namespace {

using ::testing::HasSubstr;
namespace v1 = ::tinker::v1;

const absl::Time kT0 = absl::FromUnixSeconds(1'700'000'000);

void AddSpan(google::protobuf::RepeatedPtrField<v1::ProvenanceSpan>* list, bool sampled, const std::string& id,
             int64_t offset, int64_t length) {
  v1::ProvenanceSpan* s = list->Add();
  auto set = [&](auto* arm) {
    arm->set_sequence_id(id);
    arm->set_offset(offset);
    arm->set_length(length);
  };
  if (sampled) {
    set(s->mutable_sampled_tokens());
  } else {
    set(s->mutable_prompt_tokens());
  }
}

// Prompt [10, 11, 12], sampled [20, 21]: the cookbook's datum input [10, 11, 12, 20],
// targets [11, 12, 20, 21].
struct Fixture {
  StabilityStore store{StabilityStoreOptions{absl::Hours(24), 100}};
  v1::Datum proto;
  training::TokenDatum datum;
  Fixture() {
    store.Record("alice", "r:0", std::make_shared<const std::vector<int64_t>>(std::vector<int64_t>{10, 11, 12}),
                 {20, 21}, {-0.5f, -1.5f}, kT0);
    datum.input_tokens = {10, 11, 12, 20};
    datum.target_tokens = {11, 12, 20, 21};
    datum.inputs["logprobs"] = {9, 9, 9, 9};  // replaced
    AddSpan(proto.mutable_model_input_spans(), false, "r:0", 0, 3);
    AddSpan(proto.mutable_model_input_spans(), true, "r:0", 0, 1);
    AddSpan(proto.mutable_loss_fn_input_spans(), false, "r:0", 1, 2);
    AddSpan(proto.mutable_loss_fn_input_spans(), true, "r:0", 0, 2);
  }
};

TEST(StabilityStoreTest, ResolvesSampledPositionsFromTheRecord) {
  Fixture f;
  ASSERT_TRUE(f.store.Resolve("alice", f.proto, "data[0]", f.datum, kT0).ok());
  EXPECT_EQ(f.datum.inputs["logprobs"], (std::vector<float>{0, 0, -0.5f, -1.5f}));
  EXPECT_EQ(f.datum.inputs["stability_mask"], (std::vector<float>{0, 0, 1, 1}));
  EXPECT_EQ(f.store.TokensHeld("alice"), 5);
}

TEST(StabilityStoreTest, RefusesWhatDoesNotMatchTheRecord) {
  Fixture f;
  f.datum.target_tokens[3] = 22;
  absl::Status s = f.store.Resolve("alice", f.proto, "data[0]", f.datum, kT0);
  EXPECT_THAT(s.message(), HasSubstr("data[0].loss_fn_input_spans[1]: token 3 is 22, the recorded sequence has 21"));
  Fixture other;
  EXPECT_THAT(other.store.Resolve("bob", other.proto, "data[0]", other.datum, kT0).message(),
              HasSubstr("sequence_id 'r:0' is unknown or expired"));
  Fixture untiled;
  untiled.proto.mutable_loss_fn_input_spans()->RemoveLast();
  EXPECT_THAT(untiled.store.Resolve("alice", untiled.proto, "data[0]", untiled.datum, kT0).message(),
              HasSubstr("the spans cover 2 positions, the field has 4"));
  Fixture past;
  past.proto.mutable_loss_fn_input_spans(1)->mutable_sampled_tokens()->set_offset(1);
  EXPECT_THAT(past.store.Resolve("alice", past.proto, "data[0]", past.datum, kT0).message(),
              HasSubstr("offset 1 + length 2 is past the 2 sampled tokens"));
  Fixture none;
  none.proto.clear_model_input_spans();
  EXPECT_THAT(none.store.Resolve("alice", none.proto, "data[0]", none.datum, kT0).message(),
              HasSubstr("needs the datum's provenance"));
}

TEST(StabilityStoreTest, OneDayAfterTheLastUse) {
  Fixture f;
  const absl::Time later = kT0 + absl::Hours(23);
  ASSERT_TRUE(f.store.Resolve("alice", f.proto, "d", f.datum, later).ok());  // renews the day
  EXPECT_TRUE(f.store.Resolve("alice", f.proto, "d", f.datum, later + absl::Hours(23)).ok());
  EXPECT_THAT(f.store.Resolve("alice", f.proto, "d", f.datum, later + absl::Hours(47)).message(),
              HasSubstr("unknown or expired"));
}

TEST(StabilityStoreTest, TenantBudgetDropsTheOldestFirst) {
  StabilityStore store{StabilityStoreOptions{absl::Hours(24), 10}};
  auto prompt = std::make_shared<const std::vector<int64_t>>(std::vector<int64_t>{1, 2});
  store.Record("alice", "a", prompt, {3, 4}, {0, 0}, kT0);                      // 4 tokens
  store.Record("alice", "b", prompt, {3, 4}, {0, 0}, kT0 + absl::Seconds(1));  // 8
  store.Record("bob", "x", prompt, {3, 4, 5, 6, 7, 8}, {0, 0, 0, 0, 0, 0}, kT0);  // another tenant's budget
  store.Record("alice", "c", prompt, {3, 4}, {0, 0}, kT0 + absl::Seconds(2));  // 12 > 10: "a" goes
  EXPECT_EQ(store.TokensHeld("alice"), 8);
  EXPECT_EQ(store.TokensHeld("bob"), 8);
  // One sequence larger than the whole budget is not kept (limit + 1).
  store.Record("alice", "big", prompt, std::vector<int64_t>(9, 3), std::vector<float>(9, 0), kT0);
  EXPECT_EQ(store.TokensHeld("alice"), 8);
  training::TokenDatum d;
  d.input_tokens = {1};
  d.target_tokens = {2};
  v1::Datum proto;
  AddSpan(proto.mutable_model_input_spans(), false, "a", 0, 1);
  AddSpan(proto.mutable_loss_fn_input_spans(), false, "a", 1, 1);
  EXPECT_THAT(store.Resolve("alice", proto, "d", d, kT0 + absl::Seconds(3)).message(), HasSubstr("'a' is unknown"));
  proto.mutable_model_input_spans(0)->mutable_prompt_tokens()->set_sequence_id("b");
  proto.mutable_loss_fn_input_spans(0)->mutable_prompt_tokens()->set_sequence_id("b");
  EXPECT_TRUE(store.Resolve("alice", proto, "d", d, kT0 + absl::Seconds(3)).ok());
}

}  // namespace
}  // namespace twinkle::tinker
