// CheckpointStore retention, quota, sharing and PEFT import on a real filesystem and SQLite
// registry, with the clock seam (OffsetClock) instead of sleeping.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/common/clock.h"
#include "core/registry/registry.h"
#include "core/storage/filesystem.h"
#include "core/storage/safetensors_writer.h"
#include "core/training/checkpoints.h"

namespace twinkle::training {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using json = nlohmann::json;

struct FixedClock final : Clock {
  absl::Time Now() const override { return absl::FromUnixSeconds(1'800'000'000); }
};

std::string F32(const std::vector<int64_t>& shape, float value) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::string bytes(static_cast<size_t>(n) * sizeof(float), '\0');
  for (int64_t i = 0; i < n; ++i) std::memcpy(bytes.data() + i * sizeof(float), &value, sizeof value);
  return bytes;
}

// A base model of 1 layer: hidden 8, q/k/v/o 8x8, gate/up 16x8, down 8x16, tied embedding 32x8.
std::map<std::string, std::vector<int64_t>> Base() {
  std::map<std::string, std::vector<int64_t>> b;
  for (const char* m : {"q_proj", "k_proj", "v_proj", "o_proj"}) b[std::string("model.layers.0.self_attn.") + m + ".weight"] = {8, 8};
  b["model.layers.0.mlp.gate_proj.weight"] = {16, 8};
  b["model.layers.0.mlp.up_proj.weight"] = {16, 8};
  b["model.layers.0.mlp.down_proj.weight"] = {8, 16};
  b["model.layers.0.input_layernorm.weight"] = {8};
  b["model.embed_tokens.weight"] = {32, 8};
  return b;
}

// A PEFT adapter (rank 2) on the attention of Base(), B filled with `b`.
std::map<std::string, storage::TensorBytes> AttnAdapter(float b) {
  std::map<std::string, storage::TensorBytes> t;
  for (const char* m : {"q_proj", "k_proj", "v_proj", "o_proj"}) {
    const std::string p = std::string("base_model.model.model.layers.0.self_attn.") + m;
    t[p + ".lora_A.weight"] = {"F32", {2, 8}, F32({2, 8}, 0.5f)};
    t[p + ".lora_B.weight"] = {"F32", {8, 2}, F32({8, 2}, b)};
  }
  return t;
}

json PeftConfig(double alpha) {
  return {{"peft_type", "LORA"}, {"r", 2}, {"lora_alpha", alpha}, {"target_modules", {"q_proj", "k_proj", "v_proj", "o_proj"}},
          {"bias", "none"}, {"use_dora", false}, {"modules_to_save", nullptr}, {"rank_pattern", json::object()}};
}

class CheckpointRetentionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "twinkle-retention-XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    absl::StatusOr<std::unique_ptr<registry::Registry>> r = registry::Registry::Open((dir_ / "r.sqlite").string());
    ASSERT_TRUE(r.ok()) << r.status();
    registry_ = *std::move(r);
    store_ = std::make_unique<CheckpointStore>((dir_ / "data").string(), storage::RealFileSystem(), *registry_, "base",
                                               clock_);
    for (const char* t : {"alice", "bob"}) {
      registry::RunRecord run;
      run.run_id = std::string("run-") + t;
      run.tenant = t;
      run.adapter_name = run.run_id;
      run.base_model = "base";
      run.lora_config_json = "{}";
      ASSERT_TRUE(registry_->PutRun(run).ok());
    }
  }
  void TearDown() override {
    store_.reset();
    registry_.reset();
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  absl::StatusOr<registry::CheckpointRecord> Write(const std::string& tenant, const std::string& name,
                                                   std::optional<int64_t> ttl = std::nullopt) {
    return store_->WriteAdapter(tenant, "run-" + tenant, CheckpointKind::kSampler, name, std::string(100, 'x'), "{}",
                                ttl);
  }

  fs::path dir_;
  FixedClock base_;
  OffsetClock clock_{base_};
  std::unique_ptr<registry::Registry> registry_;
  std::unique_ptr<CheckpointStore> store_;
};

TEST_F(CheckpointRetentionTest, TtlExpiresOnTheClockAndTheReaperDeletesFilesAndRow) {
  ASSERT_TRUE(Write("alice", "short", 3600).ok());
  ASSERT_TRUE(Write("alice", "keep").ok());
  absl::StatusOr<registry::CheckpointRecord> c = registry_->GetCheckpoint("alice", "run-alice", "sampler_weights/short");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->expires, clock_.Now() + absl::Seconds(3600));
  clock_.Advance(absl::Seconds(3599));
  EXPECT_TRUE(store_->Reap()->empty());
  EXPECT_TRUE(store_->Resolve("alice", "twinkle://run-alice/sampler_weights/short", "").ok());
  clock_.Advance(absl::Seconds(1));
  // Due but not reaped yet: already not found.
  EXPECT_TRUE(absl::IsNotFound(store_->Resolve("alice", "twinkle://run-alice/sampler_weights/short", "").status()));
  absl::StatusOr<std::vector<std::string>> reaped = store_->Reap();
  ASSERT_TRUE(reaped.ok());
  EXPECT_THAT(*reaped, ::testing::ElementsAre("run-alice/sampler_weights/short"));
  EXPECT_FALSE(fs::exists(c->path));
  EXPECT_TRUE(absl::IsNotFound(registry_->GetCheckpoint("alice", "run-alice", "sampler_weights/short").status()));
  EXPECT_TRUE(store_->Resolve("alice", "twinkle://run-alice/sampler_weights/keep", "").ok());
}

