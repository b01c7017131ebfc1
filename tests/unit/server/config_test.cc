#include "server/config/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>

#include "absl/strings/str_cat.h"

namespace twinkle {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

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
  EXPECT_THAT(ErrorOf("model:\n  path: m\nsessions:\n  max_retained_results: 0\n"),
              HasSubstr("sessions.max_retained_results: 0 is out of range"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nsessions:\n  max_retained_result_bytes: 1023\n"),
              HasSubstr("sessions.max_retained_result_bytes: 1023 is out of range"));
  absl::StatusOr<Config> c =
      Parse("model:\n  path: m\nsessions:\n  max_retained_results: 3\n  max_retained_result_bytes: 4096\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->sessions.max_retained_results, 3);
  EXPECT_EQ(c->sessions.max_retained_result_bytes, 4096);
}

TEST(ConfigTest, CollectiveTimeoutIsReadAndBounded) {
  absl::StatusOr<Config> c = Parse("model:\n  path: m\nengine:\n  devices: [cpu, cpu]\n  collective_timeout_s: 30\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->engine.collective_timeout_s, 30);
  EXPECT_EQ(Parse("model:\n  path: m\n")->engine.collective_timeout_s, 300);
  EXPECT_THAT(ErrorOf("model:\n  path: m\nengine:\n  collective_timeout_s: 0.5\n"),
              HasSubstr("engine.collective_timeout_s: 0.5 is out of range [1, 86400]"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nengine:\n  collective_timeout_s: 86401\n"),
              HasSubstr("engine.collective_timeout_s: 86401 is out of range"));
}

TEST(ConfigTest, TrainingMemoryKeysAreReadAndChecked) {
  absl::StatusOr<Config> c =
      Parse("model:\n  path: m\nengine:\n  activation_checkpointing: true\n  logit_chunk_rows: 256\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->engine.activation_checkpointing);
  EXPECT_EQ(c->engine.logit_chunk_rows, 256);
  absl::StatusOr<Config> d = Parse("model:\n  path: m\n");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE(d->engine.activation_checkpointing);
  EXPECT_EQ(d->engine.logit_chunk_rows, 0);
  EXPECT_THAT(ErrorOf("model:\n  path: m\nengine:\n  activation_checkpointing: sometimes\n"),
              HasSubstr("engine.activation_checkpointing: expected true or false, got 'sometimes'"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nengine:\n  logit_chunk_rows: -1\n"),
              HasSubstr("engine.logit_chunk_rows: -1 is out of range [0, 1e+07]"));
}

TEST(ConfigTest, ActivationMemoryBudgetIsReadAndBounded) {
  EXPECT_EQ(Parse("model:\n  path: m\n")->engine.activation_memory_mib, 0);  // no admission
  absl::StatusOr<Config> at_limit = Parse("model:\n  path: m\nengine:\n  activation_memory_mib: 10000000\n");
  ASSERT_TRUE(at_limit.ok()) << at_limit.status();
  EXPECT_EQ(at_limit->engine.activation_memory_mib, 10000000);
  EXPECT_THAT(ErrorOf("model:\n  path: m\nengine:\n  activation_memory_mib: 10000001\n"),
              HasSubstr("engine.activation_memory_mib: 10000001 is out of range [0, 1e+07]"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nengine:\n  activation_memory_mib: -1\n"),
              HasSubstr("engine.activation_memory_mib: -1 is out of range [0, 1e+07]"));
}

// Data parallelism's placement: the per-rank token budget above which an adapter's rows are
// split over the ranks, and rebalancing.
TEST(ConfigTest, RankTokenBudgetAndRebalanceAreReadAndBounded) {
  absl::StatusOr<Config> defaults = Parse("model:\n  path: m\n");
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(defaults->engine.rank_token_budget, 4096);
  EXPECT_TRUE(defaults->engine.rebalance);
  absl::StatusOr<Config> at_limit =
      Parse("model:\n  path: m\nengine:\n  rank_token_budget: 1000000000\n  rebalance: false\n");
  ASSERT_TRUE(at_limit.ok()) << at_limit.status();
  EXPECT_EQ(at_limit->engine.rank_token_budget, 1000000000);
  EXPECT_FALSE(at_limit->engine.rebalance);
  EXPECT_EQ(Parse("model:\n  path: m\nengine:\n  rank_token_budget: 0\n")->engine.rank_token_budget, 0);
  EXPECT_THAT(ErrorOf("model:\n  path: m\nengine:\n  rank_token_budget: 1000000001\n"),
              HasSubstr("engine.rank_token_budget: 1000000001 is out of range [0, 1e+09]"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nengine:\n  rank_token_budget: -1\n"),
              HasSubstr("engine.rank_token_budget: -1 is out of range [0, 1e+09]"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nengine:\n  rebalance: often\n"),
              HasSubstr("engine.rebalance: expected true or false, got 'often'"));
}

// Engines on other nodes: DEVICE@NODE in engine.devices, nodes.listen and nodes.secret_file.
TEST(ConfigTest, DevicesOnOtherNodesNeedTheNodeSocketAndALocalRankZero) {
  const std::string nodes = "nodes:\n  listen: 127.0.0.1:7800\n  secret_file: /s\n";
  absl::StatusOr<Config> ok = Parse("model:\n  path: m\nengine:\n  devices: [cpu, cuda:1@gpu-node.2]\n" + nodes);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->engine.devices[1], "cuda:1@gpu-node.2");
  EXPECT_EQ(ok->nodes.listen, "127.0.0.1:7800");
  EXPECT_TRUE(Parse("model:\n  path: m\nengine:\n  devices: [cpu@a]\n" + nodes).ok());  // one rank: anywhere
  EXPECT_THAT(ErrorOf("model:\n  path: m\nengine:\n  devices: [cpu, cpu@a]\n"),
              HasSubstr("nodes: devices on other nodes (DEVICE@NODE in engine.devices) need nodes.listen and "
                        "nodes.secret_file"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nengine:\n  devices: [cpu@a, cpu]\n" + nodes),
              HasSubstr("rank 0 ('cpu@a') serves the ranks' rendezvous and must be on this node"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nengine:\n  devices: [cpu, cpu@Bad]\n" + nodes),
              HasSubstr("'cpu@Bad': a node name is [a-z0-9][a-z0-9_.-]{0,63}"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nengine:\n  devices: [cpu, tpu@a]\n" + nodes),
              HasSubstr("'tpu@a' is not a device"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nnodes:\n  listen: 127.0.0.1\n  secret_file: /s\n"),
              HasSubstr("nodes.listen: '127.0.0.1' is not host:port"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nnodes:\n  listen: 127.0.0.1:7800\n"),
              HasSubstr("nodes.secret_file: nodes.listen needs the node secret"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nsampler:\n  devices: [cpu@a]\n" + nodes), HasSubstr("is not a device"));
  // Data parallelism across nodes needs a rendezvous address the other nodes reach.
  const std::string all = "nodes:\n  listen: 0.0.0.0:7800\n  secret_file: /s\n";
  EXPECT_THAT(ErrorOf("model:\n  path: m\nengine:\n  devices: [cpu, cpu@a]\n" + all),
              HasSubstr("nodes.rendezvous_host: nodes.listen binds '0.0.0.0': set the address other nodes reach"));
  absl::StatusOr<Config> advertised = Parse("model:\n  path: m\nengine:\n  devices: [cpu, cpu@a]\n" + all +
                                            "  rendezvous_host: coordinator.example\n  rendezvous_port: 29500\n");
  ASSERT_TRUE(advertised.ok()) << advertised.status();
  EXPECT_EQ(RendezvousHost(*advertised), "coordinator.example");
  EXPECT_EQ(advertised->nodes.rendezvous_port, 29500);
  EXPECT_EQ(RendezvousHost(*ok), "127.0.0.1");
  EXPECT_THAT(ErrorOf("model:\n  path: m\n" + nodes + "  rendezvous_port: 65536\n"),
              HasSubstr("nodes.rendezvous_port: 65536 is out of range"));
}

TEST(ConfigTest, SamplerStateSlotsAreReadAndBounded) {
  EXPECT_EQ(Parse("model:\n  path: m\n")->sampler.state_slots, 64);
  EXPECT_EQ(Parse("model:\n  path: m\nsampler:\n  state_slots: 65536\n")->sampler.state_slots, 65536);
  EXPECT_THAT(ErrorOf("model:\n  path: m\nsampler:\n  state_slots: 0\n"),
              HasSubstr("sampler.state_slots: 0 is out of range [1, 65536]"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nsampler:\n  state_slots: 65537\n"),
              HasSubstr("sampler.state_slots: 65537 is out of range"));
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

TEST(ConfigTest, SamplerDevicesDefaultToColocated) {
  absl::StatusOr<Config> c = Parse("model:\n  path: m\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->sampler.devices.empty());
  EXPECT_THAT(RenderConfig(*c, ConfigFormat::kJson), HasSubstr(R"("sampler": {
    "devices": [],)"));
}

TEST(ConfigTest, SamplerDevicesAreRead) {
  // cpu may be shared with the training workers; a GPU the trainer does not use is fine.
  absl::StatusOr<Config> cpu = Parse("model:\n  path: m\nsampler:\n  devices: [cpu]\n  kv_cache_blocks: 64\n");
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ(cpu->sampler.devices, (std::vector<std::string>{"cpu"}));
  EXPECT_EQ(cpu->sampler.kv_cache_blocks, 64);
  absl::StatusOr<Config> gpu =
      Parse("model:\n  path: m\nengine:\n  devices: [cuda:0]\nsampler:\n  devices: [cuda:1]\n");
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  EXPECT_EQ(gpu->sampler.devices, (std::vector<std::string>{"cuda:1"}));
  EXPECT_THAT(RenderConfig(*gpu, ConfigFormat::kYaml), HasSubstr("cuda:1"));
  // A pool of sampler workers: GPUs of their own, or cpu workers sharing the host.
  absl::StatusOr<Config> pool =
      Parse("model:\n  path: m\nengine:\n  devices: [cuda:0]\nsampler:\n  devices: [cuda:1, cuda:2]\n");
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ(pool->sampler.devices, (std::vector<std::string>{"cuda:1", "cuda:2"}));
  absl::StatusOr<Config> cpus = Parse("model:\n  path: m\nsampler:\n  devices: [cpu, cpu]\n");
  ASSERT_TRUE(cpus.ok()) << cpus.status();
  EXPECT_EQ(cpus->sampler.devices, (std::vector<std::string>{"cpu", "cpu"}));
}

TEST(ConfigTest, SamplerDeviceErrorsNameTheKeyAndLine) {
  // A GPU listed for training and for sampling.
  EXPECT_THAT(ErrorOf("model:\n  path: m\nengine:\n  devices: [cuda:0]\nsampler:\n  devices: [cuda:0]\n"),
              HasSubstr("test.yaml:6: sampler.devices: 'cuda:0' is also in engine.devices"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nsampler:\n  devices: [gpu1]\n"),
              HasSubstr("test.yaml:4: sampler.devices: 'gpu1' is not a device (cpu or cuda:N)"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nsampler:\n  devices: [cuda:-1]\n"),
              HasSubstr("sampler.devices: 'cuda:-1' is not a device"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nsampler:\n  devices: [cuda:1, cuda:1]\n"),
              HasSubstr("sampler.devices: 'cuda:1' is listed twice"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nsampler:\n  devices: cpu\n"),
              HasSubstr("test.yaml:4: sampler.devices: expected a list of strings"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nsampler:\n  device: [cpu]\n"),
              HasSubstr("sampler.device: unknown key"));
}

TEST(ConfigTest, SeveralErrorsAreReportedTogether) {
  const std::string e = ErrorOf("model:\n  path: m\n  colour: red\nserver:\n  grpc_port: -1\n");
  EXPECT_THAT(e, HasSubstr("model.colour: unknown key"));
  EXPECT_THAT(e, HasSubstr("server.grpc_port: -1 is out of range"));
}

TEST(ConfigTest, JwtTtlIsZeroOrAtLeastTheMinimumAndTheSecretIsMasked) {
  auto with_ttl = [](const std::string& ttl) { return absl::StrCat("model:\n  path: m\nauth:\n  jwt_ttl_s: ", ttl, "\n"); };
  EXPECT_EQ(Parse("model:\n  path: m\n")->auth.jwt_ttl_s, 3600);
  EXPECT_EQ(Parse(with_ttl("0"))->auth.jwt_ttl_s, 0);
  EXPECT_EQ(Parse(with_ttl("120"))->auth.jwt_ttl_s, 120);
  EXPECT_THAT(ErrorOf(with_ttl("119")), HasSubstr("auth.jwt_ttl_s: must be 0 (no token exchange) or at least 120"));
  EXPECT_EQ(Parse(with_ttl("604800"))->auth.jwt_ttl_s, 604800);
  EXPECT_THAT(ErrorOf(with_ttl("604801")), HasSubstr("auth.jwt_ttl_s: 604801 is out of range"));
  absl::StatusOr<Config> c = Parse(absl::StrCat("model:\n  path: m\nauth:\n  jwt_signing_secret: ", std::string(64, 'a'), "\n"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(RenderConfig(*c, ConfigFormat::kYaml), Not(HasSubstr(std::string(64, 'a'))));
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

// Found by tests/fuzz/config_yaml_fuzz: a path holding a byte that is not UTF-8 made
// `print-config --format json` terminate (nlohmann's dump threw type_error 316).
TEST(ConfigTest, RenderOfAPathThatIsNotUtf8DoesNotThrow) {
  absl::StatusOr<Config> c = Parse("model:\n  path: m\xff\xfe\n");  // raw bytes ff fe
  ASSERT_TRUE(c.ok()) << c.status();
  std::string json;
  EXPECT_NO_THROW(json = RenderConfig(*c, ConfigFormat::kJson));
  EXPECT_THAT(json, HasSubstr("\"path\": \"/etc/twinkle/m"));
  EXPECT_NO_THROW(RenderConfig(*c, ConfigFormat::kYaml));
}

TEST(ConfigTest, LoopbackHosts) {
  EXPECT_TRUE(IsLoopbackHost("127.0.0.1"));
  EXPECT_TRUE(IsLoopbackHost("localhost"));
  EXPECT_TRUE(IsLoopbackHost("::1"));
  EXPECT_FALSE(IsLoopbackHost("0.0.0.0"));
  EXPECT_FALSE(IsLoopbackHost("10.0.0.1"));
  EXPECT_FALSE(IsLoopbackHost("example.com"));
}


// ---- auth, tenants, quotas, scheduler, sessions, testing, mTLS. ----------------------------

// Two well-formed digests (64 hex digits; the second in upper case).
constexpr char kAliceDigest[] = "7c5dc9a1ae3ab6a0dc3e8bb8a2e4d1e5c93bd7bc8b0ae2a6a38d56e32a5c23a1";
constexpr char kBobDigest[] = "D2F3B8A8C7A1E4B6D0C9E8F7A6B5C4D3E2F1A0B9C8D7E6F5A4B3C2D1E0F9A8B7";

std::string AuthYaml(const std::string& extra = "") {
  return absl::StrCat(R"(model:
  path: m
limits:
  max_lora_rank: 32
  tokens_per_s: 1000
auth:
  enabled: true
  tenants:
    - id: alice
      key_sha256: [)", kAliceDigest, R"(]
      quotas:
        max_adapters: 4
        max_lora_rank: 16
    - id: bob
      key_sha256:
        - )", kBobDigest, "\n", extra);
}

TEST(ConfigTest, NewSectionsHaveDefaults) {
  absl::StatusOr<Config> c = Parse("model:\n  path: m\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->auth.enabled);
  EXPECT_TRUE(c->auth.tenants.empty());
  EXPECT_EQ(c->auth.tenants_file, "");
  EXPECT_EQ(c->limits.max_pending_ops, 256);
  EXPECT_EQ(c->limits.tokens_per_s, 0);
  EXPECT_EQ(c->limits.burst_tokens, 65536);
  EXPECT_EQ(c->scheduler.max_tokens_per_step, 8192);
  EXPECT_EQ(c->scheduler.max_ops_per_step, 64);
  EXPECT_TRUE(c->scheduler.fuse);
  EXPECT_EQ(c->scheduler.queue_cap, 64);
  EXPECT_EQ(c->scheduler.max_loras, 16);
  EXPECT_EQ(c->sessions.adapter_timeout_s, 1800);
  EXPECT_EQ(c->sessions.adapter_max_lifetime_s, 36000);
  EXPECT_EQ(c->sessions.future_retention_s, 86400);
  EXPECT_EQ(c->sessions.max_retained_results, 10000);
  EXPECT_EQ(c->sessions.max_retained_result_bytes, int64_t{256} << 20);
  EXPECT_FALSE(c->testing.hooks);
  EXPECT_EQ(c->server.tls.client_ca_file, "");
}

TEST(ConfigTest, NewKeysAreRead) {
  absl::StatusOr<Config> c = Parse(R"(model:
  path: m
scheduler:
  max_tokens_per_step: 100
  max_ops_per_step: 3
  fuse: false
  queue_cap: 5
  max_loras: 2
sessions:
  adapter_timeout_s: 60
  adapter_max_lifetime_s: 120
  future_retention_s: 30
testing:
  hooks: true
limits:
  max_pending_ops: 9
  tokens_per_s: 12.5
  burst_tokens: 100
server:
  tls:
    cert_file: c.pem
    key_file: k.pem
    client_ca_file: ca.pem
)");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->scheduler.max_tokens_per_step, 100);
  EXPECT_EQ(c->scheduler.max_ops_per_step, 3);
  EXPECT_FALSE(c->scheduler.fuse);
  EXPECT_EQ(c->scheduler.queue_cap, 5);
  EXPECT_EQ(c->scheduler.max_loras, 2);
  EXPECT_EQ(c->sessions.adapter_timeout_s, 60);
  EXPECT_EQ(c->sessions.adapter_max_lifetime_s, 120);
  EXPECT_EQ(c->sessions.future_retention_s, 30);
  EXPECT_TRUE(c->testing.hooks);
  EXPECT_EQ(c->limits.max_pending_ops, 9);
  EXPECT_EQ(c->limits.tokens_per_s, 12.5);
  EXPECT_EQ(c->limits.burst_tokens, 100);
  EXPECT_EQ(c->server.tls.client_ca_file, "/etc/twinkle/ca.pem");
}

TEST(ConfigTest, BooleansAreChecked) {
  EXPECT_THAT(ErrorOf("model:\n  path: m\nscheduler:\n  fuse: maybe\n"),
              HasSubstr("test.yaml:4: scheduler.fuse: expected true or false, got 'maybe'"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nauth:\n  enabled: [true]\n"),
              HasSubstr("test.yaml:4: auth.enabled: expected true or false"));
}

TEST(ConfigTest, TenantsAndQuotaFallback) {
  absl::StatusOr<Config> c = Parse(AuthYaml());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->auth.enabled);
  ASSERT_EQ(c->auth.tenants.size(), 2u);
  const TenantConfig& alice = c->auth.tenants[0];
  EXPECT_EQ(alice.id, "alice");
  EXPECT_EQ(alice.key_sha256, std::vector<std::string>{kAliceDigest});
  EXPECT_EQ(alice.quotas.max_adapters, 4);
  EXPECT_EQ(alice.quotas.max_lora_rank, 16);
  EXPECT_EQ(alice.quotas.tokens_per_s, 1000);  // from limits
  EXPECT_EQ(alice.quotas.max_tokens_per_request, 32768);
  const TenantConfig& bob = c->auth.tenants[1];
  EXPECT_EQ(bob.quotas.max_lora_rank, 32);  // all from limits
  EXPECT_EQ(bob.quotas.max_adapters, 64);
  // Digests are lower-cased.
  std::string lower = kBobDigest;
  for (char& ch : lower) ch = static_cast<char>(std::tolower(ch));
  EXPECT_EQ(bob.key_sha256, std::vector<std::string>{lower});
}

TEST(ConfigTest, NonLoopbackNeedsAuth) {
  EXPECT_TRUE(Parse(AuthYaml("server:\n  host: 0.0.0.0\n")).ok());
  EXPECT_THAT(ErrorOf("model:\n  path: m\nserver:\n  host: 10.1.2.3\nauth:\n  enabled: false\n"),
              HasSubstr("server.host: refusing to bind non-loopback address '10.1.2.3' without authentication"));
}

TEST(ConfigTest, AuthWithoutTenantsIsAnError) {
  EXPECT_THAT(ErrorOf("model:\n  path: m\nauth:\n  enabled: true\n"),
              HasSubstr("test.yaml:4: auth.enabled: authentication is enabled but no tenant is configured"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nauth:\n  enabled: true\n  tenants: []\n"),
              HasSubstr("auth.enabled: authentication is enabled but no tenant"));
}

TEST(ConfigTest, TenantQuotaAboveTheServerLimitNamesBoth) {
  const std::string e = ErrorOf(absl::StrCat(R"(model:
  path: m
limits:
  max_lora_rank: 32
auth:
  enabled: true
  tenants:
    - id: alice
      key_sha256: [)", kAliceDigest, R"(]
      quotas:
        max_lora_rank: 64
        max_adapters: 65
)"));
  EXPECT_THAT(e, HasSubstr("test.yaml:11: auth.tenants[0].quotas.max_lora_rank: 64 exceeds the "
                           "server limit limits.max_lora_rank (32)"));
  EXPECT_THAT(e, HasSubstr("test.yaml:12: auth.tenants[0].quotas.max_adapters: 65 exceeds the "
                           "server limit limits.max_adapters (64)"));
  // Unlimited is above any finite rate; any rate is within an unlimited server.
  EXPECT_THAT(ErrorOf(AuthYaml("      quotas: {tokens_per_s: 0}\n")),
              HasSubstr("auth.tenants[1].quotas.tokens_per_s: 0 (unlimited) exceeds the server "
                        "limit limits.tokens_per_s (1000)"));
  EXPECT_THAT(ErrorOf(AuthYaml("      quotas: {tokens_per_s: 1001}\n")),
              HasSubstr("limits.tokens_per_s (1000)"));
  EXPECT_TRUE(Parse(AuthYaml("      quotas: {tokens_per_s: 999, burst_tokens: 10}\n")).ok());
  // max_sessions: the server's default (256) bounds a tenant's, limit + 1 is refused.
  EXPECT_THAT(ErrorOf(AuthYaml("      quotas: {max_sessions: 257}\n")),
              HasSubstr("auth.tenants[1].quotas.max_sessions: 257 exceeds the server limit limits.max_sessions (256)"));
  absl::StatusOr<Config> sessions = Parse(AuthYaml("      quotas: {max_sessions: 2}\n"));
  ASSERT_TRUE(sessions.ok()) << sessions.status();
  EXPECT_EQ(sessions->auth.tenants[1].quotas.max_sessions, 2);
  EXPECT_EQ(sessions->auth.tenants[0].quotas.max_sessions, 256);
}

TEST(ConfigTest, TenantShapeErrors) {
  const std::string head = "model:\n  path: m\nauth:\n  enabled: true\n  tenants:\n";
  EXPECT_THAT(ErrorOf(head + "    - id: Alice\n      key_sha256: [" + kAliceDigest + "]\n"),
              HasSubstr("test.yaml:6: auth.tenants[0].id: 'Alice' is not a tenant id"));
  EXPECT_THAT(ErrorOf(head + "    - key_sha256: [" + kAliceDigest + "]\n"),
              HasSubstr("auth.tenants[0].id: required key is missing"));
  EXPECT_THAT(ErrorOf(head + "    - id: alice\n"),
              HasSubstr("auth.tenants[0].key_sha256: needs at least one digest"));
  EXPECT_THAT(ErrorOf(head + "    - id: alice\n      key_sha256: []\n"),
              HasSubstr("auth.tenants[0].key_sha256: needs at least one digest"));
  // A value that is not a digest (perhaps the key itself) is never echoed.
  const std::string pasted_key = ErrorOf(head + "    - id: alice\n      key_sha256: [tml-secret-key]\n");
  EXPECT_THAT(pasted_key, HasSubstr("test.yaml:7: auth.tenants[0].key_sha256: entry 1 is not 64 hex digits"));
  EXPECT_THAT(pasted_key, Not(HasSubstr("tml-secret-key")));
  EXPECT_THAT(ErrorOf(head + "    - id: alice\n      key_sha256: [" + kAliceDigest + "]\n      colour: red\n"),
              HasSubstr("test.yaml:8: auth.tenants[0].colour: unknown key (known: id, key_sha256, quotas, role)"));
  EXPECT_THAT(ErrorOf(head + "    - id: alice\n      key_sha256: [" + kAliceDigest + "]\n      role: root\n"),
              HasSubstr("auth.tenants[0].role"));
  EXPECT_THAT(ErrorOf(head + "    - id: alice\n      key_sha256: [" + kAliceDigest +
                      "]\n      quotas:\n        max_adapter: 1\n"),
              HasSubstr("auth.tenants[0].quotas.max_adapter: unknown key"));
  EXPECT_THAT(ErrorOf("model:\n  path: m\nauth:\n  tenants: {id: a}\n"),
              HasSubstr("test.yaml:4: auth.tenants: expected a list of mappings"));
}

TEST(ConfigTest, TenantIdsAndDigestsAreUnique) {
  const std::string head = "model:\n  path: m\nauth:\n  enabled: true\n  tenants:\n";
  const std::string dup_id =
      ErrorOf(head + "    - id: alice\n      key_sha256: [" + kAliceDigest + "]\n" +
              "    - id: alice\n      key_sha256: [" + kBobDigest + "]\n");
  EXPECT_THAT(dup_id, HasSubstr("test.yaml:8: auth.tenants[1].id: tenant 'alice' is already "
                                "defined at /etc/twinkle/test.yaml:6"));
  std::string upper = kAliceDigest;
  for (char& ch : upper) ch = static_cast<char>(std::toupper(ch));
  const std::string dup_key =
      ErrorOf(head + "    - id: alice\n      key_sha256: [" + kAliceDigest + "]\n" +
              "    - id: bob\n      key_sha256: [" + upper + "]\n");
  EXPECT_THAT(dup_key, HasSubstr("test.yaml:8: auth.tenants[1].key_sha256: a digest is listed "
                                 "twice (also by tenant 'alice' at /etc/twinkle/test.yaml:6)"));
  EXPECT_THAT(dup_key, Not(HasSubstr(kAliceDigest)));
  EXPECT_THAT(dup_key, Not(HasSubstr(upper)));
}

TEST(ConfigTest, TestHooksAreRefusedOnAPublicAuthenticatedHost) {
  EXPECT_THAT(ErrorOf(AuthYaml("server:\n  host: 0.0.0.0\ntesting:\n  hooks: true\n")),
              HasSubstr("testing.hooks: refusing test hooks"));
  EXPECT_TRUE(Parse(AuthYaml("testing:\n  hooks: true\n")).ok());
  EXPECT_TRUE(Parse("model:\n  path: m\ntesting:\n  hooks: true\n").ok());
}

TEST(ConfigTest, ClientCaNeedsAServerCertificate) {
  EXPECT_THAT(ErrorOf("model:\n  path: m\nserver:\n  tls:\n    client_ca_file: ca.pem\n"),
              HasSubstr("test.yaml:5: server.tls.client_ca_file: needs server.tls.cert_file"));
}

class TenantsFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           absl::StrCat("twinkle_tenants_", ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_ / "secrets");
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void Write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name) << text;
  }
  absl::StatusOr<Config> ParseHere(const std::string& yaml) {
    return ParseConfig(yaml, dir_ / "twinkle.yaml");
  }
  std::filesystem::path dir_;
};

TEST_F(TenantsFileTest, TenantsAreAppendedAndQuotasFallBack) {
  Write("secrets/tenants.yaml", absl::StrCat("tenants:\n  - id: carol\n    key_sha256: [", kBobDigest,
                                             "]\n    quotas: {max_pending_ops: 3}\n"));
  absl::StatusOr<Config> c = ParseHere(
      absl::StrCat("model:\n  path: m\nlimits:\n  max_lora_rank: 8\nauth:\n  enabled: true\n"
                   "  tenants_file: secrets/tenants.yaml\n  tenants:\n    - id: alice\n"
                   "      key_sha256: [", kAliceDigest, "]\n"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->auth.tenants_file, (dir_ / "secrets/tenants.yaml").string());
  ASSERT_EQ(c->auth.tenants.size(), 2u);
  EXPECT_EQ(c->auth.tenants[0].id, "alice");
  EXPECT_EQ(c->auth.tenants[1].id, "carol");
  EXPECT_EQ(c->auth.tenants[1].quotas.max_pending_ops, 3);
  EXPECT_EQ(c->auth.tenants[1].quotas.max_lora_rank, 8);

  // A tenants file alone satisfies auth.enabled.
  EXPECT_TRUE(ParseHere("model:\n  path: m\nauth:\n  enabled: true\n  tenants_file: secrets/tenants.yaml\n").ok());
}

TEST_F(TenantsFileTest, ErrorsNameTheTenantsFile) {
  Write("tenants.yaml", "tenants:\n  - id: alice\n    key_sha256: [abc]\n    extra: 1\n");
  const absl::StatusOr<Config> c =
      ParseHere("model:\n  path: m\nauth:\n  enabled: true\n  tenants_file: tenants.yaml\n");
  ASSERT_FALSE(c.ok());
  const std::string file = (dir_ / "tenants.yaml").string();
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr(absl::StrCat(file, ":3: tenants[0].key_sha256: entry 1 is not 64 hex digits")));
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr(absl::StrCat(file, ":4: tenants[0].extra: unknown key")));

  Write("list.yaml", "- id: alice\n");
  EXPECT_THAT(std::string(ParseHere("model:\n  path: m\nauth:\n  tenants_file: list.yaml\n").status().message()),
              HasSubstr("list.yaml:1: tenants: expected a mapping with a `tenants:` list"));
}

TEST_F(TenantsFileTest, MissingFileAndDuplicatesAcrossFiles) {
  EXPECT_THAT(std::string(ParseHere("model:\n  path: m\nauth:\n  tenants_file: nope.yaml\n").status().message()),
              HasSubstr("twinkle.yaml:4: auth.tenants_file: cannot read " + (dir_ / "nope.yaml").string()));
  Write("tenants.yaml", absl::StrCat("tenants:\n  - id: alice\n    key_sha256: [", kBobDigest, "]\n"));
  const std::string e(ParseHere(absl::StrCat(
      "model:\n  path: m\nauth:\n  enabled: true\n  tenants_file: tenants.yaml\n  tenants:\n"
      "    - id: alice\n      key_sha256: [", kAliceDigest, "]\n")).status().message());
  EXPECT_THAT(e, HasSubstr(absl::StrCat((dir_ / "tenants.yaml").string(), ":2: tenants[0].id: tenant "
                                        "'alice' is already defined at ", (dir_ / "twinkle.yaml").string(), ":7")));
}

TEST(ConfigTest, RenderMasksDigestsAndShowsTenants) {
  absl::StatusOr<Config> c = Parse(AuthYaml());
  ASSERT_TRUE(c.ok()) << c.status();
  for (ConfigFormat format : {ConfigFormat::kYaml, ConfigFormat::kJson}) {
    const std::string out = RenderConfig(*c, format);
    EXPECT_THAT(out, Not(HasSubstr(kAliceDigest)));
    EXPECT_THAT(out, Not(HasSubstr(std::string(kAliceDigest).substr(0, 16))));
    EXPECT_THAT(out, Not(HasSubstr("d2f3b8a8")));
    EXPECT_THAT(out, HasSubstr("alice"));
    EXPECT_THAT(out, HasSubstr("***"));
  }
  const std::string yaml = RenderConfig(*c, ConfigFormat::kYaml);
  EXPECT_THAT(yaml, HasSubstr("enabled: true"));
  EXPECT_THAT(yaml, HasSubstr("fuse: true"));
  EXPECT_THAT(yaml, HasSubstr("max_loras: 16"));
  const std::string json = RenderConfig(*c, ConfigFormat::kJson);
  EXPECT_THAT(json, HasSubstr("\"hooks\": false"));
  EXPECT_THAT(json, HasSubstr("\"max_lora_rank\": 16"));  // alice's effective quota
}


// ---- Several base models (`models:`). ----

namespace models_test {

constexpr char kTwoModels[] = R"(models:
  - path: ../models/tiny-a
    devices: [cuda:0]
    sampler_devices: [cuda:1]
    max_adapters: 2
  - path: ../models/tiny-b
    name: b
    dtype: bfloat16
    devices: [cuda:2, cuda:3]
)";

TEST(ConfigModelsTest, SingleModelBecomesOneEntryWithTheTopLevelDevices) {
  absl::StatusOr<Config> c = Parse(kValid);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->models_listed);
  ASSERT_EQ(c->models.size(), 1u);
  EXPECT_EQ(c->models[0].name, "tiny");
  EXPECT_EQ(c->models[0].path, "/etc/models/tiny");
  EXPECT_EQ(c->models[0].devices, (std::vector<std::string>{"cpu", "cpu"}));
  EXPECT_TRUE(c->models[0].sampler_devices.empty());
  EXPECT_EQ(c->models[0].max_adapters, 64);  // limits.max_adapters
  // print-config of the single form is unchanged: no models key.
  EXPECT_THAT(RenderConfig(*c, ConfigFormat::kYaml), Not(HasSubstr("models:")));
}

TEST(ConfigModelsTest, ListIsReadWithItsOwnDevicesAndCapacity) {
  absl::StatusOr<Config> c = Parse(kTwoModels);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->models_listed);
  ASSERT_EQ(c->models.size(), 2u);
  EXPECT_EQ(c->models[0].name, "tiny-a");
  EXPECT_EQ(c->models[0].path, "/etc/models/tiny-a");
  EXPECT_EQ(c->models[0].sampler_devices, (std::vector<std::string>{"cuda:1"}));
  EXPECT_EQ(c->models[0].max_adapters, 2);
  EXPECT_EQ(c->models[1].name, "b");
  EXPECT_EQ(c->models[1].dtype, "bfloat16");
  EXPECT_EQ(c->models[1].max_adapters, 64);  // 0 = limits.max_adapters
  EXPECT_EQ(c->model.name, "tiny-a");        // mirrors models[0]

  const Config b = ForModel(*c, 1);
  EXPECT_EQ(b.model.name, "b");
  EXPECT_EQ(b.model.dtype, "bfloat16");
  EXPECT_EQ(b.engine.devices, (std::vector<std::string>{"cuda:2", "cuda:3"}));
  EXPECT_TRUE(b.sampler.devices.empty());
  EXPECT_EQ(b.limits.max_adapters, 64);
  ASSERT_EQ(b.models.size(), 1u);
  const Config a = ForModel(*c, 0);
  EXPECT_EQ(a.sampler.devices, (std::vector<std::string>{"cuda:1"}));
  EXPECT_EQ(a.limits.max_adapters, 2);
}

TEST(ConfigModelsTest, RenderWritesTheListBackAndItParsesAgain) {
  absl::StatusOr<Config> c = Parse(kTwoModels);
  ASSERT_TRUE(c.ok()) << c.status();
  const std::string yaml = RenderConfig(*c, ConfigFormat::kYaml);
  EXPECT_THAT(yaml, HasSubstr("models:"));
  EXPECT_THAT(yaml, Not(HasSubstr("\nmodel:")));
  // The output reads back as the same models (no top-level devices, which the list refuses).
  absl::StatusOr<Config> again = Parse(yaml);
  ASSERT_TRUE(again.ok()) << again.status() << "\n" << yaml;
  ASSERT_EQ(again->models.size(), 2u);
  EXPECT_EQ(again->models[1].devices, c->models[1].devices);
  EXPECT_EQ(again->models[0].sampler_devices, c->models[0].sampler_devices);
  EXPECT_EQ(again->models[0].max_adapters, 2);
}

TEST(ConfigModelsTest, BothFormsAreRefused) {
  EXPECT_THAT(ErrorOf("model:\n  path: m\nmodels:\n  - path: n\n"),
              HasSubstr("test.yaml:4: models: give either model: (one base model) or models: (several), not both"));
}

TEST(ConfigModelsTest, EmptyListIsRefused) {
  EXPECT_THAT(ErrorOf("models: []\n"), HasSubstr("test.yaml:1: models: needs at least one model"));
}

TEST(ConfigModelsTest, NeitherFormNamesTheMissingPath) {
  EXPECT_THAT(ErrorOf("server:\n  host: 127.0.0.1\n"), HasSubstr("model.path: required key is missing"));
}

TEST(ConfigModelsTest, DuplicateNamesAreRefusedAlsoWhenDefaultedFromTheDirectory) {
  EXPECT_THAT(ErrorOf("models:\n  - path: a\n    name: x\n  - path: b\n    name: x\n"),
              HasSubstr("test.yaml:5: models[1].name: 'x' is already the name of models[0]"));
  EXPECT_THAT(ErrorOf("models:\n  - path: one/m\n  - path: two/m\n"),
              HasSubstr("models[1].name: 'm' is already the name of models[0]"));
}

TEST(ConfigModelsTest, ADeviceServesOneModelButCpuIsShared) {
  EXPECT_THAT(ErrorOf("models:\n  - path: a\n    devices: [cuda:0]\n  - path: b\n    devices: [cuda:0]\n"),
              HasSubstr("models[1].devices: 'cuda:0' is already used by models[0] ('a'); a device serves one "
                        "model (only cpu may be shared)"));
  // A sampler device of one model that is another's training device.
  EXPECT_THAT(ErrorOf("models:\n  - path: a\n    devices: [cuda:0]\n  - path: b\n    devices: [cuda:1]\n"
                      "    sampler_devices: [cuda:0]\n"),
              HasSubstr("models[1].sampler_devices: 'cuda:0' is already used by models[0]"));
  // Within one model the usual rule and its message, under the model's own keys.
  EXPECT_THAT(ErrorOf("models:\n  - path: a\n    devices: [cuda:0]\n    sampler_devices: [cuda:0]\n"),
              HasSubstr("models[0].sampler_devices: 'cuda:0' is also in models[0].devices"));
  EXPECT_THAT(ErrorOf("models:\n  - path: a\n    devices: []\n"), HasSubstr("models[0].devices: needs at least one device"));
  EXPECT_THAT(ErrorOf("models:\n  - path: a\n    devices: [tpu]\n"), HasSubstr("models[0].devices: 'tpu' is not a device"));
  absl::StatusOr<Config> cpu = Parse("models:\n  - path: a\n  - path: b\n    devices: [cpu, cpu]\n");
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ(cpu->models[0].devices, (std::vector<std::string>{"cpu"}));  // the default
}

TEST(ConfigModelsTest, TopLevelDevicesAreRefusedWithTheList) {
  EXPECT_THAT(ErrorOf("models:\n  - path: a\nengine:\n  devices: [cpu]\n"),
              HasSubstr("test.yaml:4: engine.devices: with models:, each model lists its own devices (models[i].devices)"));
  EXPECT_THAT(ErrorOf("models:\n  - path: a\nsampler:\n  devices: [cpu]\n"),
              HasSubstr("sampler.devices: with models:, each model lists its own devices (models[i].sampler_devices)"));
}

TEST(ConfigModelsTest, EntryKeysAreCheckedLikeModelKeys) {
  EXPECT_THAT(ErrorOf("models:\n  - path: a\n    dtype: float8\n"),
              HasSubstr("test.yaml:3: models[0].dtype: 'float8' is not one of"));
  EXPECT_THAT(ErrorOf("models:\n  - name: a\n"), HasSubstr("models[0].path: required key is missing"));
  EXPECT_THAT(ErrorOf("models:\n  - path: a\n    devcies: [cpu]\n"),
              HasSubstr("models[0].devcies: unknown key (known: chat_renderer_fallback, devices, dtype, max_adapters"));
  EXPECT_THAT(ErrorOf("models:\n  - path: a\n    max_adapters: 100001\n"),
              HasSubstr("models[0].max_adapters: 100001 is out of range [0, 100000]"));
  EXPECT_THAT(ErrorOf("models:\n  path: a\n"), HasSubstr("models: expected a list of mappings"));
}

TEST(ConfigModelsTest, EachModelHasItsOwnNodePortAndRendezvousPort) {
  absl::StatusOr<Config> c = ParseConfig(
      "models:\n  - path: a\n  - path: b\n    devices: [cpu, cpu@node-a]\n"
      "nodes:\n  listen: 127.0.0.1:7000\n  secret_file: s\n  rendezvous_port: 7100\n",
      "test.yaml");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(ForModel(*c, 0).nodes.listen, "127.0.0.1:7000");
  EXPECT_EQ(ForModel(*c, 1).nodes.listen, "127.0.0.1:7001");
  EXPECT_EQ(ForModel(*c, 0).nodes.rendezvous_port, 7100);
  EXPECT_EQ(ForModel(*c, 1).nodes.rendezvous_port, 7101);
  // models[1] would listen on 65536: refused at the limit + 1, accepted at the limit.
  const std::string two_models = "models:\n  - path: a\n  - path: b\n    devices: [cpu@node-a]\n";
  EXPECT_THAT(ErrorOf(two_models + "nodes:\n  listen: 127.0.0.1:65535\n  secret_file: s\n"),
              HasSubstr("models[1].devices: models[1]'s node agents join nodes.listen's port + 1, past 65535"));
  EXPECT_TRUE(ParseConfig(two_models + "nodes:\n  listen: 127.0.0.1:65534\n  secret_file: s\n", "test.yaml").ok());
  EXPECT_THAT(ErrorOf(two_models + "nodes:\n  listen: 127.0.0.1:7000\n  secret_file: s\n  rendezvous_port: 65535\n"),
              HasSubstr("nodes.rendezvous_port: models[1] rendezvouses at its port + 1, past 65535"));
}

}  // namespace models_test

}  // namespace
}  // namespace twinkle
