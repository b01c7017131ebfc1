#include "core/storage/names.h"

#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace twinkle::storage {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(ValidatePathNameTest, AcceptsNormalNames) {
  for (const std::string& name : std::vector<std::string>{"a", "ckpt", "step-100", "run_2024.11.30", "A-Z_a-z.0-9", "x.", "a..b", "-lead", "_x",
        std::string(128, 'n')}) {
    EXPECT_TRUE(ValidatePathName(name, "checkpoint name").ok()) << name;
  }
}

TEST(ValidatePathNameTest, RejectsEverythingElse) {
  const std::string cases[] = {
      "",         "../x",      "a/b",       "/abs",          std::string("x\0y", 3),
      "a\nb",     "tab\there", "bell\a",    "del\x7f",       std::string(129, 'n'),
      std::string(300, 'n'),   ".",         "..",            ".hidden",
      "a b",      "a\\b",      "caf\xc3\xa9", "x:y",         "*",
  };
  for (const std::string& name : cases) {
    absl::Status s = ValidatePathName(name, "run id");
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << "'" << name << "' " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("run id")) << name;
  }
}

TEST(ValidatePathNameTest, MessagesQuoteEscapedAndTruncated) {
  absl::Status nul = ValidatePathName(std::string("x\0y", 3), "name");
  EXPECT_THAT(std::string(nul.message()), HasSubstr("'x\\x00y'"));
  EXPECT_THAT(std::string(nul.message()), Not(HasSubstr(std::string(1, '\0'))));
  absl::Status ctl = ValidatePathName("a\nb\x1b", "name");
  EXPECT_THAT(std::string(ctl.message()), HasSubstr("'a\\nb\\x1b'"));
  EXPECT_THAT(std::string(ctl.message()), Not(HasSubstr("\n")));

  absl::Status longname = ValidatePathName(std::string(300, 'n'), "name");
  EXPECT_THAT(std::string(longname.message()), HasSubstr("300 characters"));
  EXPECT_THAT(std::string(longname.message()), HasSubstr("at most 128"));
  EXPECT_LT(longname.message().size(), 200u);

  EXPECT_THAT(std::string(ValidatePathName(".hidden", "name").message()), HasSubstr("start with '.'"));
  EXPECT_THAT(std::string(ValidatePathName("..", "name").message()), HasSubstr("'.' or '..'"));
  EXPECT_THAT(std::string(ValidatePathName("", "name").message()), HasSubstr("empty"));
  EXPECT_THAT(std::string(ValidatePathName("a/b", "name").message()), HasSubstr("A-Z a-z 0-9 . _ -"));
}

TEST(IsInsideTest, Lexical) {
  const std::filesystem::path root = "/data/tenants/t1";
  EXPECT_TRUE(IsInside(root, "/data/tenants/t1/ckpt"));
  EXPECT_TRUE(IsInside(root, "/data/tenants/t1/a/b/c"));
  EXPECT_TRUE(IsInside("/data/tenants/t1/", "/data/tenants/t1/ckpt"));
  EXPECT_TRUE(IsInside(root, "/data/tenants/t1/./x"));
  EXPECT_TRUE(IsInside(root, "/data/tenants/t1/a/../b"));
  EXPECT_TRUE(IsInside(root, "/data/tenants/t2/../t1/x"));
  EXPECT_TRUE(IsInside("/data/./tenants//t1", "/data/tenants/t1/x"));
  EXPECT_TRUE(IsInside("/", "/x"));
  EXPECT_TRUE(IsInside("rel/root", "rel/root/x"));

  EXPECT_FALSE(IsInside(root, root)) << "the root itself is not inside";
  EXPECT_FALSE(IsInside(root, "/data/tenants/t1/"));
  EXPECT_FALSE(IsInside(root, "/data/tenants/t1/x/.."));
  EXPECT_FALSE(IsInside(root, "/data/tenants/t1/.."));
  EXPECT_FALSE(IsInside(root, "/data/tenants/t1/../t2/x"));
  EXPECT_FALSE(IsInside(root, "/data/tenants/t1/a/../../t2"));
  EXPECT_FALSE(IsInside(root, "/data/tenants/t10/x")) << "prefix of a component is not a parent";
  EXPECT_FALSE(IsInside(root, "/data/tenants"));
  EXPECT_FALSE(IsInside(root, "/etc/passwd"));
  EXPECT_FALSE(IsInside(root, "ckpt")) << "relative path, absolute root";
  EXPECT_FALSE(IsInside("rel/root", "/rel/root/x"));
  EXPECT_FALSE(IsInside("rel/root", "rel/root/../../x"));
  EXPECT_FALSE(IsInside("", "/x"));
  EXPECT_FALSE(IsInside(root, ""));
}

}  // namespace
}  // namespace twinkle::storage
