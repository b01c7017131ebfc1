#include "server/config/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace twinkle {
namespace {

using ::testing::HasSubstr;

constexpr char kValid[] = R"(server:
  host: 127.0.0.1
  grpc_port: 50051
  http_port: 8000
model:
  path: ../models/tiny
engine:
  devices: [cpu, cpu]
limits:
  max_lora_rank: 32
)";

absl::StatusOr<Config> Parse(const std::string& yaml) {
  return ParseConfig(yaml, "/etc/twinkle/test.yaml");
}

std::string ErrorOf(const std::string& yaml) {
  absl::StatusOr<Config> c = Parse(yaml);
  EXPECT_FALSE(c.ok()) << "expected an error for:\n" << yaml;
  return c.ok() ? "" : std::string(c.status().message());
}

TEST(ConfigTest, ValidFileFillsDefaultsAndResolvesPaths) {
  absl::StatusOr<Config> c = Parse(kValid);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->server.grpc_port, 50051);
  EXPECT_EQ(c->server.drain_timeout_s, 10);
  EXPECT_EQ(c->model.path, "/etc/models/tiny");
  EXPECT_EQ(c->model.name, "tiny");
  EXPECT_EQ(c->model.dtype, "float32");
  EXPECT_EQ(c->engine.devices, (std::vector<std::string>{"cpu", "cpu"}));
  EXPECT_EQ(c->engine.heartbeat_timeout_ms, 3000);
  EXPECT_EQ(c->limits.max_lora_rank, 32);
  EXPECT_EQ(c->limits.max_adapters, 64);
}

TEST(ConfigTest, UnknownKeyNamesFileLineAndKey) {
  const std::string e = ErrorOf("server:\n  host: 127.0.0.1\n  grpc_prot: 1\nmodel:\n  path: m\n");
  EXPECT_THAT(e, HasSubstr("/etc/twinkle/test.yaml:3: server.grpc_prot: unknown key"));
  EXPECT_THAT(e, HasSubstr("grpc_port"));  // lists the keys that do exist
}

TEST(ConfigTest, UnknownTopLevelSection) {
  EXPECT_THAT(ErrorOf("model:\n  path: m\nservre:\n  host: x\n"),
              HasSubstr("test.yaml:3: servre: unknown key"));
}

