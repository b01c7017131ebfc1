#pragma once
// One base model's serving stack (docs/config.md, `models:`): its training workers (a
// Supervisor and the DataParallelLink over them), its dedicated sampler workers if any, its
// TrainingCoordinator (with its scheduler), its SamplerCoordinator and its CheckpointStore.
// The server builds one per served model from ForModel(config, i); the registry, futures,
// auth, metrics, usage and the HTTP/gRPC servers are shared by all of them (server/app.cc).
// Adapters of a model live on its workers only, so a model's capacity
// (models[i].max_adapters) is never taken by another model's adapters.
//
// ModelSet (model_set.h) is what the APIs route through: by base model name, by adapter,
// by run, by sampling session.

#include <memory>
#include <string>
#include <vector>

#include "core/common/clock.h"
#include "core/engine_client/data_parallel_link.h"
#include "core/engine_client/supervisor.h"
#include "core/engine_client/supervisor_engine_link.h"
#include "core/futures/future_store.h"
#include "core/registry/registry.h"
#include "core/sampling/sampler_coordinator.h"
#include "core/storage/filesystem.h"
#include "core/training/checkpoints.h"
#include "core/training/coordinator.h"
#include "server/config/config.h"

namespace twinkle {

class Metrics;
class UsageMeter;

// What the stacks share; owned by the App and outliving every stack.
struct ModelStackDeps {
  registry::Registry* registry = nullptr;
  FutureStore* futures = nullptr;
  storage::FileSystem* checkpoint_fs = nullptr;  // the fault-injection seam (test hooks)
  const Clock* retention_clock = nullptr;        // checkpoint expiry (advance_clock moves it)
  Metrics* metrics = nullptr;
  UsageMeter* usage = nullptr;
  std::string node_secret;  // engines on other nodes (nodes.secret_file), single model only
  std::vector<std::string> model_names;  // every served model's name, in config order
};

class ModelStack {
 public:
  // `config`: ForModel(server config, index). `several`: the server serves more than one
  // model, so the worker pools are labelled with the model's name (logs, metrics); a single
  // model keeps the labels it always had ("training", "sampler"). `index`: its place in
  // `models:`, for the keys its errors name.
  ModelStack(Config config, const ModelStackDeps& deps, bool several, size_t index = 0);
  ~ModelStack();
  ModelStack(const ModelStack&) = delete;
  ModelStack& operator=(const ModelStack&) = delete;

  const Config& config() const { return config_; }
  const std::string& name() const { return config_.model.name; }
  const std::string& model_dir() const { return config_.model.path; }
  // Whether `id` names this model: its name or its directory (absolute, as configured).
  bool Serves(const std::string& id) const;

  Supervisor& supervisor() { return *supervisor_; }
  const Supervisor& supervisor() const { return *supervisor_; }
  // The dedicated sampler workers (sampler_devices); null when sampling is colocated.
  Supervisor* sampler_supervisor() { return sampler_supervisor_.get(); }
  const Supervisor* sampler_supervisor() const { return sampler_supervisor_.get(); }
  // The workers that sample: the dedicated pool, else the training workers.
  const Supervisor& sampling_supervisor() const {
    return sampler_supervisor_ != nullptr ? *sampler_supervisor_ : *supervisor_;
  }
  training::TrainingCoordinator& coordinator() { return *coordinator_; }
  const training::TrainingCoordinator& coordinator() const { return *coordinator_; }
  sampling::SamplerCoordinator& sampler() { return *sampler_; }
  const sampling::SamplerCoordinator& sampler() const { return *sampler_; }
  training::CheckpointStore& checkpoints() { return *checkpoints_; }

  // Metrics labels of the two pools.
  const std::string& training_pool() const { return training_pool_; }
  const std::string& sampler_pool() const { return sampler_pool_; }
  // Every worker of both pools is ready.
  bool AllReady() const {
    return supervisor_->AllReady() && (sampler_supervisor_ == nullptr || sampler_supervisor_->AllReady());
  }

  // The coordinator's and the sampler's threads.
  void Start();
  // Makes pending waits for the workers return (the signal thread; any thread).
  void RequestStop();
  // Shutdown in two halves, so that every model's work stops before any model's workers:
  // StopWork fails running sampling requests and queued training work (UNAVAILABLE; the step
  // in progress finishes), StopWorkers then stops the workers. Both idempotent.
  void StopWork();
  void StopWorkers();

 private:
  Config config_;
  std::string training_pool_;
  std::string sampler_pool_;
  std::unique_ptr<Supervisor> supervisor_;
  std::unique_ptr<Supervisor> sampler_supervisor_;
  std::unique_ptr<DataParallelLink> engine_link_;
  std::vector<std::unique_ptr<SupervisorEngineLink>> sampler_links_;
  std::unique_ptr<training::CheckpointStore> checkpoints_;
  std::unique_ptr<training::TrainingCoordinator> coordinator_;
  std::unique_ptr<sampling::SamplerCoordinator> sampler_;
  bool work_stopped_ = false;
  bool workers_stopped_ = false;
};

}  // namespace twinkle
