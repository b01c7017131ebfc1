#pragma once
// Prometheus metrics of the coordinator, all named twinkle_*. Per-method labels come from
// the fixed set of RPC and route names, so label cardinality stays bounded.

#include <memory>
#include <string>
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
  Metrics();

  // Records one finished request. `method` is an RPC name ("UtilityService/GetServerInfo")
  // or an HTTP route ("GET /metrics"); `code` a gRPC code name or an HTTP status.
  void RecordRequest(const std::string& method, const std::string& code, double seconds);

  // Mirrors the supervisor's view of the workers into twinkle_worker_up/_restarts_total.
  void UpdateWorkers(const std::vector<WorkerSnapshot>& workers);

  // The Prometheus text exposition of every metric.
  std::string Render() const;

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Histogram>& latency_;
  prometheus::Family<prometheus::Gauge>& worker_up_;
  prometheus::Family<prometheus::Counter>& worker_restarts_;
  absl::Mutex mu_;
  std::vector<int64_t> restarts_seen_ ABSL_GUARDED_BY(mu_);
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
