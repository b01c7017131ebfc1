#pragma once
// Prometheus metrics of the coordinator, all named twinkle_*. Per-method labels come from
// the fixed set of RPC and route names, so label cardinality stays bounded.

#include <map>
#include <memory>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/engine_client/supervisor.h"

namespace twinkle {

class Metrics {
 public:
  // tenant_labels false: every per-tenant series is kept under tenant="all" (with auth on,
  // /metrics is open without a key and must not list tenant ids; server.metrics_tenant_labels).
  // `models`: the served base models, whose adapter and sampler series (label `model`) exist
  // from the start at 0; a model first named later gets its series then.
  explicit Metrics(bool tenant_labels = true, const std::vector<std::string>& models = {});

  // Records one finished request. `method` is an RPC name ("UtilityService/GetServerInfo")
  // or an HTTP route ("GET /metrics"); `code` a gRPC code name or an HTTP status. The
  // series of a (method, code) are looked up once and cached: prometheus-cpp's Family::Add
  // builds and hashes a label map under the family's lock on every call.
  void RecordRequest(const std::string& method, const std::string& code, double seconds);

  // Mirrors a supervisor's view of its workers into twinkle_worker_up/_restarts_total,
  // labelled with its pool ("training", or "sampler" for dedicated sampler workers).
  void UpdateWorkers(const std::string& pool, const std::vector<WorkerSnapshot>& workers);

  // One op of a scheduler step: whose, how long it queued, its tokens.
  struct StepOp {
    std::string tenant;
    double wait_s = 0;
    int64_t tokens = 0;
  };
  // One scheduler step: its kind ("forward", "forward_backward", "other"), the adapters and
  // tokens it held, how long the engine took, and its ops (queue waits and tokens by tenant).
  void RecordStep(const std::string& kind, int32_t adapters, int64_t tokens, double duration_s,
                  const std::vector<StepOp>& ops);
  // Sampling tokens of a finished request into the same twinkle_tenant_tokens_total, with
  // kind "prefill" and "sampled".
  void RecordSampleTokens(const std::string& tenant, int64_t prefill, int64_t sampled);

  // Metered usage (server/usage_meter.h) of the kinds no other series counts: "optim_steps"
  // into twinkle_tenant_optimizer_steps_total and "storage_byte_seconds" into
  // twinkle_tenant_storage_byte_seconds_total, by tenant (labels capped like the others);
  // other kinds are ignored (the token kinds are twinkle_tenant_tokens_total's).
  void RecordUsage(const std::string& tenant, const std::string& kind, int64_t amount);

  // Gauges sampled by the housekeeping loop.
  // Queued ops by tenant; tenants that share a label ("other" past the cap, or "all") are summed.
  void SetQueueDepths(const std::vector<std::pair<std::string, int64_t>>& depths);
  // Checkpoint bytes stored, by tenant (summed like the queue depths).
  void SetStorageBytes(const std::vector<std::pair<std::string, int64_t>>& bytes);
  // One base model's adapters (label `model`): held and resident, and its coordinator's
  // running totals of adapter events (the counters advance by what they grew since the last call).
  void SetAdapters(const std::string& model, int32_t adapters, int32_t resident, int64_t offloads, int64_t reloads,
                   int64_t expired, int64_t restored, int64_t lost);
  void RecordAuthFailure();
  // 1 from SIGTERM until exit: readiness fails and new calls are refused (server.drain_timeout_s).
  void SetDraining(bool draining);
  // One base model's sampler (label `model`): open sessions, engine snapshots, rows waiting /
  // in the engine's batch, KV cache blocks in use / total, tokens generated so far (a running
  // total), and a hybrid model's recurrent state slots in use / total (0 and 0 for a dense model).
  struct SamplerGauges {
    int64_t sessions = 0, snapshots = 0, waiting = 0, running = 0;
    int64_t kv_blocks_in_use = 0, kv_blocks_total = 0, tokens_generated = 0;
    int64_t state_slots_in_use = 0, state_slots_total = 0;
  };
  void SetSampler(const std::string& model, const SamplerGauges& g);