TEST(ConfigTest, WrongTypeIsNamed) {
  EXPECT_THAT(ErrorOf("model:\n  path: m\nserver:\n  grpc_port: fifty\n"),
              HasSubstr("test.yaml:4: server.grpc_port: expected an integer, got 'fifty'"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nengine:\n  devices: cpu\n"),
              HasSubstr("test.yaml:4: engine.devices: expected a list of strings"));
  EXPECT_THAT(ErrorOf("model: [a, b]\n"), HasSubstr("test.yaml:1: model: expected a mapping"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nserver:\n  drain_timeout_s: soon\n"),
              HasSubstr("server.drain_timeout_s: expected a number"));
}

TEST(ConfigTest, OutOfRangeIsNamed) {
  EXPECT_THAT(ErrorOf("model:\n  path: m\nserver:\n  http_port: 70000\n"),
              HasSubstr("test.yaml:4: server.http_port: 70000 is out of range [0, 65535]"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nlimits:\n  max_lora_rank: 0\n"),
              HasSubstr("limits.max_lora_rank: 0 is out of range"));
}

TEST(ConfigTest, EnumValueIsChecked) {
  EXPECT_THAT(ErrorOf("model:\n  path: m\n  dtype: float8\n"),
              HasSubstr("test.yaml:3: model.dtype: 'float8' is not one of: float32, bfloat16, float16"));
}

TEST(ConfigTest, MissingModelPath) {
  EXPECT_THAT(ErrorOf("server:\n  host: 127.0.0.1\n"), HasSubstr("model.path: required key is missing"));
}

TEST(ConfigTest, InvalidYamlReportsLine) {
  EXPECT_THAT(ErrorOf("model:\n  path: [unclosed\n"), HasSubstr("test.yaml:"));
  EXPECT_THAT(ErrorOf("model:\n  path: [unclosed\n"), HasSubstr("invalid YAML"));
}

TEST(ConfigTest, NonLoopbackWithoutAuthIsRefused) {
  EXPECT_THAT(ErrorOf("model:\n  path: m\nserver:\n  host: 0.0.0.0\n"),
              HasSubstr("test.yaml:4: server.host: refusing to bind non-loopback address '0.0.0.0'"));
  EXPECT_TRUE(Parse("model:\n  path: m\nserver:\n  host: ::1\n").ok());
  EXPECT_TRUE(Parse("model:\n  path: m\nserver:\n  host: 127.0.0.5\n").ok());
}

TEST(ConfigTest, CrossFieldChecks) {
  EXPECT_THAT(ErrorOf("model:\n  path: m\nengine:\n  devices: [gpu0]\n"),
              HasSubstr("engine.devices: 'gpu0' is not a device"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nengine:\n  heartbeat_interval_ms: 1000\n  heartbeat_timeout_ms: 1500\n"),
              HasSubstr("engine.heartbeat_timeout_ms: must exceed twice heartbeat_interval_ms"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nserver:\n  tls:\n    cert_file: c.pem\n"),
              HasSubstr("server.tls: set both cert_file and key_file"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nserver:\n  grpc_port: 9000\n  http_port: 9000\n"),
              HasSubstr("server.http_port: must differ from grpc_port"));
}

TEST(ConfigTest, SeveralErrorsAreReportedTogether) {
  const std::string e = ErrorOf("model:\n  path: m\n  colour: red\nserver:\n  grpc_port: -1\n");
  EXPECT_THAT(e, HasSubstr("model.colour: unknown key"));
  EXPECT_THAT(e, HasSubstr("server.grpc_port: -1 is out of range"));
}

TEST(ConfigTest, RenderMasksSecretsAndRoundTrips) {
  absl::StatusOr<Config> c = Parse(
      "model:\n  path: m\nserver:\n  tls:\n    cert_file: c.pem\n    key_file: k.pem\n");
  ASSERT_TRUE(c.ok()) << c.status();
  const std::string yaml = RenderConfig(*c, ConfigFormat::kYaml);
  EXPECT_THAT(yaml, HasSubstr("key_file: \"***\""));
  EXPECT_THAT(yaml, Not(HasSubstr("k.pem")));
  EXPECT_THAT(yaml, HasSubstr("heartbeat_timeout_ms: 3000"));
  const std::string json = RenderConfig(*c, ConfigFormat::kJson);
  EXPECT_THAT(json, HasSubstr("\"grpc_port\": 50051"));
  EXPECT_THAT(json, HasSubstr("\"key_file\": \"***\""));

  // The rendered YAML (without the masked secret) parses back to the same values.
  absl::StatusOr<Config> plain = Parse("model:\n  path: m\n");
  ASSERT_TRUE(plain.ok());
  absl::StatusOr<Config> again = Parse(RenderConfig(*plain, ConfigFormat::kYaml));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(RenderConfig(*again, ConfigFormat::kJson), RenderConfig(*plain, ConfigFormat::kJson));
}

TEST(ConfigTest, LoopbackHosts) {
  EXPECT_TRUE(IsLoopbackHost("127.0.0.1"));
  EXPECT_TRUE(IsLoopbackHost("localhost"));
  EXPECT_TRUE(IsLoopbackHost("::1"));
  EXPECT_FALSE(IsLoopbackHost("0.0.0.0"));
  EXPECT_FALSE(IsLoopbackHost("10.0.0.1"));
  EXPECT_FALSE(IsLoopbackHost("example.com"));
}

}  // namespace
}  // namespace twinkle