TEST_F(CheckpointRetentionTest, SetTtlValidatesAndIsOwnerOnly) {
  ASSERT_TRUE(Write("alice", "c").ok());
  for (int64_t bad : {int64_t{0}, int64_t{-1}, kMaxTtlSeconds + 1}) {
    absl::Status s = store_->SetTtl("alice", "run-alice", "sampler_weights/c", bad);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_THAT(s.message(), HasSubstr("ttl_seconds"));
  }
  EXPECT_TRUE(absl::IsNotFound(store_->SetTtl("bob", "run-alice", "sampler_weights/c", 60)));
  ASSERT_TRUE(store_->SetTtl("alice", "run-alice", "sampler_weights/c", 60).ok());
  clock_.Advance(absl::Seconds(30));
  ASSERT_TRUE(store_->SetTtl("alice", "run-alice", "sampler_weights/c", std::nullopt).ok());
  clock_.Advance(absl::Hours(1000));
  EXPECT_TRUE(store_->Reap()->empty());
  EXPECT_TRUE(absl::IsInvalidArgument(Write("alice", "neg", -5).status()));
}

TEST_F(CheckpointRetentionTest, ATtlSurvivesReRegistrationFromTheDirectory) {
  // One saved with a TTL, one given a TTL later, one whose TTL was cleared, one without.
  ASSERT_TRUE(Write("alice", "saved", 3600).ok());
  ASSERT_TRUE(Write("alice", "set").ok());
  ASSERT_TRUE(Write("alice", "cleared", 60).ok());
  ASSERT_TRUE(Write("alice", "none").ok());
  const absl::Time created = clock_.Now();
  clock_.Advance(absl::Seconds(10));
  ASSERT_TRUE(store_->SetTtl("alice", "run-alice", "sampler_weights/set", 7200).ok());
  ASSERT_TRUE(store_->SetTtl("alice", "run-alice", "sampler_weights/cleared", std::nullopt).ok());
  const std::map<std::string, std::optional<absl::Time>> want = {
      {"sampler_weights/saved", created + absl::Seconds(3600)},
      {"sampler_weights/set", created + absl::Seconds(10 + 7200)},
      {"sampler_weights/cleared", std::nullopt},
      {"sampler_weights/none", std::nullopt}};
  // The registry loses the rows (a restore from an older backup); the directories stay.
  for (const auto& [id, expires] : want) ASSERT_TRUE(registry_->DeleteCheckpoint("alice", "run-alice", id).ok());
  absl::StatusOr<std::vector<std::string>> changes = store_->Recover();
  ASSERT_TRUE(changes.ok()) << changes.status();
  EXPECT_EQ(changes->size(), want.size());
  for (const auto& [id, expires] : want) {
    absl::StatusOr<registry::CheckpointRecord> c = registry_->GetCheckpoint("alice", "run-alice", id);
    ASSERT_TRUE(c.ok()) << id << ": " << c.status();
    EXPECT_EQ(c->expires, expires) << id;
    EXPECT_EQ(c->created, created) << id;
    // The metadata update kept the files verifiable.
    EXPECT_TRUE(store_->ListFiles(*c).ok()) << id;
  }
  // And the restored expiry is enforced: the reaper deletes the first one when it is due.
  clock_.Advance(absl::Seconds(3600));
  absl::StatusOr<std::vector<std::string>> reaped = store_->Reap();
  ASSERT_TRUE(reaped.ok());
  EXPECT_THAT(*reaped, ::testing::ElementsAre("run-alice/sampler_weights/saved"));
}