  // The Prometheus text exposition of every metric.
  std::string Render() const;

 private:
  const bool per_tenant_labels_;
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Histogram>& latency_;
  prometheus::Family<prometheus::Gauge>& worker_up_;
  prometheus::Family<prometheus::Counter>& worker_restarts_;
  prometheus::Family<prometheus::Counter>& steps_;
  prometheus::Family<prometheus::Histogram>& step_adapters_;
  prometheus::Family<prometheus::Histogram>& step_tokens_;
  prometheus::Family<prometheus::Histogram>& step_duration_;
  prometheus::Family<prometheus::Counter>& tenant_tokens_;
  prometheus::Family<prometheus::Counter>& tokens_;
  prometheus::Family<prometheus::Histogram>& queue_wait_;
  prometheus::Family<prometheus::Gauge>& queue_depth_;
  prometheus::Family<prometheus::Gauge>& storage_bytes_;
  prometheus::Family<prometheus::Counter>& optimizer_steps_;
  prometheus::Family<prometheus::Counter>& storage_byte_seconds_;
  prometheus::Family<prometheus::Gauge>& adapters_;
  prometheus::Family<prometheus::Counter>& adapter_events_;
  prometheus::Family<prometheus::Counter>& auth_failures_;
  prometheus::Gauge& draining_;
  prometheus::Family<prometheus::Gauge>& sampler_sessions_;
  prometheus::Family<prometheus::Gauge>& sampler_snapshots_;
  prometheus::Family<prometheus::Gauge>& sampler_requests_;
  prometheus::Family<prometheus::Gauge>& sampler_kv_blocks_;
  prometheus::Family<prometheus::Gauge>& sampler_state_slots_;
  prometheus::Family<prometheus::Counter>& sampler_tokens_;
  // RecordRequest's cache of series, per method: its latency histogram and its request
  // counter per code. Read-mostly: a shared lock on the hot path, exclusive to add a series
  // (a std::shared_mutex, which costs less per call than absl::Mutex with deadlock detection).
  struct RequestSeries {
    prometheus::Histogram* latency = nullptr;
    std::unordered_map<std::string, prometheus::Counter*> by_code;
  };
  std::shared_mutex series_mu_;
  std::unordered_map<std::string, std::unique_ptr<RequestSeries>> series_;  // by method
  absl::Mutex mu_;
  std::map<std::pair<std::string, int32_t>, int64_t> restarts_seen_ ABSL_GUARDED_BY(mu_);  // (pool, rank)
  // Per-tenant label values: the first kMaxTenantLabels tenants seen get their own; the
  // rest share "other", so a flood of tenants cannot blow up the series count.
  std::string TenantLabel(const std::string& tenant) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<std::string> tenant_labels_ ABSL_GUARDED_BY(mu_);
  // Per model: the running totals the counters were last advanced to.
  struct ModelSeen {
    int64_t offloads = 0, reloads = 0, expired = 0, restored = 0, lost = 0, sampler_tokens = 0;
  };
  std::map<std::string, ModelSeen> seen_ ABSL_GUARDED_BY(mu_);
  // The series of a model, at 0 (idempotent).
  void AddModelSeries(const std::string& model);
};

// Measures one request from construction to destruction.
class RequestTimer {
 public:
  RequestTimer(Metrics& metrics, std::string method)
      : metrics_(metrics), method_(std::move(method)), start_(absl::Now()) {}
  ~RequestTimer() { metrics_.RecordRequest(method_, code_, absl::ToDoubleSeconds(absl::Now() - start_)); }
  void set_code(std::string code) { code_ = std::move(code); }

 private:
  Metrics& metrics_;
  std::string method_;
  std::string code_ = "OK";
  absl::Time start_;
};

}  // namespace twinkle
