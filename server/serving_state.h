#pragma once
// What every request handler reads: the config, the workers' state, the metrics, and
// whether the server is draining. Owned by the App; handlers hold a reference.

#include <atomic>

#include "core/common/timer_thread.h"
#include "core/engine_client/supervisor.h"
#include "core/futures/future_store.h"
#include "core/registry/registry.h"
#include "core/sampling/sampler_coordinator.h"
#include "core/storage/filesystem.h"
#include "core/tenancy/rate_limiter.h"
#include "core/training/coordinator.h"
#include "server/auth/authenticator.h"
#include "server/auth/key_admin.h"
#include "server/config/config.h"
#include "server/metrics.h"

namespace twinkle {

class UsageMeter;

struct ServingState {
  ServingState(const Config& c, const Supervisor& s, Metrics& m)
      : config(c), supervisor(s), metrics(m) {}

  // True when every engine worker of both pools is ready and no shutdown has begun.
  bool Serving() const {
    return !draining.load() && supervisor.AllReady() &&
           (sampler_supervisor == nullptr || sampler_supervisor->AllReady());
  }
  // The workers that sample: the dedicated sampler pool, else the training workers.
  const Supervisor& sampling_supervisor() const {
    return sampler_supervisor != nullptr ? *sampler_supervisor : supervisor;
  }

  const Config& config;
  const Supervisor& supervisor;  // the training workers
  // The dedicated sampler workers (sampler.devices); null when sampling is colocated.
  const Supervisor* sampler_supervisor = nullptr;
  Metrics& metrics;
  std::atomic<bool> draining{false};

  // Set by the App before serving; owned by it.
  Authenticator* authenticator = nullptr;
  tenancy::TokenRateLimiter* rate_limiter = nullptr;
  FutureStore* futures = nullptr;
  TimerThread* wait_timers = nullptr;  // answers gRPC waits whose timeout passes
  training::TrainingCoordinator* coordinator = nullptr;
  sampling::SamplerCoordinator* sampler = nullptr;
  registry::Registry* registry = nullptr;
  training::CheckpointStore* checkpoints = nullptr;
  storage::FaultInjectingFileSystem* faults = nullptr;  // checkpoint I/O; armed by test hooks
  KeyAdmin* keys = nullptr;     // the runtime key set (server/auth/key_admin.h)
  UsageMeter* usage = nullptr;  // usage metering (server/usage_meter.h)
};

}  // namespace twinkle
