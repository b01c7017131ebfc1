#pragma once
// The server's configuration: typed structs with every default in one place (the member
// initializers below). config.cc binds them to YAML through one field list per section
// (VisitFields), which serves parsing, validation and printing alike, so a key can never be
// parsed under one name and printed under another.

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace twinkle {

struct TlsConfig {
  std::string cert_file;       // PEM; both set = TLS on the gRPC and HTTP ports
  std::string key_file;        // secret: masked by print-config
  std::string client_ca_file;  // PEM; set = mTLS: clients must present a cert signed by it
};

struct ServerSection {
  std::string host = "127.0.0.1";
  int32_t grpc_port = 50051;  // 0 = any free port (reported via --port-file and the log)
  int32_t http_port = 8000;
  double drain_timeout_s = 10;
  TlsConfig tls;
  int32_t max_http_connections = 1024;    // open HTTP connections; one more is answered 503 and closed
  double idle_timeout_s = 120;            // an HTTP or gRPC connection idle this long is closed
  int32_t max_concurrent_streams = 256;   // gRPC calls in flight on one connection
  // Host names accepted besides the bind address and loopback names (DNS-rebinding guard):
  // a request whose Host is none of them gets 403. Empty on a non-loopback bind = any Host.
  std::vector<std::string> allowed_hosts;
  // Browser origins (scheme://host[:port]) allowed to call the API; a request carrying any
  // other Origin header gets 403 (a web page cannot drive the API from a user's browser).
  std::vector<std::string> allowed_origins;
  // With auth on, /metrics is open to scrapers without a key, so tenant ids are not used as
  // label values (queue series are summed under tenant="all") unless this is true.
  bool metrics_tenant_labels = false;
};

struct ModelSection {
  std::string path;       // an HF model directory; relative paths are relative to the config file
  std::string name;       // display id; default: the directory's name
  std::string dtype = "float32";
  // The chat renderer for /v1/chat/completions when the model's chat template is not one the
  // server recognizes: "" = none (chat answers 501), else qwen3 | qwen3_5 | llama3 | chatml.
  std::string chat_renderer_fallback;
  // Longest training sequence (tokens); 0 = the model's max_position_embeddings.
  int64_t max_context_tokens = 0;
};

// One entry of `models:` (several base models in one deployment): the `model:` keys plus what
// is this model's own: its training devices, its dedicated sampler devices and its capacity.
// Everything else (engine timeouts, scheduler, sampler sizes, limits) is shared and applies
// to every model's workers alike.
struct ModelEntry : ModelSection {
  std::vector<std::string> devices = {"cpu"};  // its training workers, as engine.devices
  std::vector<std::string> sampler_devices;    // its dedicated sampler workers, as sampler.devices
  // Adapters live on this model at once, over all tenants; 0 = limits.max_adapters. Adapters
  // of one model never take another's room.
  int32_t max_adapters = 0;
};

struct EngineSection {
  std::vector<std::string> devices = {"cpu"};  // one engine worker per entry
  std::string binary;                          // default: twinkle-engine beside twinkle-server
  int32_t heartbeat_interval_ms = 200;
  int32_t heartbeat_timeout_ms = 3000;
  double startup_timeout_s = 120;
  int32_t restart_backoff_initial_ms = 500;
  int32_t restart_backoff_max_ms = 30000;
  // One engine call's deadline: call_timeout_s plus call_timeout_per_mib_s per MiB of the
  // request, from when the worker starts it. Past it the step is taken as hung: the worker
  // is restarted and the caller gets a retryable error.
  double call_timeout_s = 1800;
  double call_timeout_per_mib_s = 120;
  // Keep a host copy of each resident adapter's state after every optimizer step (and other
  // state changes), so a worker restart restores its tenants' adapters instead of losing them.
  bool adapter_restore_points = true;
  // Data parallelism (two or more devices): how long a rendezvous or a collective waits for
  // the other ranks.
  double collective_timeout_s = 300;
  // Training memory (docs/config.md): recompute each decoder layer in backward instead of
  // keeping its activations, and the rows per lm_head/log-softmax chunk (0 = the engine's
  // default, LogitChunkRows).
  bool activation_checkpointing = false;
  int64_t logit_chunk_rows = 0;
  // Memory admission: a fused forward/forward_backward step's estimated activation memory
  // stays within this many MiB; a single request estimated above it runs in passes that do
  // (a sequence estimated above it alone is refused when submitted). 0 = no memory admission.
  int64_t activation_memory_mib = 0;
  // Data parallelism's placement (docs/device_pool.md): an adapter's rows in one step above
  // this many tokens are split over every rank, at or below they run on its home rank
  // (0 = always split); and whether adapters move between ranks to even out load.
  int64_t rank_token_budget = 4096;
  bool rebalance = true;
};

// Server-wide limits, and the default quotas of every tenant (a tenant's own `quotas` may
// lower any of them, never raise one).
struct LimitsSection {
  int32_t max_adapters = 64;               // per tenant; also the server's resident maximum
  int32_t max_lora_rank = 128;  // the cookbook recipes ask for up to 128 (on-policy distillation)
  int64_t max_tokens_per_request = 32768;
  int32_t max_pending_ops = 256;           // queued (and Tinker-buffered) ops per tenant
  int32_t max_sessions = 256;              // open sessions per tenant (Twinkle and Tinker)
  int64_t max_buffered_tokens = 262144;    // tokens of Tinker ops buffered ahead of seq gaps
  double tokens_per_s = 0;                 // per-tenant token rate; 0 = unlimited
  int64_t burst_tokens = 65536;            // per-tenant token bucket size
  int64_t storage_quota_bytes = 0;         // checkpoint bytes per tenant; 0 = unlimited
};

struct TenantConfig {
  std::string id;                       // [a-z0-9_-]{1,64}, unique
  std::vector<std::string> key_sha256;  // hex SHA-256 of each API key (lower-cased); secret
  LimitsSection quotas;                 // keys left out take the value from `limits`
  std::string role = "member";          // of its keys: admin | member | read-only
};

struct AuthSection {
  bool enabled = false;               // true: every RPC except health needs an API key
  std::string tenants_file;           // optional YAML file with a top-level `tenants:` list
  // Inline tenants followed by those of tenants_file (after parsing, both are here).
  std::vector<TenantConfig> tenants;
  // Audit rows older than this are deleted (hourly sweep).
  double audit_retention_days = 90;
  // Usage counters are kept in memory and written to the registry this often (and at a
  // clean shutdown); a crash loses at most this much usage.
  double usage_flush_interval_s = 10;
  // API keys the registry may hold per tenant (active ones; create/rotate beyond: 429).
  int32_t max_keys_per_tenant = 100;
  // The Tinker SDK's auth exchange (server/auth/jwt.h): how long a token it gets for its
  // API key stays valid; 0 turns the exchange off (pjwt_auth_enabled false, keys only).
  double jwt_ttl_s = 3600;
  // HMAC key of those tokens (hex, >= 32 bytes); secret. Unset: generated once and kept in
  // <data_dir>/jwt_signing.key. Replicas sharing one registry must share it.
  std::string jwt_signing_secret;
};
// The shortest auth.jwt_ttl_s other than 0.
inline constexpr double kMinJwtTtlSeconds = 120;

// The fair fusing scheduler (core/scheduler).
struct SchedulerSection {
  int64_t max_tokens_per_step = 8192;  // token budget of one fused engine step
  int32_t max_ops_per_step = 64;       // adapters fused into one step at most
  bool fuse = true;                    // false: every op runs alone
  int32_t queue_cap = 64;              // queued ops per adapter
  int32_t max_loras = 16;              // adapters resident in device slots at once
};

// The sampler pool (core/sampling, core/engine/sampler). Colocated (no devices, the default):
// the training workers sample too, sharing their base weights; decode chunks interleave with
// training steps. Dedicated (devices listed): sampler workers of their own load the base
// model on those devices and every sampling call goes to them (docs/architecture.md, "Sampler").
struct SamplerSection {
  std::vector<std::string> devices;       // empty = colocated; else one sampler worker per entry
  int64_t kv_cache_blocks = 2048;         // KV cache blocks per worker that samples
  int32_t kv_block_size = 16;             // tokens per block
  int32_t state_slots = 64;               // recurrent state slots per worker that samples (hybrid models)
  int32_t max_decode_steps_per_call = 8;  // one decode chunk: what a training step may wait behind
  int32_t stream_decode_steps_per_call = 1;  // the chunk while a streaming request runs (1 = per token)
  int32_t max_snapshots = 64;             // adapter snapshots held on the engine, server-wide
  int32_t max_snapshots_per_tenant = 16;  // live (unnamed) snapshots per tenant; LRU-evicted beyond
  int32_t max_sessions_per_tenant = 64;   // open sampling sessions per tenant
  int32_t default_max_tokens = 16;        // when a request leaves max_tokens unset
  int32_t max_num_samples = 128;          // completions per prompt in one request
};

struct SessionsSection {
  double adapter_timeout_s = 1800;        // an adapter idle this long is unloaded
  double adapter_max_lifetime_s = 36000;  // an adapter is unloaded this long after creation
  double future_retention_s = 86400;      // a completed future stays fetchable this long
  int64_t max_retained_results = 10000;   // finished results kept per tenant (oldest dropped)
  int64_t max_retained_result_bytes = int64_t{256} << 20;  // their bytes per tenant
};

// Where checkpoints and the run registry live.
struct StorageSection {
  // Relative paths are relative to the config file's folder; unset means "twinkle-data"
  // beside the config file (filled in after parsing). Layout: <data_dir>/registry.sqlite and
  // <data_dir>/tenants/<tenant>/runs/<run_id>/...
  std::string data_dir;
  // HMAC key of the signed download URLs (hex, >= 32 bytes); secret. Unset: generated once
  // and kept in <data_dir>/url_signing.key.
  std::string url_signing_secret;
  double download_url_ttl_s = 3600;  // how long a signed download URL stays valid
  double reap_interval_s = 60;       // how often expired checkpoints are deleted
  int64_t max_import_bytes = int64_t{48} << 20;  // an adapter import's request body, at most
};

// Engines on other nodes (docs/device_pool.md "Engines on other nodes"): node agents
// (`twinkle-server worker --join HOST:PORT --node NAME`) connect here and start the engines
// that engine.devices places on their node ("cpu@NAME", "cuda:0@NAME").
struct NodesSection {
  std::string listen;       // host:port for node agents and their engines; "" = none
  std::string secret_file;  // the node secret (`twinkle-server node-secret`), mode 0600
  // Data parallelism across nodes: where the other nodes' ranks reach rank 0's rendezvous
  // (its c10d TCPStore). "" = nodes.listen's host; port 0 = a free port each time.
  std::string rendezvous_host;
  int32_t rendezvous_port = 0;
};

struct TestingSection {
  bool hooks = false;  // admin RPCs that pause/step the scheduler, inject I/O faults; tests only
};

struct LoggingSection {
  std::string level = "info";  // debug | info | warning | error
  std::string format = "text";  // text | json (one JSON object per line; the engine workers too)
};

struct Config {
  ServerSection server;
  ModelSection model;
  EngineSection engine;
  LimitsSection limits;
  AuthSection auth;
  SchedulerSection scheduler;
  SamplerSection sampler;
  SessionsSection sessions;
  StorageSection storage;
  NodesSection nodes;
  TestingSection testing;
  LoggingSection logging;
  // The base models served. After parsing it always holds at least one entry: the `models:`
  // list as written, or the single `model:` with engine.devices, sampler.devices and
  // limits.max_adapters. `model`, `engine.devices` and `sampler.devices` then mirror
  // models[0], so code that serves one model reads them as before.
  std::vector<ModelEntry> models;

  std::filesystem::path source_file;  // where it was read from (not a key)
  bool models_listed = false;         // the file used `models:` (print-config writes it back so)
};

// The config one model's stack runs with: `config` with model, engine.devices,
// sampler.devices and limits.max_adapters taken from models[index], and models holding only
// that entry. Every per-model piece (supervisor, coordinator, sampler) is built from it.
Config ForModel(const Config& config, size_t index);

// Reads and validates a config file. Errors name the file, line and dotted key:
//   "configs/x.yaml:4: server.grpc_prot: unknown key (known: host, grpc_port, ...)"
// Several problems are reported together, one per line. Relative paths are resolved against
// the file's folder. Reads auth.tenants_file too (its tenants are appended to auth.tenants);
// apart from that checks only the file's content; see CheckEnvironment for the disk.
absl::StatusOr<Config> LoadConfigFile(const std::filesystem::path& file);

// Same as LoadConfigFile, on YAML text (file_name is used in messages and to resolve paths).
absl::StatusOr<Config> ParseConfig(const std::string& yaml_text,
                                   const std::filesystem::path& file_name);

// Where ranks on other nodes reach rank 0's rendezvous: nodes.rendezvous_host, else the host
// of nodes.listen.
std::string RendezvousHost(const Config& config);

// Checks what the config refers to: the model directory and its config.json exist, the TLS
// files (certificate, key, client CA) are readable. Separate so that tests of the parser need no model on disk.
absl::Status CheckEnvironment(const Config& config);

enum class ConfigFormat { kYaml, kJson };
// The effective config with every default filled in and secrets masked (the TLS key file
// and every key digest print as "***"); tenants from auth.tenants_file are listed too.
std::string RenderConfig(const Config& config, ConfigFormat format);

// True for 127.0.0.0/8, ::1 and "localhost".
bool IsLoopbackHost(const std::string& host);

}  // namespace twinkle