TEST_F(CheckpointRetentionTest, QuotaIsDecidedBeforeWritingAtLimitPlusOne) {
  // Each checkpoint is 100 + 2 bytes (weights + "{}").
  StorageQuotas q;
  q.by_tenant["alice"] = 204;
  q.by_tenant["bob"] = 203;
  store_->SetQuotas(q);
  ASSERT_TRUE(Write("alice", "a1").ok());
  ASSERT_TRUE(Write("alice", "a2").ok());  // exactly at the quota
  ASSERT_TRUE(Write("bob", "b1").ok());
  absl::StatusOr<registry::CheckpointRecord> refused = Write("bob", "b2");  // quota + 1
  ASSERT_TRUE(absl::IsFailedPrecondition(refused.status())) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("quota of 203 bytes"));
  EXPECT_THAT(refused.status().message(), HasSubstr("uses 102 bytes"));
  EXPECT_FALSE(fs::exists(dir_ / "data" / "tenants" / "bob" / "runs" / "run-bob" / "sampler_weights" / "b2"));
  // A copy past the quota is refused before its caller records anything (before_write).
  bool recorded = false;
  absl::StatusOr<registry::CheckpointRecord> b1 = registry_->GetCheckpoint("bob", "run-bob", "sampler_weights/b1");
  ASSERT_TRUE(b1.ok());
  absl::StatusOr<registry::CheckpointRecord> copy =
      store_->Copy("bob", *b1, "run-bob", CheckpointKind::kSampler, "b3", std::nullopt, [&] {
        recorded = true;
        return absl::OkStatus();
      });
  EXPECT_TRUE(absl::IsFailedPrecondition(copy.status())) << copy.status();
  EXPECT_FALSE(recorded);
  // Replacing a checkpoint counts only the difference.
  EXPECT_TRUE(Write("bob", "b1").ok());
  EXPECT_EQ(*store_->StorageBytes("bob"), 102);
}

TEST_F(CheckpointRetentionTest, ConcurrentWritersOfOneTenantNeverPassTheQuotaTogether) {
  StorageQuotas q;
  q.by_tenant["alice"] = 5 * 102 - 1;  // room for four 102-byte checkpoints
  store_->SetQuotas(q);
  std::vector<std::thread> writers;
  std::atomic<int> accepted{0}, refused{0};
  for (int i = 0; i < 8; ++i) {
    writers.emplace_back([&, i] {
      absl::StatusOr<registry::CheckpointRecord> r = Write("alice", "c" + std::to_string(i));
      (r.ok() ? accepted : refused)++;
      if (!r.ok()) EXPECT_TRUE(absl::IsFailedPrecondition(r.status())) << r.status();
    });
  }
  for (std::thread& t : writers) t.join();
  EXPECT_EQ(accepted.load(), 4);
  EXPECT_EQ(refused.load(), 4);
  EXPECT_EQ(*store_->StorageBytes("alice"), 4 * 102);
}

