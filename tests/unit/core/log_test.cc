#include "core/common/log.h"

#include <gtest/gtest.h>

namespace twinkle {
namespace {

TEST(LogTest, ControlCharactersAndBackslashesAreEscapedSoALineStaysOneLine) {
  EXPECT_EQ(EscapeForLog("plain name-1.x"), "plain name-1.x");
  // A client string that tries to end the line and forge the next one.
  EXPECT_EQ(EscapeForLog("x\n2026-01-01T00:00:00.000Z ERROR [auth] forged"),
            "x\\n2026-01-01T00:00:00.000Z ERROR [auth] forged");
  EXPECT_EQ(EscapeForLog("a\rb\tc"), "a\\rb\\tc");
  EXPECT_EQ(EscapeForLog(std::string("\x1b[31mred\x7f\0", 10)), "\\x1b[31mred\\x7f\\x00");
  // Backslashes are doubled, so an escaped newline cannot be told apart from a sent "\n".
  EXPECT_EQ(EscapeForLog("C:\\n"), "C:\\\\n");
  // UTF-8 passes through as it is.
  EXPECT_EQ(EscapeForLog("模型 é"), "模型 é");
}

TEST(LogTest, LogWritesOneEscapedLine) {
  testing::internal::CaptureStderr();
  Log(LogLevel::kError, "comp\nonent", "bad\nname");
  const std::string out = testing::internal::GetCapturedStderr();
  ASSERT_FALSE(out.empty());
  EXPECT_EQ(out.find('\n'), out.size() - 1) << out;
  EXPECT_NE(out.find("[comp\\nonent] bad\\nname"), std::string::npos) << out;
}

}  // namespace
}  // namespace twinkle
