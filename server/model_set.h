#pragma once
// Routing between the base models one server serves (config `models:`, docs/config.md), for
// every API: a request names its model (Tinker base_model, Twinkle AddAdapter.base_model,
// OpenAI `model`) or something that lives on one (an adapter, a training run, a sampling
// session), and ModelSet finds that model's stack (server/model_stack.h). The one place that
// knows how several models share a session, too.

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/registry/registry.h"
#include "core/training/types.h"
#include "server/model_stack.h"

namespace twinkle {

class ModelSet {
 public:
  // `stacks`: at least one; stacks[0] (the first configured model) is the default, used
  // where a request names no model (an empty base_model), and by clients of one model.
  ModelSet(std::vector<ModelStack*> stacks, registry::Registry* registry);

  const std::vector<ModelStack*>& stacks() const { return stacks_; }
  ModelStack& primary() const { return *stacks_.front(); }
  bool several() const { return stacks_.size() > 1; }
  // "'a', 'b'": the served models, for error messages.
  std::string NamesText() const;

  // The model named `id` (a models[i].name or its directory); null when none is.
  ModelStack* Find(const std::string& id) const;
  // Find, with an empty id meaning the default model; an unknown one is InvalidArgument
  // naming `field`, the id and the served models:
  //   "base_model: 'x' is not served here (served: 'a', 'b')".
  absl::StatusOr<ModelStack*> ForBaseModel(const std::string& id, const std::string& field = "base_model") const;
  // The model holding the tenant's adapter `name`; null when no model holds one.
  ModelStack* OfAdapter(const std::string& tenant, const std::string& name) const;
  // The coordinator of the model holding the tenant's adapter `name`; the default model's
  // when none does (it answers NotFound for the adapter as it always has).
  training::TrainingCoordinator& CoordinatorFor(const std::string& tenant, const std::string& name) const {
    ModelStack* s = OfAdapter(tenant, name);
    return (s != nullptr ? s : stacks_.front())->coordinator();
  }
  // The model a training run of the tenant was made on (its registry row's base_model); null
  // when the run or its model is unknown.
  ModelStack* OfRun(const std::string& tenant, const std::string& run_id) const;
  // The model a checkpoint path (twinkle://<run>/..., or tinker:// with a run id) was
  // trained on: the tenant's run's, or the owner's run's for another tenant's published
  // checkpoint; the default model when the path or its run is unknown (its store then
  // answers for it, NotFound or a bad path, as with one model).
  ModelStack& ForCheckpoint(const std::string& tenant, const std::string& path) const;
  // The model whose sampler holds this sampling session (open, or journaled on it before a
  // restart and not yet reopened); null when none.
  ModelStack* OfSamplingSession(const std::string& tenant, const std::string& id) const;
  // Its sampler, or the default model's when no model has the session open (it answers
  // NotFound, or why the session was released, as with one model).
  sampling::SamplerCoordinator& SamplerFor(const std::string& tenant, const std::string& id) const {
    ModelStack* s = OfSamplingSession(tenant, id);
    return (s != nullptr ? s : stacks_.front())->sampler();
  }

  // Sessions span models: a Tinker ServiceClient may create training clients on two base
  // models in one session. A session is created by the default model's coordinator (its
  // registry row, the tenant's max_sessions) and joined by every other one, so adapters of any
  // model can belong to it; heartbeats keep it alive everywhere and ending it ends it
  // everywhere (releasing every model's adapters of it).
  absl::StatusOr<std::string> CreateSession(const training::TenantContext& tenant) const;
  absl::Status Heartbeat(const training::TenantContext& tenant, const std::string& session_id) const;
  bool SessionAlive(const std::string& tenant, const std::string& session_id) const;
  absl::Status EndSession(const training::TenantContext& tenant, const std::string& session_id) const;

  // Adapters on all models.
  int32_t adapter_count() const;
  // The tenant's adapters on all models (its max_adapters quota is over all of them).
  int32_t AdaptersOf(const training::TenantContext& tenant) const;

 private:
  std::vector<ModelStack*> stacks_;
  registry::Registry* registry_;
};

}  // namespace twinkle
