#pragma once
// What every request handler reads: the config, the workers' state, the metrics, and
// whether the server is draining. Owned by the App; handlers hold a reference.

#include <atomic>

#include "core/engine_client/supervisor.h"
#include "server/config/config.h"
#include "server/metrics.h"

namespace twinkle {

struct ServingState {
  ServingState(const Config& c, const Supervisor& s, Metrics& m)
      : config(c), supervisor(s), metrics(m) {}

  // True when every engine worker is ready and no shutdown has begun.
  bool Serving() const { return !draining.load() && supervisor.AllReady(); }

  const Config& config;
  const Supervisor& supervisor;
  Metrics& metrics;
  std::atomic<bool> draining{false};
};

}  // namespace twinkle
