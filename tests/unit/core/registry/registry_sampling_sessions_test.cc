// The registry's open sampling sessions (v5): what the sampler reopens after a restart.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "core/registry/registry.h"
#include "tests/unit/core/storage/temp_dir.h"

namespace twinkle::registry {
namespace {

class SamplingSessionsTest : public ::testing::Test {
 protected:
  std::unique_ptr<Registry> Open() {
    absl::StatusOr<std::unique_ptr<Registry>> r = Registry::Open((dir_.path() / "registry.sqlite").string());
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? std::move(*r) : nullptr;
  }
  static SamplingSessionRecord Record(const std::string& id, const std::string& tenant, const std::string& path,
                                      bool live, int64_t created_s) {
    SamplingSessionRecord r;
    r.id = id;
    r.tenant = tenant;
    r.model_path = path;
    r.owner = live ? "s1-00000000" : "";
    r.live = live;
    r.created = absl::FromUnixSeconds(created_s);
    return r;
  }
  storage::testing::TempDir dir_;
};

std::vector<std::string> Ids(const std::vector<SamplingSessionRecord>& records) {
  std::vector<std::string> ids;
  for (const SamplingSessionRecord& r : records) ids.push_back(r.tenant + "/" + r.id);
  return ids;
}

TEST_F(SamplingSessionsTest, RowsOutliveTheConnectionAndListOldestFirst) {
  {
    std::unique_ptr<Registry> reg = Open();
    ASSERT_TRUE(reg->PutSamplingSession(Record("sampler-b-1", "bob", "", false, 20)).ok());
    ASSERT_TRUE(reg->PutSamplingSession(Record("sampler-a-1", "alice", "twinkle://run-1/sampler_weights/w", false, 10))
                    .ok());
    ASSERT_TRUE(reg->PutSamplingSession(Record("sampler-a-2", "alice", "", true, 30)).ok());
  }
  std::unique_ptr<Registry> reg = Open();  // as after a restart
  absl::StatusOr<std::vector<SamplingSessionRecord>> all = reg->ListSamplingSessions();
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_THAT(Ids(*all), ::testing::ElementsAre("alice/sampler-a-1", "bob/sampler-b-1", "alice/sampler-a-2"));
  EXPECT_EQ((*all)[0].model_path, "twinkle://run-1/sampler_weights/w");
  EXPECT_FALSE((*all)[0].live);
  EXPECT_TRUE((*all)[2].live);
  EXPECT_EQ((*all)[2].owner, "s1-00000000");
  EXPECT_EQ((*all)[1].created, absl::FromUnixSeconds(20));
}

TEST_F(SamplingSessionsTest, AnotherTenantsIdIsNeitherReplacedNorDeleted) {
  std::unique_ptr<Registry> reg = Open();
  ASSERT_TRUE(reg->PutSamplingSession(Record("sampler-x", "alice", "", false, 1)).ok());
  absl::Status taken = reg->PutSamplingSession(Record("sampler-x", "bob", "twinkle://r/sampler_weights/b", false, 2));
  EXPECT_EQ(taken.code(), absl::StatusCode::kAlreadyExists) << taken;
  EXPECT_THAT(std::string(taken.message()), ::testing::Not(::testing::HasSubstr("alice")));
  EXPECT_TRUE(reg->DeleteSamplingSession("sampler-x", "bob").ok());  // not bob's: nothing happens
  absl::StatusOr<std::vector<SamplingSessionRecord>> all = reg->ListSamplingSessions();
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->size(), 1u);
  EXPECT_EQ((*all)[0].tenant, "alice");
  EXPECT_EQ((*all)[0].model_path, "");
  // The owner replaces its own row; deleting it (twice: a release racing a cleanup) is OK.
  ASSERT_TRUE(reg->PutSamplingSession(Record("sampler-x", "alice", "twinkle://r/sampler_weights/a", false, 3)).ok());
  EXPECT_EQ(reg->ListSamplingSessions()->at(0).model_path, "twinkle://r/sampler_weights/a");
  EXPECT_TRUE(reg->DeleteSamplingSession("sampler-x", "alice").ok());
  EXPECT_TRUE(reg->DeleteSamplingSession("sampler-x", "alice").ok());
  EXPECT_TRUE(reg->ListSamplingSessions()->empty());
}

TEST_F(SamplingSessionsTest, EmptyIdOrTenantIsRefused) {
  std::unique_ptr<Registry> reg = Open();
  EXPECT_EQ(reg->PutSamplingSession(Record("", "alice", "", false, 1)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reg->PutSamplingSession(Record("sampler-1", "", "", false, 1)).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace twinkle::registry
