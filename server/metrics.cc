#include "server/metrics.h"

#include <prometheus/text_serializer.h>

#include "absl/strings/str_cat.h"
#include "twinkle_version.h"

namespace twinkle {

Metrics::Metrics()
    : registry_(std::make_shared<prometheus::Registry>()),
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
                     .Help("1 when the engine worker of a rank has loaded the model and is healthy")
                     .Register(*registry_)),
      worker_restarts_(prometheus::BuildCounter()
                           .Name("twinkle_worker_restarts_total")
                           .Help("Times the supervisor restarted the engine worker of a rank")
                           .Register(*registry_)) {
  prometheus::BuildGauge()
      .Name("twinkle_build_info")
      .Help("Build of this server; the value is always 1")
      .Register(*registry_)
      .Add({{"version", kTwinkleVersion}, {"commit", kTwinkleGitCommit}})
      .Set(1);
}

void Metrics::RecordRequest(const std::string& method, const std::string& code, double seconds) {
  requests_.Add({{"method", method}, {"code", code}}).Increment();
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120};
  latency_.Add({{"method", method}}, kBuckets).Observe(seconds);
}

void Metrics::UpdateWorkers(const std::vector<WorkerSnapshot>& workers) {
  absl::MutexLock lock(&mu_);
  restarts_seen_.resize(std::max(restarts_seen_.size(), workers.size()), 0);
  for (const WorkerSnapshot& w : workers) {
    const std::string rank = absl::StrCat(w.rank);
    worker_up_.Add({{"rank", rank}, {"device", w.device}}).Set(w.ready ? 1 : 0);
    auto& restarts = worker_restarts_.Add({{"rank", rank}, {"device", w.device}});
    if (w.restarts > restarts_seen_[w.rank]) {
      restarts.Increment(static_cast<double>(w.restarts - restarts_seen_[w.rank]));
      restarts_seen_[w.rank] = w.restarts;
    }
  }
}

std::string Metrics::Render() const {
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

}  // namespace twinkle
