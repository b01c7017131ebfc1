#include "server/app.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <thread>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "core/common/clock.h"
#include "core/common/log.h"
#include "core/engine_client/supervisor.h"
#include "core/ipc/socket.h"
#include "core/futures/future_store.h"
#include "core/registry/registry.h"
#include "core/storage/filesystem.h"
#include "core/training/checkpoints.h"
#include "core/training/future_journal.h"
#include "core/tenancy/rate_limiter.h"
#include "core/training/coordinator.h"
#include "server/auth/authenticator.h"
#include "server/auth/jwt.h"
#include "server/auth/secret_file.h"
#include "server/auth/key_admin.h"
#include "server/grpc/admin_service.h"
#include "server/grpc/sampler_service.h"
#include "server/grpc/tinker_service.h"
#include "server/grpc/training_service.h"
#include "server/grpc/utility_service.h"
#include "server/http/http_server.h"
#include "server/http/request_guard.h"
#include "server/metrics.h"
#include "server/model_set.h"
#include "server/model_stack.h"
#include "server/openai/openai_routes.h"
#include "server/serving_state.h"
#include "server/tinker/admin_routes.h"
#include "server/tinker/http_routes.h"
#include "server/usage_meter.h"
#include "server/tinker/tinker_api.h"
#include "server/tinker/url_signer.h"
#include "twinkle_version.h"

namespace twinkle {
namespace {

// Linking grpc++_reflection registers its builder plugin in a static initializer, so every
// ServerBuilder adds the reflection service whether or not we ask. With auth on, reflection
// would answer anyone without a key (it lists every service); this option takes the plugin
// back out of the builder.
class WithoutReflection final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    std::erase_if(*plugins, [](const std::unique_ptr<grpc::ServerBuilderPlugin>& p) {
      return p->name() == "proto_server_reflection";
    });
  }
};

constexpr char kLog[] = "server";
constexpr int kHttpThreads = 2;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

std::string DefaultEngineBinary() {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return (self.parent_path() / "twinkle-engine").string();
}

namespace {

std::string HostPort(const std::string& host, int port) {
  return host.find(':') != std::string::npos && host.front() != '['
             ? absl::StrCat("[", host, "]:", port)
             : absl::StrCat(host, ":", port);
}

// Writes the chosen ports where a test or an orchestrator can find them, atomically.
absl::Status WritePortFile(const std::string& path, int grpc_port, int http_port) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  {
    std::ofstream out(tmp);
    out << nlohmann::json{{"grpc_port", grpc_port}, {"http_port", http_port}, {"pid", getpid()}}.dump()
        << "\n";
    if (!out.flush()) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot rename ", tmp, " to ", path, ": ", ec.message()));
  return absl::OkStatus();
}

// Waits for SIGTERM/SIGINT on its own thread (they are blocked everywhere else).
class SignalWatcher {
 public:
  explicit SignalWatcher(std::function<void(int)> on_signal) : on_signal_(std::move(on_signal)) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~SignalWatcher() {
    stop_ = true;
    thread_.join();
  }

