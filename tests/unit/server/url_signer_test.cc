// UrlSigner: HMAC-SHA256 signatures of download URLs, constant-time verification, and the
// generated key kept in a 0600 file across restarts.
#include "server/tinker/url_signer.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "absl/status/status.h"

namespace twinkle::tinker {
namespace {

namespace fs = std::filesystem;

class UrlSignerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "twinkle-signer-XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  fs::path dir_;
};

TEST_F(UrlSignerTest, SignsAndVerifiesAndAnyChangeFails) {
  absl::StatusOr<std::unique_ptr<UrlSigner>> s = UrlSigner::Create(std::string(64, 'a'), "");
  ASSERT_TRUE(s.ok()) << s.status();
  const std::string m = UrlSigner::Message("alice", "run", "external_weights/x", "adapter_config.json", 1700000000);
  const std::string sig = (*s)->Sign(m);
  EXPECT_EQ(sig.size(), 64u);  // hex of 32 bytes
  EXPECT_TRUE((*s)->Verify(m, sig));
  EXPECT_FALSE((*s)->Verify(UrlSigner::Message("bob", "run", "external_weights/x", "adapter_config.json", 1700000000), sig));
  EXPECT_FALSE((*s)->Verify(UrlSigner::Message("alice", "run", "external_weights/x", "adapter_config.json", 1700000001), sig));
  EXPECT_FALSE((*s)->Verify(UrlSigner::Message("alice", "run", "external_weights/x", "adapter_model.safetensors", 1700000000), sig));
  std::string flipped = sig;
  flipped.back() = flipped.back() == '0' ? '1' : '0';
  EXPECT_FALSE((*s)->Verify(m, flipped));
  EXPECT_FALSE((*s)->Verify(m, sig.substr(1)));
  EXPECT_FALSE((*s)->Verify(m, ""));
  // Another secret signs differently.
  absl::StatusOr<std::unique_ptr<UrlSigner>> other = UrlSigner::Create(std::string(64, 'b'), "");
  ASSERT_TRUE(other.ok());
  EXPECT_FALSE((*other)->Verify(m, sig));
}

TEST_F(UrlSignerTest, ConfiguredSecretMustBeHexOfAtLeast32Bytes) {
  EXPECT_TRUE(absl::IsInvalidArgument(UrlSigner::Create(std::string(62, 'a'), "").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(UrlSigner::Create(std::string(64, 'g'), "").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(UrlSigner::Create(std::string(65, 'a'), "").status()));
}

TEST_F(UrlSignerTest, GeneratedKeyIsPersistedPrivateAndReused) {
  const std::string file = (dir_ / "url_signing.key").string();
  absl::StatusOr<std::unique_ptr<UrlSigner>> first = UrlSigner::Create("", file);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(fs::exists(file));
  struct stat st;
  ASSERT_EQ(stat(file.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600);
  EXPECT_EQ(fs::file_size(file), 32u);
  const std::string m = UrlSigner::Message("alice", "r", "weights/c", "f", 1);
  absl::StatusOr<std::unique_ptr<UrlSigner>> again = UrlSigner::Create("", file);  // a restart
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE((*again)->Verify(m, (*first)->Sign(m)));
  // A truncated key file is refused, not silently replaced.
  std::ofstream(file, std::ios::trunc) << "short";
  EXPECT_TRUE(absl::IsFailedPrecondition(UrlSigner::Create("", file).status()));
}

}  // namespace
}  // namespace twinkle::tinker
