#include "core/common/log.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

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

TEST(LogTest, JsonEscapingKeepsOneValidObjectPerLine) {
  EXPECT_EQ(JsonEscapeForLog("plain"), "plain");
  EXPECT_EQ(JsonEscapeForLog("a\"b\\c\nd\x01"), "a\\\"b\\\\c\\nd\\u0001");
  EXPECT_EQ(JsonEscapeForLog("模型 é"), "模型 é");  // valid UTF-8 passes through
  // Invalid UTF-8 (a lone continuation byte, a truncated sequence, an overlong form) becomes
  // U+FFFD, so a line always decodes.
  EXPECT_EQ(JsonEscapeForLog("x\x80y"), "x\\ufffdy");
  EXPECT_EQ(JsonEscapeForLog("\xe6\xa8"), "\\ufffd\\ufffd");
  EXPECT_EQ(JsonEscapeForLog("\xc0\xaf"), "\\ufffd\\ufffd");
}

TEST(LogTest, JsonFormatWritesObjectsWithRequestFields) {
  SetLogFormat(LogFormat::kJson);
  testing::internal::CaptureStderr();
  Log(LogLevel::kWarning, "comp", "bad\n\"name\"");
  LogRequest(LogLevel::kInfo, "http", {"abc123", "alice", "POST /api/v1/x", "200", 0.0125});
  LogRequest(LogLevel::kInfo, "grpc", {"def", "", "", "OK", -1});
  LogRequest(LogLevel::kDebug, "http", {"dropped", "", "GET /healthz", "200", 0});  // below info
  const std::string out = testing::internal::GetCapturedStderr();
  SetLogFormat(LogFormat::kText);
  const std::vector<std::string> lines = absl::StrSplit(absl::StripSuffix(out, "\n"), '\n');
  ASSERT_EQ(lines.size(), 3u) << out;
  EXPECT_TRUE(absl::StartsWith(lines[0], "{\"time\":\"")) << lines[0];
  EXPECT_TRUE(absl::EndsWith(lines[0], ",\"level\":\"warning\",\"component\":\"comp\",\"msg\":\"bad\\n\\\"name\\\"\"}"))
      << lines[0];
  EXPECT_TRUE(absl::EndsWith(lines[1], ",\"level\":\"info\",\"component\":\"http\",\"msg\":\"request\",\"request_id\":"
                                       "\"abc123\",\"tenant\":\"alice\",\"op\":\"POST /api/v1/x\",\"outcome\":\"200\","
                                       "\"duration_ms\":12.500}"))
      << lines[1];
  // Unknown tenant and duration are left out, not written empty.
  EXPECT_TRUE(absl::EndsWith(lines[2], "\"request_id\":\"def\",\"op\":\"\",\"outcome\":\"OK\"}")) << lines[2];
}

TEST(LogTest, TextRequestLinesAreKeyValuePairs) {
  testing::internal::CaptureStderr();
  LogRequest(LogLevel::kInfo, "http", {"abc", "t1", "GET /x", "404", 0.001});
  const std::string out = testing::internal::GetCapturedStderr();
  EXPECT_NE(out.find(" INFO  [http] request request_id=abc tenant=t1 op=\"GET /x\" outcome=404 duration_ms=1.000\n"),
            std::string::npos)
      << out;
}

TEST(LogTest, RequestIds) {
  const std::string a = NewRequestId(), b = NewRequestId();
  EXPECT_EQ(a.size(), 16u);
  EXPECT_NE(a, b);
  EXPECT_TRUE(IsValidRequestId(a));
  EXPECT_TRUE(IsValidRequestId("trace-42.a_b:C"));
  EXPECT_TRUE(IsValidRequestId(std::string(64, 'x')));
  EXPECT_FALSE(IsValidRequestId(std::string(65, 'x')));
  EXPECT_FALSE(IsValidRequestId(""));
  EXPECT_FALSE(IsValidRequestId("a b"));
  EXPECT_FALSE(IsValidRequestId("a\nb"));
  EXPECT_FALSE(IsValidRequestId("a\"b"));
}

TEST(LogTest, FormatNames) {
  LogFormat f = LogFormat::kText;
  EXPECT_TRUE(ParseLogFormat("json", &f));
  EXPECT_EQ(f, LogFormat::kJson);
  EXPECT_TRUE(ParseLogFormat("text", &f));
  EXPECT_EQ(f, LogFormat::kText);
  EXPECT_FALSE(ParseLogFormat("JSON", &f));
}

}  // namespace
}  // namespace twinkle