 private:
  void Loop() {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    const timespec tick{0, 100'000'000};
    bool signalled = false;
    while (!stop_) {
      const int sig = sigtimedwait(&set, nullptr, &tick);
      if (sig > 0 && !signalled) {
        signalled = true;
        on_signal_(sig);
      }
    }
  }
  std::function<void(int)> on_signal_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Copies each model's adapter and sampler figures (label `model`) and the per-tenant queue
// depths (summed over the models) into the metrics. Runs on every housekeeping tick and on
// every /metrics scrape, so a scrape is current.
void SampleGauges(ServingState& state) {
  std::vector<std::pair<std::string, int64_t>> depths;
  for (const tenancy::Tenant* t : state.authenticator->registry().tenants()) depths.emplace_back(t->id, 0);
  for (ModelStack* m : state.models->stacks()) {
    const training::CoordinatorStats s = m->coordinator().stats();
    state.metrics.SetAdapters(m->name(), s.adapters, s.resident, s.offloads, s.reloads, s.expired, s.restored, s.lost);
    for (auto& [tenant, depth] : depths) depth += m->coordinator().scheduler().queued_for_tenant(tenant);
    const sampling::SamplerStats z = m->sampler().stats();
    state.metrics.SetSampler(m->name(), {z.sessions, z.snapshots, z.waiting, z.running, z.blocks_in_use,
                                         z.blocks_total, z.tokens_generated, z.states_in_use, z.states_total});
  }
  state.metrics.SetQueueDepths(depths);
  if (state.checkpoints != nullptr) {
    if (absl::StatusOr<std::vector<std::pair<std::string, int64_t>>> stored = state.registry->StorageBytesByTenant();
        stored.ok()) {
      std::vector<std::pair<std::string, int64_t>> bytes;
      for (const tenancy::Tenant* t : state.authenticator->registry().tenants()) bytes.emplace_back(t->id, 0);
      for (auto& [tenant, n] : *stored) {
        auto it = std::find_if(bytes.begin(), bytes.end(), [&](const auto& b) { return b.first == tenant; });
        if (it == bytes.end()) {
          bytes.emplace_back(tenant, n);
        } else {
          it->second = n;
        }
      }
      state.metrics.SetStorageBytes(bytes);
    }
  }
  state.metrics.SetDraining(state.draining.load());
}

// Once a second: expire adapters and futures, and sample the gauges; every
// auth.usage_flush_interval_s write the usage counters; hourly drop audit rows past
// auth.audit_retention_days.
class Housekeeper {
 public:
  Housekeeper(ServingState& state) : state_(state), thread_([this] { Loop(); }) {}
  ~Housekeeper() {
    stop_.Notify();
    thread_.join();
  }

 private:
  void Loop() {
    while (!stop_.WaitForNotificationWithTimeout(absl::Seconds(1))) {
      for (ModelStack* m : state_.models->stacks()) {
        m->coordinator().Housekeep();
        m->sampler().Housekeep();
      }
      state_.futures->Expire();
      // Journaled results outlive the process for the same retention.
      (void)state_.registry->ExpireFutures(absl::Now() - absl::Seconds(state_.config.sessions.future_retention_s));
      // Expired checkpoints, every storage.reap_interval_s.
      if (absl::Now() - last_reap_ >= absl::Seconds(state_.config.storage.reap_interval_s)) {
        last_reap_ = absl::Now();
        if (absl::StatusOr<std::vector<std::string>> reaped = state_.checkpoints->Reap(); !reaped.ok()) {
          LogWarning(kLog, absl::StrCat("deleting expired checkpoints: ", reaped.status().message()));
        }
      }
      SampleGauges(state_);
      const absl::Time now = absl::Now();
      if (now - last_usage_flush_ >= absl::Seconds(state_.config.auth.usage_flush_interval_s)) {
        last_usage_flush_ = now;
        if (absl::Status s = state_.usage->Flush(now); !s.ok()) {
          LogWarning(kLog, absl::StrCat("writing usage counters (kept for the next try): ", s.message()));
        }
      }
      if (now - last_audit_sweep_ >= absl::Hours(1)) {
        last_audit_sweep_ = now;
        (void)state_.registry->ExpireAudit(now - absl::Hours(24) * state_.config.auth.audit_retention_days);
      }
    }
  }
  absl::Time last_usage_flush_ = absl::Now();
  absl::Time last_audit_sweep_ = absl::InfinitePast();
  ServingState& state_;
  absl::Time last_reap_ = absl::InfinitePast();
  absl::Notification stop_;
  std::thread thread_;
};

training::StorageQuotas StorageQuotasOf(const Config& c) {
  training::StorageQuotas q;
  q.default_bytes = c.limits.storage_quota_bytes;
  for (const TenantConfig& t : c.auth.tenants) q.by_tenant[t.id] = t.quotas.storage_quota_bytes;
  return q;
}

// testing.hooks only: POST /api/v1/twinkle/testing/advance_clock {"seconds": N} moves the
// retention clock forward by N seconds and runs the reaper at once; answers {"now",
// "deleted": [<run>/<checkpoint_id>, ...]}. Needs a valid key. How the e2e tests reach
// expiry without sleeping.
void AddRetentionTestRoute(HttpServer& http, ServingState& state, OffsetClock& clock) {
  http.Route("POST", "/api/v1/twinkle/testing/advance_clock", [&state, &clock](const HttpRequest& r) {
    auto error = [](int code, const std::string& message) {
      return HttpResponse{code, "application/json", nlohmann::json{{"detail", message}}.dump()};
    };
    if (absl::StatusOr<const tenancy::Tenant*> t = state.authenticator->AuthenticateHttp(r.headers); !t.ok()) {
      return error(401, std::string(t.status().message()));
    }
    const nlohmann::json body = nlohmann::json::parse(r.body, nullptr, false);
    if (!body.is_object() || !body.contains("seconds") || !body["seconds"].is_number() || body["seconds"] < 0) {
      return error(400, "seconds: a non-negative number is required");
    }
    clock.Advance(absl::Seconds(body["seconds"].get<double>()));
    absl::StatusOr<std::vector<std::string>> reaped = state.checkpoints->Reap();
    if (!reaped.ok()) return error(500, std::string(reaped.status().message()));
    SampleGauges(state);
    return HttpResponse{200, "application/json",
                        nlohmann::json{{"now", absl::FormatTime(absl::RFC3339_full, clock.Now(), absl::UTCTimeZone())},
                                       {"deleted", *reaped}}
                            .dump()};
  });
}

// Health is SERVING while every worker of every pool (each model's training workers and
// dedicated sampler workers) is ready. Each supervisor reports its own pool from its own
// thread, under its own lock; the flags here are combined under a lock of their own (never a
// supervisor's, which would order the supervisors' locks both ways), so the last status set
// is the one of the latest event.
class ReadinessTracker {
 public:
  ReadinessTracker(ServingState& state, grpc::HealthCheckServiceInterface* health, std::vector<std::string> pools)
      : state_(state), health_(health) {
    for (std::string& p : pools) ready_[std::move(p)] = false;
  }

