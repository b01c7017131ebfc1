#include "server/metrics.h"

#include <map>

#include <prometheus/text_serializer.h>

#include "absl/strings/str_cat.h"
#include "twinkle_version.h"

namespace twinkle {

Metrics::Metrics(bool tenant_labels, const std::vector<std::string>& models)
    : per_tenant_labels_(tenant_labels),
      registry_(std::make_shared<prometheus::Registry>()),
      requests_(prometheus::BuildCounter()
                    .Name("twinkle_requests_total")
                    .Help("Requests handled, by method and result code")
                    .Register(*registry_)),
      latency_(prometheus::BuildHistogram()
                   .Name("twinkle_request_duration_seconds")
                   .Help("Request latency from arrival to reply, by method")
                   .Register(*registry_)),
      worker_up_(prometheus::BuildGauge()
                     .Name("twinkle_worker_up")
                     .Help("1 when the engine worker of a pool (training, sampler) and rank is healthy and loaded")
                     .Register(*registry_)),
      worker_restarts_(prometheus::BuildCounter()
                           .Name("twinkle_worker_restarts_total")
                           .Help("Times the supervisor restarted the engine worker of a pool and rank")
                           .Register(*registry_)),
      steps_(prometheus::BuildCounter()
                 .Name("twinkle_scheduler_steps_total")
                 .Help("Engine steps the scheduler ran, by kind")
                 .Register(*registry_)),
      step_adapters_(prometheus::BuildHistogram()
                         .Name("twinkle_fused_step_adapters")
                         .Help("Adapters fused into one forward/forward_backward engine step")
                         .Register(*registry_)),
      step_tokens_(prometheus::BuildHistogram()
                       .Name("twinkle_fused_step_tokens")
                       .Help("Tokens (rows) in one forward/forward_backward engine step")
                       .Register(*registry_)),
      step_duration_(prometheus::BuildHistogram()
                         .Name("twinkle_step_duration_seconds")
                         .Help("Time one scheduler step took in the engine, by kind")
                         .Register(*registry_)),
      tenant_tokens_(prometheus::BuildCounter()
                         .Name("twinkle_tenant_tokens_total")
                         .Help("Tokens of each tenant's ops run by the engine, by kind (forward, forward_backward, "
                               "prefill and sampled of finished sampling requests)")
                         .Register(*registry_)),
      tokens_(prometheus::BuildCounter()
                  .Name("twinkle_tokens_total")
                  .Help("Tokens run through the engine, by kind (forward, forward_backward)")
                  .Register(*registry_)),
      queue_wait_(prometheus::BuildHistogram()
                      .Name("twinkle_queue_wait_seconds")
                      .Help("Time an op waited in its adapter's queue, by tenant (labels capped)")
                      .Register(*registry_)),
      queue_depth_(prometheus::BuildGauge()
                       .Name("twinkle_queue_depth")
                       .Help("Ops queued, by tenant (labels capped)")
                       .Register(*registry_)),
      storage_bytes_(prometheus::BuildGauge()
                         .Name("twinkle_storage_bytes")
                         .Help("Checkpoint bytes stored, by tenant (labels capped)")
                         .Register(*registry_)),
      optimizer_steps_(prometheus::BuildCounter()
                           .Name("twinkle_tenant_optimizer_steps_total")
                           .Help("Optimizer steps that succeeded (Tinker optim_step, Twinkle step and "
                                 "clip_grad_and_step), by tenant (labels capped)")
                           .Register(*registry_)),
      storage_byte_seconds_(prometheus::BuildCounter()
                                .Name("twinkle_tenant_storage_byte_seconds_total")
                                .Help("Checkpoint bytes held x seconds held, accrued at each usage flush, by tenant "
                                      "(labels capped); / 3600 = byte-hours")
                                .Register(*registry_)),
      adapters_(prometheus::BuildGauge()
                    .Name("twinkle_adapters")
                    .Help("Adapters held (state=all) and resident on the device (state=resident)")
                    .Register(*registry_)),
      adapter_events_(prometheus::BuildCounter()
                          .Name("twinkle_adapter_events_total")
                          .Help("Adapter offloads to host memory, reloads, expiries, and restores (or losses) after an engine restart")
                          .Register(*registry_)),
      auth_failures_(prometheus::BuildCounter()
                         .Name("twinkle_auth_failures_total")
                         .Help("Requests refused for a missing, malformed or unknown API key")
                         .Register(*registry_)),
      draining_(prometheus::BuildGauge()
                    .Name("twinkle_draining")
                    .Help("1 while the server drains after SIGTERM: readiness fails, new calls are refused")
                    .Register(*registry_)
                    .Add({})),
      sampler_sessions_(prometheus::BuildGauge()
                            .Name("twinkle_sampler_sessions")
                            .Help("Open sampling sessions, by base model")
                            .Register(*registry_)),
      sampler_snapshots_(prometheus::BuildGauge()
                             .Name("twinkle_sampler_snapshots")
                             .Help("Adapter snapshots held for sampling (freed when no session uses them), by base "
                                   "model")
                             .Register(*registry_)),
      sampler_requests_(prometheus::BuildGauge()
                            .Name("twinkle_sampler_rows")
                            .Help("Sampling rows (prompts) waiting for KV cache room, and running in the engine's batch")
                            .Register(*registry_)),
      sampler_kv_blocks_(prometheus::BuildGauge()
                             .Name("twinkle_sampler_kv_blocks")
                             .Help("KV cache blocks of the workers that sample: in use, and total")
                             .Register(*registry_)),
      sampler_state_slots_(prometheus::BuildGauge()
                               .Name("twinkle_sampler_state_slots")
                               .Help("Recurrent state slots (hybrid models such as Qwen3.5; 0 otherwise) of the "
                                     "workers that sample: in use, and total")
                               .Register(*registry_)),
      sampler_tokens_(prometheus::BuildCounter()
                          .Name("twinkle_sampler_tokens_total")
                          .Help("Tokens generated by the sampler, by base model")
                          .Register(*registry_)) {
  prometheus::BuildGauge()
      .Name("twinkle_build_info")
      .Help("Build of this server; the value is always 1")
      .Register(*registry_)
      .Add({{"version", kTwinkleVersion}, {"commit", kTwinkleGitCommit}})
      .Set(1);
  // Known label values exist from the start (at 0), so a scrape before the first
  // housekeeping tick still shows every adapter and sampler series.
  auth_failures_.Add({});
  for (const std::string& model : models) AddModelSeries(model);
}

void Metrics::AddModelSeries(const std::string& model) {
  for (const char* state : {"all", "resident"}) adapters_.Add({{"model", model}, {"state", state}});
  for (const char* event : {"offload", "reload", "expire"}) adapter_events_.Add({{"model", model}, {"event", event}});
  sampler_sessions_.Add({{"model", model}});
  sampler_snapshots_.Add({{"model", model}});
  sampler_tokens_.Add({{"model", model}});
  for (const char* state : {"waiting", "running"}) sampler_requests_.Add({{"model", model}, {"state", state}});
  for (const char* state : {"in_use", "total"}) {
    sampler_kv_blocks_.Add({{"model", model}, {"state", state}});
    sampler_state_slots_.Add({{"model", model}, {"state", state}});
  }
}

void Metrics::RecordRequest(const std::string& method, const std::string& code, double seconds) {
  prometheus::Histogram* latency = nullptr;
  prometheus::Counter* requests = nullptr;
  {
    std::shared_lock lock(series_mu_);
    if (auto it = series_.find(method); it != series_.end()) {
      latency = it->second->latency;
      if (auto c = it->second->by_code.find(code); c != it->second->by_code.end()) requests = c->second;
    }
  }
  if (requests == nullptr) {  // first request of this (method, code): add its series
    static const prometheus::Histogram::BucketBoundaries kBuckets = {
        0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120};
    std::unique_lock lock(series_mu_);
    std::unique_ptr<RequestSeries>& series = series_[method];
    if (series == nullptr) {
      series = std::make_unique<RequestSeries>();
      series->latency = &latency_.Add({{"method", method}}, kBuckets);
    }
    prometheus::Counter*& counter = series->by_code[code];
    if (counter == nullptr) counter = &requests_.Add({{"method", method}, {"code", code}});
    latency = series->latency;
    requests = counter;
  }
  requests->Increment();
  latency->Observe(seconds);
}

void Metrics::UpdateWorkers(const std::string& pool, const std::vector<WorkerSnapshot>& workers) {
  absl::MutexLock lock(&mu_);
  for (const WorkerSnapshot& w : workers) {
    const std::map<std::string, std::string> labels = {
        {"pool", pool}, {"rank", absl::StrCat(w.rank)}, {"device", w.device}};
    worker_up_.Add(labels).Set(w.ready ? 1 : 0);
    auto& restarts = worker_restarts_.Add(labels);
    int64_t& seen = restarts_seen_[{pool, w.rank}];
    if (w.restarts > seen) {
      restarts.Increment(static_cast<double>(w.restarts - seen));
      seen = w.restarts;
    }
  }
}

namespace {
constexpr size_t kMaxTenantLabels = 32;
}  // namespace

std::string Metrics::TenantLabel(const std::string& tenant) {
  if (!per_tenant_labels_) return "all";
  for (const std::string& t : tenant_labels_) {
    if (t == tenant) return t;
  }
  if (tenant_labels_.size() < kMaxTenantLabels) {
    tenant_labels_.push_back(tenant);
    return tenant;
  }
  return "other";
}

void Metrics::RecordStep(const std::string& kind, int32_t adapters, int64_t tokens, double duration_s,
                         const std::vector<StepOp>& ops) {
  steps_.Add({{"kind", kind}}).Increment();
  static const prometheus::Histogram::BucketBoundaries kDurations = {0.001, 0.005, 0.01, 0.05, 0.1, 0.25,
                                                                     0.5,   1,     2.5,  5,    10,  30, 120};
  step_duration_.Add({{"kind", kind}}, kDurations).Observe(duration_s);
  if (kind != "other") {
    static const prometheus::Histogram::BucketBoundaries kAdapters = {1, 2, 3, 4, 6, 8, 12, 16, 32, 64};
    static const prometheus::Histogram::BucketBoundaries kTokens = {64, 256, 1024, 4096, 16384, 65536};
    step_adapters_.Add({{"kind", kind}}, kAdapters).Observe(adapters);
    step_tokens_.Add({{"kind", kind}}, kTokens).Observe(static_cast<double>(tokens));
    tokens_.Add({{"kind", kind}}).Increment(static_cast<double>(tokens));
  }
  static const prometheus::Histogram::BucketBoundaries kWaits = {0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30};
  absl::MutexLock lock(&mu_);
  for (const StepOp& op : ops) {
    const std::string label = TenantLabel(op.tenant);
    queue_wait_.Add({{"tenant", label}}, kWaits).Observe(op.wait_s);
    if (kind != "other" && op.tokens > 0) {
      tenant_tokens_.Add({{"tenant", label}, {"kind", kind}}).Increment(static_cast<double>(op.tokens));
    }
  }
}

void Metrics::RecordSampleTokens(const std::string& tenant, int64_t prefill, int64_t sampled) {
  absl::MutexLock lock(&mu_);
  const std::string label = TenantLabel(tenant);
  if (prefill > 0) tenant_tokens_.Add({{"tenant", label}, {"kind", "prefill"}}).Increment(static_cast<double>(prefill));
  if (sampled > 0) tenant_tokens_.Add({{"tenant", label}, {"kind", "sampled"}}).Increment(static_cast<double>(sampled));
}

void Metrics::RecordUsage(const std::string& tenant, const std::string& kind, int64_t amount) {
  prometheus::Family<prometheus::Counter>* family = kind == "optim_steps"            ? &optimizer_steps_
                                                    : kind == "storage_byte_seconds" ? &storage_byte_seconds_
                                                                                     : nullptr;
  if (family == nullptr || amount <= 0) return;
  absl::MutexLock lock(&mu_);
  family->Add({{"tenant", TenantLabel(tenant)}}).Increment(static_cast<double>(amount));
}

void Metrics::SetQueueDepths(const std::vector<std::pair<std::string, int64_t>>& depths) {
  absl::MutexLock lock(&mu_);
  std::map<std::string, int64_t> by_label;
  for (const auto& [tenant, depth] : depths) by_label[TenantLabel(tenant)] += depth;
  for (const auto& [label, depth] : by_label) queue_depth_.Add({{"tenant", label}}).Set(static_cast<double>(depth));
}

void Metrics::SetStorageBytes(const std::vector<std::pair<std::string, int64_t>>& bytes) {
  absl::MutexLock lock(&mu_);
  std::map<std::string, int64_t> by_label;
  for (const auto& [tenant, n] : bytes) by_label[TenantLabel(tenant)] += n;
  for (const auto& [label, n] : by_label) storage_bytes_.Add({{"tenant", label}}).Set(static_cast<double>(n));
}

void Metrics::SetAdapters(const std::string& model, int32_t adapters, int32_t resident, int64_t offloads,
                          int64_t reloads, int64_t expired, int64_t restored, int64_t lost) {
  adapters_.Add({{"model", model}, {"state", "all"}}).Set(adapters);
  adapters_.Add({{"model", model}, {"state", "resident"}}).Set(resident);
  absl::MutexLock lock(&mu_);
  ModelSeen& seen = seen_[model];
  auto bump = [&](const char* event, int64_t now, int64_t& last) {
    auto& c = adapter_events_.Add({{"model", model}, {"event", event}});
    if (now > last) c.Increment(static_cast<double>(now - last));
    last = std::max(last, now);
  };
  bump("offload", offloads, seen.offloads);
  bump("reload", reloads, seen.reloads);
  bump("expire", expired, seen.expired);
  bump("restore", restored, seen.restored);
  bump("lose", lost, seen.lost);
}

void Metrics::SetSampler(const std::string& model, const SamplerGauges& g) {
  const prometheus::Labels m{{"model", model}};
  auto with_state = [&](const char* state) {
    prometheus::Labels labels = m;
    labels.emplace("state", state);
    return labels;
  };
  sampler_sessions_.Add(m).Set(static_cast<double>(g.sessions));
  sampler_snapshots_.Add(m).Set(static_cast<double>(g.snapshots));
  sampler_requests_.Add(with_state("waiting")).Set(static_cast<double>(g.waiting));
  sampler_requests_.Add(with_state("running")).Set(static_cast<double>(g.running));
  sampler_kv_blocks_.Add(with_state("in_use")).Set(static_cast<double>(g.kv_blocks_in_use));
  sampler_kv_blocks_.Add(with_state("total")).Set(static_cast<double>(g.kv_blocks_total));
  sampler_state_slots_.Add(with_state("in_use")).Set(static_cast<double>(g.state_slots_in_use));
  sampler_state_slots_.Add(with_state("total")).Set(static_cast<double>(g.state_slots_total));
  absl::MutexLock lock(&mu_);
  int64_t& seen = seen_[model].sampler_tokens;
  if (g.tokens_generated > seen) {
    sampler_tokens_.Add(m).Increment(static_cast<double>(g.tokens_generated - seen));
    seen = g.tokens_generated;
  }
}

void Metrics::RecordAuthFailure() { auth_failures_.Add({}).Increment(); }

void Metrics::SetDraining(bool draining) { draining_.Set(draining ? 1 : 0); }

std::string Metrics::Render() const {
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

}  // namespace twinkle
