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
#include "server/model_set.h"

namespace twinkle {

class UsageMeter;

struct ServingState {
  ServingState(const Config& c, Metrics& m) : config(c), metrics(m) {}

  // True when every engine worker of every model's pools is ready and no shutdown has begun.
  bool Serving() const {
    if (draining.load() || models == nullptr) return false;
    for (const ModelStack* m : models->stacks()) {
      if (!m->AllReady()) return false;
    }
    return true;
  }

  const Config& config;
  Metrics& metrics;
  std::atomic<bool> draining{false};

  // Set by the App before serving; owned by it.
  // The served base models (server/model_set.h): every request that touches a model routes
  // through it. `coordinator`, `sampler` and `checkpoints` below are the default (first)
  // model's, for what is not per model.
  ModelSet* models = nullptr;
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