TEST_F(CheckpointRetentionTest, PublishedCheckpointsResolveForOthersUntilUnpublished) {
  ASSERT_TRUE(Write("alice", "p").ok());
  const std::string path = "twinkle://run-alice/sampler_weights/p";
  EXPECT_TRUE(absl::IsNotFound(store_->Resolve("bob", path, "").status()));
  ASSERT_TRUE(registry_->SetCheckpointPublished("alice", "run-alice", "sampler_weights/p", true).ok());
  absl::StatusOr<registry::CheckpointRecord> shared = store_->Resolve("bob", path, "");
  ASSERT_TRUE(shared.ok());
  EXPECT_EQ(shared->tenant, "alice");
  EXPECT_TRUE(absl::IsNotFound(store_->Delete("bob", "run-alice", "sampler_weights/p")));  // read-only
  absl::StatusOr<registry::CheckpointRecord> copy =
      store_->Copy("bob", *shared, "run-bob", CheckpointKind::kSampler, "mine", std::nullopt);
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_EQ(copy->tenant, "bob");
  EXPECT_EQ(*store_->ReadListedFile(*copy, "adapter_model.safetensors"), std::string(100, 'x'));
  ASSERT_TRUE(registry_->SetCheckpointPublished("alice", "run-alice", "sampler_weights/p", false).ok());
  EXPECT_TRUE(absl::IsNotFound(store_->Resolve("bob", path, "").status()));
}

TEST_F(CheckpointRetentionTest, ImportValidatesAgainstTheBaseModelAndRescalesToOurAlpha) {
  auto import = [&](const std::map<std::string, storage::TensorBytes>& t, const json& config) {
    absl::StatusOr<std::string> bytes = storage::SerializeSafetensors(t);
    EXPECT_TRUE(bytes.ok());
    return store_->ImportPeftAdapter("alice", "run-alice", "imp", *bytes, config, Base(), 8, std::nullopt,
                                      [](const LoraArgs&) { return absl::OkStatus(); });
  };
  // alpha 16 at r 2 = scale 8; ours is 32 / 2 = 16: B is halved.
  absl::StatusOr<registry::CheckpointRecord> ok = import(AttnAdapter(1.0f), PeftConfig(16));
  ASSERT_TRUE(ok.ok()) << ok.status();
  absl::StatusOr<LoadedCheckpoint> loaded = store_->Load(*ok, false);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->lora.rank, 2);
  EXPECT_EQ(loaded->lora.alpha, kDefaultLoraAlpha);
  const ipc::TensorDesc& b = loaded->weights.at("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight");
  float first;
  std::memcpy(&first, loaded->buffers[b.frame].data(), sizeof first);
  EXPECT_FLOAT_EQ(first, 0.5f);

  auto expect_refused = [&](const std::map<std::string, storage::TensorBytes>& t, const json& config,
                            const std::string& needle) {
    absl::StatusOr<registry::CheckpointRecord> r = import(t, config);
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << needle << ": " << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr(needle));
  };
  const std::string q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
  auto wrong_shape = AttnAdapter(1.0f);
  wrong_shape[q_a] = {"F32", {2, 7}, F32({2, 7}, 0.5f)};
  expect_refused(wrong_shape, PeftConfig(16), "expected [2, 8]");
  auto missing = AttnAdapter(1.0f);
  missing.erase("base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight");
  expect_refused(missing, PeftConfig(16), "lora_A is missing");
  auto partial = AttnAdapter(1.0f);
  for (const char* m : {"k_proj", "o_proj"}) {
    partial.erase(std::string("base_model.model.model.layers.0.self_attn.") + m + ".lora_A.weight");
    partial.erase(std::string("base_model.model.model.layers.0.self_attn.") + m + ".lora_B.weight");
  }
  expect_refused(partial, PeftConfig(16), "k_proj' of the base model is missing");
  auto unknown = AttnAdapter(1.0f);
  unknown["base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"] = {"F32", {2, 8}, F32({2, 8}, 0.5f)};
  expect_refused(unknown, PeftConfig(16), "no 2-D weight 'model.layers.3.self_attn.q_proj.weight'");
  auto norm = AttnAdapter(1.0f);
  norm["base_model.model.model.layers.0.input_layernorm.lora_A.weight"] = {"F32", {2, 8}, F32({2, 8}, 0.5f)};
  expect_refused(norm, PeftConfig(16), "input_layernorm");
  json dora = PeftConfig(16);
  dora["use_dora"] = true;
  expect_refused(AttnAdapter(1.0f), dora, "use_dora");
  json big = PeftConfig(16);
  big["r"] = 9;
  expect_refused(AttnAdapter(1.0f), big, "adapter_config.r");
  // Nothing but the first import was written.
  EXPECT_EQ(registry_->ListCheckpoints("alice", "run-alice")->size(), 1u);
}

}  // namespace
}  // namespace twinkle::training
