#include "server/model_set.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace twinkle {

ModelSet::ModelSet(std::vector<ModelStack*> stacks, registry::Registry* registry)
    : stacks_(std::move(stacks)), registry_(registry) {}

std::string ModelSet::NamesText() const {
  std::vector<std::string> names;
  for (const ModelStack* s : stacks_) names.push_back(absl::StrCat("'", s->name(), "'"));
  return absl::StrJoin(names, ", ");
}

ModelStack* ModelSet::Find(const std::string& id) const {
  for (ModelStack* s : stacks_) {
    if (s->Serves(id)) return s;
  }
  return nullptr;
}

absl::StatusOr<ModelStack*> ModelSet::ForBaseModel(const std::string& id, const std::string& field) const {
  if (id.empty()) return stacks_.front();
  if (ModelStack* s = Find(id)) return s;
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": '", id, "' is not served here (served: ", NamesText(), ")"));
}

ModelStack* ModelSet::OfAdapter(const std::string& tenant, const std::string& name) const {
  for (ModelStack* s : stacks_) {
    if (s->coordinator().HasAdapter(tenant, name)) return s;
  }
  return nullptr;
}

ModelStack* ModelSet::OfRun(const std::string& tenant, const std::string& run_id) const {
  if (!several()) return stacks_.front();
  if (registry_ == nullptr) return nullptr;
  absl::StatusOr<registry::RunRecord> run = registry_->GetRun(tenant, run_id);
  return run.ok() ? Find(run->base_model) : nullptr;
}

ModelStack& ModelSet::ForCheckpoint(const std::string& tenant, const std::string& path) const {
  if (!several()) return primary();
  absl::StatusOr<training::CheckpointPath> parsed = training::ParseCheckpointPath(path, "path");
  if (!parsed.ok()) return primary();
  ModelStack* s = OfRun(tenant, parsed->run_id);
  if (s == nullptr && registry_ != nullptr) {
    // Another tenant's published checkpoint: the model its owner's run was trained on.
    absl::StatusOr<registry::CheckpointRecord> shared =
        registry_->GetPublishedCheckpoint(parsed->run_id, parsed->checkpoint_id());
    if (shared.ok()) s = OfRun(shared->tenant, shared->run_id);
  }
  return s != nullptr ? *s : primary();
}

ModelStack* ModelSet::OfSamplingSession(const std::string& tenant, const std::string& id) const {
  for (ModelStack* s : stacks_) {
    if (s->sampler().HoldsSession(tenant, id)) return s;
  }
  return nullptr;
}

absl::StatusOr<std::string> ModelSet::CreateSession(const training::TenantContext& tenant) const {
  absl::StatusOr<std::string> id = primary().coordinator().CreateSession(tenant);
  if (!id.ok()) return id;
  for (size_t i = 1; i < stacks_.size(); ++i) stacks_[i]->coordinator().JoinSession(tenant.id, *id);
  return id;
}

absl::Status ModelSet::Heartbeat(const training::TenantContext& tenant, const std::string& session_id) const {
  // The default model's coordinator decides (it resumes a session of before a restart); the
  // others follow it.
  absl::Status s = primary().coordinator().Heartbeat(tenant, session_id);
  if (!s.ok()) return s;
  for (size_t i = 1; i < stacks_.size(); ++i) stacks_[i]->coordinator().JoinSession(tenant.id, session_id);
  return s;
}

bool ModelSet::SessionAlive(const std::string& tenant, const std::string& session_id) const {
  return primary().coordinator().SessionAlive(tenant, session_id);
}

absl::Status ModelSet::EndSession(const training::TenantContext& tenant, const std::string& session_id) const {
  absl::Status first = primary().coordinator().EndSession(tenant, session_id);
  for (size_t i = 1; i < stacks_.size(); ++i) (void)stacks_[i]->coordinator().EndSession(tenant, session_id);
  return first;
}

int32_t ModelSet::AdaptersOf(const training::TenantContext& tenant) const {
  int32_t n = 0;
  for (const ModelStack* s : stacks_) n += static_cast<int32_t>(s->coordinator().ListRuns(tenant).size());
  return n;
}

int32_t ModelSet::adapter_count() const {
  int32_t n = 0;
  for (const ModelStack* s : stacks_) n += s->coordinator().adapter_count();
  return n;
}

}  // namespace twinkle