  Supervisor::Listener ForPool(const std::string& pool) {
    return [this, pool](const std::vector<WorkerSnapshot>& workers) {
      state_.metrics.UpdateWorkers(pool, workers);
      bool all_ready = !workers.empty();
      for (const WorkerSnapshot& w : workers) all_ready &= w.ready;
      absl::MutexLock lock(&mu_);
      ready_[pool] = all_ready;
      bool serving = true;
      for (const auto& [name, ready] : ready_) serving &= ready;
      if (!state_.draining) health_->SetServingStatus(serving);
    };
  }

 private:
  ServingState& state_;
  grpc::HealthCheckServiceInterface* health_;
  absl::Mutex mu_;
  std::map<std::string, bool> ready_ ABSL_GUARDED_BY(mu_);
};

void AddHttpRoutes(HttpServer& http, ServingState& state, const std::string& grpc_address, bool tls) {
  http.Route("GET", "/metrics", [&state](const HttpRequest&) {
    SampleGauges(state);
    return HttpResponse{200, "text/plain; version=0.0.4", state.metrics.Render()};
  });
  http.RouteInline("GET", "/healthz", [](const HttpRequest&) {
    return HttpResponse{200, "application/json", R"({"status":"ok"})"};
  });
  http.RouteInline("GET", "/readyz", [&state](const HttpRequest&) {
    const bool serving = state.Serving();
    return HttpResponse{serving ? 200 : 503, "application/json",
                        serving ? R"({"status":"serving"})" : R"({"status":"not_serving"})"};
  });
  const std::string endpoints =
      nlohmann::json{{"grpc", grpc_address}, {"grpc_address", grpc_address}, {"tls", tls}}.dump();
  http.Route("GET", "/api/v1/twinkle/endpoints", [endpoints](const HttpRequest&) {
    return HttpResponse{200, "application/json", endpoints};
  });
  if (state.config.testing.hooks) {
    // Test hook: a handler that blocks its thread for ?ms= (at most 60 s), standing in for
    // a slow disk or SQLite call, to show that blocking handlers leave the probes answering.
    http.Route("POST", "/testing/block", [](const HttpRequest& request) {
      int64_t ms = 0;
      if (std::optional<std::string> v = request.QueryParam("ms"); v) (void)absl::SimpleAtoi(*v, &ms);
      absl::SleepFor(absl::Milliseconds(std::clamp<int64_t>(ms, 0, 60000)));
      return HttpResponse{200, "application/json", R"({"status":"ok"})"};
    });
  }
}

}  // namespace

void BlockShutdownSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int RunServer(const Config& config, const LaunchOptions& options) {
  auto fail = [](const std::string& line) {
    std::cerr << "twinkle-server: " << line << std::endl;
    return 1;
  };
  if (absl::Status s = CheckEnvironment(config); !s.ok()) return fail(std::string(s.message()));

  const std::string where = config.source_file.string();
  std::vector<std::string> model_names;
  for (const ModelEntry& m : config.models) model_names.push_back(m.name);
  Metrics metrics(/*tenant_labels=*/!config.auth.enabled || config.server.metrics_tenant_labels, model_names);
  ServingState state(config, metrics);
  std::string node_secret;
  if (!config.nodes.secret_file.empty()) {
    absl::StatusOr<std::string> secret = ipc::ReadNodeSecret(config.nodes.secret_file);
    if (!secret.ok()) return fail(absl::StrCat(where, ": nodes.secret_file: ", secret.status().message()));
    node_secret = *std::move(secret);
  }
  absl::StatusOr<std::unique_ptr<Authenticator>> authenticator = Authenticator::FromConfig(config);
  if (!authenticator.ok()) return fail(std::string(authenticator.status().message()));
  (*authenticator)->SetFailureListener([&metrics](const absl::Status&) { metrics.RecordAuthFailure(); });
  tenancy::TokenRateLimiter rate_limiter;

  // Persistence: the registry, checkpoint files (through the fault-injection seam, which is
  // only ever armed by the test hooks), and futures that survive a restart.
  std::error_code ec;
  std::filesystem::create_directories(config.storage.data_dir, ec);
  if (ec) {
    return fail(absl::StrCat(where, ": storage.data_dir: cannot create ", config.storage.data_dir, ": ",
                             ec.message()));
  }
  absl::StatusOr<std::unique_ptr<registry::Registry>> registry =
      registry::Registry::Open((std::filesystem::path(config.storage.data_dir) / "registry.sqlite").string());
  if (!registry.ok()) return fail(absl::StrCat(where, ": storage.data_dir: ", registry.status().message()));
  storage::FaultInjectingFileSystem checkpoint_fs(storage::RealFileSystem());
  // Checkpoint retention (expiry, the reaper, download URL expiry) reads this clock; only the
  // testing.hooks route advance_clock moves it off the wall clock.
  OffsetClock retention_clock(RealClock());
  // The runtime key set: the config's keys become the bootstrap set in the registry, and
  // the active keys (config and runtime) are what the authenticator answers from.
  KeyAdmin key_admin(**registry, **authenticator, config.auth.max_keys_per_tenant);
  if (absl::Status s = key_admin.Bootstrap(config); !s.ok()) {
    return fail(absl::StrCat(where, ": auth: loading the API keys into the registry: ", s.message()));
  }
  // The Tinker SDK's auth exchange: tokens on the retention clock, so tests reach expiry
  // without sleeping (advance_clock).
  std::unique_ptr<JwtIssuer> jwt_issuer;
  if (config.auth.enabled && config.auth.jwt_ttl_s > 0) {
    absl::StatusOr<std::string> secret =
        LoadOrCreateSecret(config.auth.jwt_signing_secret, "auth.jwt_signing_secret",
                           (std::filesystem::path(config.storage.data_dir) / "jwt_signing.key").string());
    if (!secret.ok()) return fail(absl::StrCat(where, ": ", secret.status().message()));
    jwt_issuer = std::make_unique<JwtIssuer>(*std::move(secret), absl::Seconds(config.auth.jwt_ttl_s), retention_clock);
    (*authenticator)->SetJwtIssuer(jwt_issuer.get());
  }
  UsageMeter usage(**registry);
  usage.SetListener([&metrics](const std::string& tenant, const std::string& kind, int64_t amount) {
    metrics.RecordUsage(tenant, kind, amount);
  });
  absl::StatusOr<std::unique_ptr<training::RegistryFutureJournal>> journal =
      training::RegistryFutureJournal::Open(**registry);
  if (!journal.ok()) return fail(absl::StrCat(where, ": storage.data_dir: ", journal.status().message()));
  sched::SeedFutureIds((*journal)->first_id());
  FutureStoreOptions future_options;
  future_options.retention = absl::Seconds(config.sessions.future_retention_s);
  future_options.max_results_per_tenant = config.sessions.max_retained_results;
  future_options.max_result_bytes_per_tenant = config.sessions.max_retained_result_bytes;
  FutureStore futures(future_options);
  // The gRPC waits' timers (WaitFuture, WaitSample): after `futures` (its jobs use the store)
  // and before the gRPC server (it answers the waits still open while the server drains).
  TimerThread wait_timers;
  state.wait_timers = &wait_timers;
  futures.SetJournal(journal->get());
  // One stack per base model (server/model_stack.h): its workers, coordinator, sampler and
  // checkpoint store; everything above is shared.
  ModelStackDeps deps;
  deps.registry = registry->get();
  deps.futures = &futures;
  deps.checkpoint_fs = &checkpoint_fs;
  deps.retention_clock = &retention_clock;
  deps.metrics = &metrics;
  deps.usage = &usage;
  deps.node_secret = node_secret;
  deps.model_names = model_names;
  std::vector<std::unique_ptr<ModelStack>> stacks;
  std::vector<ModelStack*> stack_ptrs;
  std::vector<std::string> pools;
  for (size_t i = 0; i < config.models.size(); ++i) {
    stacks.push_back(std::make_unique<ModelStack>(ForModel(config, i), deps, config.models.size() > 1, i));
    stacks.back()->checkpoints().SetQuotas(StorageQuotasOf(config));
    stack_ptrs.push_back(stacks.back().get());
    pools.push_back(stacks.back()->training_pool());
    if (stacks.back()->sampler_supervisor() != nullptr) pools.push_back(stacks.back()->sampler_pool());
  }
  ModelStack& primary = *stacks.front();
  // The stores share data_dir and the registry: one recovery covers every model's checkpoints.
  absl::StatusOr<std::vector<std::string>> recovered = primary.checkpoints().Recover();
  if (!recovered.ok()) {
    return fail(absl::StrCat(where, ": storage.data_dir: recovering checkpoints: ", recovered.status().message()));
  }
  ModelSet models(stack_ptrs, registry->get());
  training::CheckpointStore& checkpoints = primary.checkpoints();
  state.models = &models;
  state.sampler = &primary.sampler();

  state.keys = &key_admin;
  state.usage = &usage;
  state.authenticator = authenticator->get();
  state.rate_limiter = &rate_limiter;
  state.futures = &futures;
  state.coordinator = &primary.coordinator();
  state.registry = registry->get();
  state.checkpoints = &checkpoints;
  state.faults = &checkpoint_fs;

  // gRPC first: its port is what the HTTP endpoints route advertises.
  const bool tls = !config.server.tls.cert_file.empty();
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (tls) {
    // With a client CA: mTLS, a client must present a certificate that CA signed.
    const std::string& client_ca = config.server.tls.client_ca_file;
    grpc::SslServerCredentialsOptions ssl(
        client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                          : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    if (!client_ca.empty()) ssl.pem_root_certs = ReadFile(client_ca);
    ssl.pem_key_cert_pairs.push_back(
        {ReadFile(config.server.tls.key_file), ReadFile(config.server.tls.cert_file)});
    credentials = grpc::SslServerCredentials(ssl);
  }
  grpc::EnableDefaultHealthCheckService(true);
  // Reflection lets grpcurl discover the API; with auth on it is left out (below), so that
  // nothing but health answers a caller without a key.
  if (!config.auth.enabled) grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  // The Tinker API (tinker-protocol.md, server/tinker): HTTP under /api/v1 and tinker.v1.TinkerService.
  tinker::TinkerOptions tinker_options;
  tinker_options.max_lora_rank = config.limits.max_lora_rank;
  tinker_options.retention = absl::Seconds(config.sessions.future_retention_s);
  tinker_options.jwt_auth = (*authenticator)->jwt_enabled();
  tinker::TinkerApi tinker_api(tinker_options, models, futures, registry->get(), &checkpoints, &rate_limiter);
  absl::StatusOr<std::unique_ptr<tinker::UrlSigner>> url_signer = tinker::UrlSigner::Create(
      config.storage.url_signing_secret,
      (std::filesystem::path(config.storage.data_dir) / "url_signing.key").string());
  if (!url_signer.ok()) return fail(absl::StrCat(where, ": ", url_signer.status().message()));
  tinker_api.SetDownloads(url_signer->get(), absl::Seconds(config.storage.download_url_ttl_s), &retention_clock);
  TinkerServiceImpl tinker_service(state, tinker_api);
  UtilityServiceImpl utility(state);
  TrainingServiceImpl training_service(state);
  SamplerServiceImpl sampler_service(state);
  TestingServiceImpl testing_service(state);
  AdminServiceImpl admin_service(state);
  grpc::ServerBuilder builder;
  int grpc_port = 0;
  const std::string grpc_bind = HostPort(config.server.host, config.server.grpc_port);
  // gRPC sets SO_REUSEPORT by default, which would let a second server bind the same port
  // silently and split the traffic; a port in use must be a startup error instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, config.server.max_concurrent_streams);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                             static_cast<int>(config.server.idle_timeout_s * 1000));
  builder.AddListeningPort(grpc_bind, credentials, &grpc_port);
  if (config.auth.enabled) builder.SetOption(std::make_unique<WithoutReflection>());
  builder.RegisterService(&utility);
  builder.RegisterService(&training_service);
  builder.RegisterService(&tinker_service);
  builder.RegisterService(&sampler_service);
  builder.RegisterService(&admin_service);
  if (config.testing.hooks) builder.RegisterService(&testing_service);
  std::unique_ptr<grpc::Server> grpc_server = builder.BuildAndStart();
  if (!grpc_server || grpc_port == 0) {
    return fail(absl::StrCat(where, ": server.grpc_port: cannot listen for gRPC on ", grpc_bind,
                             " (port in use or address not available)"));
  }
  grpc::HealthCheckServiceInterface* health = grpc_server->GetHealthCheckService();
  health->SetServingStatus(false);

  HttpServer http(metrics, HttpTlsOptions{config.server.tls.cert_file, config.server.tls.key_file,
                                          config.server.tls.client_ca_file});
  const std::string grpc_address = HostPort(config.server.host, grpc_port);
  http.SetLimits({config.server.max_http_connections, static_cast<int>(config.server.idle_timeout_s)});
  // Host and Origin first: a browser's request is refused before its key is even looked at.
  http.AddHeaderCheck([guard = RequestGuardOptions{config.server.host, config.server.allowed_hosts,
                                                   config.server.allowed_origins}](const HttpRequest& head) {
    return CheckHostAndOrigin(guard, head);
  });
  AddHttpRoutes(http, state, grpc_address, tls);
  tinker::AddTinkerRoutes(http, tinker_api, state);
  tinker::AddAdminRoutes(http, tinker_api, state);
  // One tokenizer and chat renderer per base model, in the order of the stacks.
  std::vector<openai::OpenAiOptions> openai_models;
  for (const ModelStack* m : models.stacks()) {
    openai_models.push_back(openai::OptionsFromConfig(m->config(), std::filesystem::absolute(m->model_dir()).string()));
  }
  openai::AddOpenAiRoutes(http, state, tinker_api, std::move(openai_models));
  if (config.testing.hooks) AddRetentionTestRoute(http, state, retention_clock);
  // The access log's tenant: Identify counts no failure; the handlers still authenticate the
  // request themselves.
  http.SetLogTenant([&state](const HttpRequest& r) {
    absl::StatusOr<const tenancy::Tenant*> t = state.authenticator->Identify(r.headers);
    return t.ok() ? (*t)->id : std::string();
  });
  absl::StatusOr<int> http_port = http.Start(config.server.host, config.server.http_port, kHttpThreads);
  if (!http_port.ok()) {
    grpc_server->Shutdown();
    const bool names_key = absl::StartsWith(http_port.status().message(), "server.");  // TLS files
    return fail(absl::StrCat(where, names_key ? ": " : ": server.http_port: ",
                             http_port.status().message()));
  }
  LogInfo(kLog, absl::StrCat("twinkle-server ", kTwinkleVersion, " listening: gRPC ", grpc_address,
                             tls ? " (TLS)" : "", ", HTTP ", HostPort(config.server.host, *http_port)));
  if (!options.port_file.empty()) {
    if (absl::Status s = WritePortFile(options.port_file, grpc_port, *http_port); !s.ok()) {
      grpc_server->Shutdown();
      return fail(std::string(s.message()));
    }
  }

  absl::Notification shutdown;
  SignalWatcher signals([&](int sig) {
    LogInfo(kLog, absl::StrCat("received ", sig == SIGTERM ? "SIGTERM" : "SIGINT",
                               "; draining for up to ", config.server.drain_timeout_s, " s"));
    state.draining = true;
    wait_timers.RunAllNow();  // open waits answer "not done" now: the client comes back later
    // What fails from here on fails because we stop: after the restart it reads as
    // interrupted (retryable), not as that failure.
    (*journal)->BeginShutdown();
    health->Shutdown();  // every service NOT_SERVING now, and it stays so
    for (ModelStack* m : models.stacks()) m->RequestStop();
    shutdown.Notify();
  });

  for (ModelStack* m : models.stacks()) m->Start();
  Housekeeper housekeeper(state);
  ReadinessTracker readiness(state, health, pools);
  // Every pool of every model loads at once. They are spawned from this thread, which lives
  // as long as the workers (a worker is killed when the thread that forked it exits); only the
  // waits run on threads of their own. The first failure stops the others' waits, and its
  // error (not the others' "stopped before ready") is the one reported.
  std::vector<std::pair<std::string, Supervisor*>> all_pools;
  for (ModelStack* m : models.stacks()) {
    all_pools.emplace_back(m->training_pool(), &m->supervisor());
    if (m->sampler_supervisor() != nullptr) all_pools.emplace_back(m->sampler_pool(), m->sampler_supervisor());
  }
  absl::Status started = absl::OkStatus();
  for (auto& [pool, supervisor] : all_pools) {
    started = supervisor->Launch(readiness.ForPool(pool));
    if (!started.ok()) break;
  }
  if (started.ok()) {
    std::vector<absl::Status> ready(all_pools.size());
    std::vector<std::thread> waiters;
    for (size_t i = 0; i < all_pools.size(); ++i) {
      waiters.emplace_back([&, i] {
        ready[i] = all_pools[i].second->WaitReady();
        if (!ready[i].ok()) {
          for (auto& pool : all_pools) pool.second->RequestStop();
        }
      });
    }
    for (std::thread& t : waiters) t.join();
    for (const absl::Status& r : ready) {
      if (!r.ok() && (started.ok() || (absl::IsCancelled(started) && !absl::IsCancelled(r)))) started = r;
    }
  }
  int exit_code = 0;
  if (!started.ok() && !shutdown.HasBeenNotified()) {
    LogError(kLog, std::string(started.message()));
    std::cerr << "twinkle-server: " << started.message() << std::endl;
    exit_code = 1;
  } else {
    if (started.ok()) {
      LogInfo(kLog, models.several()
                        ? absl::StrCat("all engine workers of ", models.stacks().size(), " models (",
                                       models.NamesText(), ") ready: SERVING")
                    : primary.sampler_supervisor() != nullptr
                        ? "all engine workers and the dedicated sampler worker ready: SERVING"
                        : "all engine workers ready: SERVING");
    }
    shutdown.WaitForNotification();
  }

  // Drain: in-flight calls get up to drain_timeout_s; new ones are refused (UNAVAILABLE).
  grpc_server->Shutdown(std::chrono::system_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(config.server.drain_timeout_s * 1000)));
  http.Stop();
  // Running sampling requests and queued work fail with UNAVAILABLE (the step in progress
  // finishes); then the workers stop.
  for (ModelStack* m : models.stacks()) m->StopWork();
  for (ModelStack* m : models.stacks()) m->StopWorkers();
  // Usage counted since the last flush (a crash instead loses at most one flush interval).
  if (absl::Status s = usage.Flush(); !s.ok()) {
    LogWarning(kLog, absl::StrCat("writing the last usage counters: ", s.message()));
  }
  LogInfo(kLog, exit_code == 0 ? "stopped cleanly" : "stopped after a startup error");
  return exit_code;
}

}  // namespace twinkle
