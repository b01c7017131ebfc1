#include "server/usage_meter.h"

#include <map>
#include <utility>
#include <vector>

namespace twinkle {
namespace {

int64_t HourBucketMicros(absl::Time now) {
  const int64_t us = absl::ToUnixMicros(now);
  constexpr int64_t kHour = int64_t{3600} * 1000000;
  return us - (((us % kHour) + kHour) % kHour);
}

bool IsOptimizerStep(const std::string& name) {
  return name == "optim_step" || name == "step" || name == "clip_grad_and_step";
}

}  // namespace

void UsageMeter::Add(const Who& who, const char* kind, int64_t amount, absl::Time now) {
  if (amount <= 0) return;
  {
    absl::MutexLock lock(&mu_);
    pending_[Key{HourBucketMicros(now), who.tenant, who.key_id, who.session_id, who.run_id, who.base_model, kind}] +=
        amount;
  }
  if (listener_) listener_(who.tenant, kind, amount);
}

void UsageMeter::RecordStep(const std::string& base_model, const sched::StepStats& step, absl::Time now) {
  for (size_t i = 0; i < step.op_usage.size() && i < step.waits.size(); ++i) {
    if (i >= step.op_ok.size() || !step.op_ok[i]) continue;
    const sched::Op::Usage& u = step.op_usage[i];
    const Who who{step.waits[i].first, u.key_id, u.session_id, u.run_id, base_model};
    const int64_t tokens = i < step.op_tokens.size() ? step.op_tokens[i] : 0;
    switch (step.kind) {
      case sched::OpKind::kForwardBackward:
        // A bare Twinkle backward() is queued with a budget of 1 token: its tokens were
        // counted by the forward it completes.
        if (i < step.op_names.size() && step.op_names[i] == "backward") break;
        Add(who, "training", tokens, now);
        break;
      case sched::OpKind::kForward: Add(who, "forward", tokens, now); break;
      default:
        if (i < step.op_names.size() && IsOptimizerStep(step.op_names[i])) Add(who, "optim_steps", 1, now);
        break;
    }
  }
}

void UsageMeter::RecordSample(const std::string& base_model, const sampling::SamplerCoordinator::SampleUsage& u,
                              absl::Time now) {
  const Who who{u.tenant, u.key_id, u.session_id, "", base_model};
  Add(who, "prefill", u.prefill_tokens, now);
  Add(who, "sampled", u.sampled_tokens, now);
}

absl::Status UsageMeter::AccrueStorageLocked(absl::Time now) {
  if (storage_since_ == absl::InfinitePast()) {
    storage_since_ = now;
    return absl::OkStatus();
  }
  // Whole seconds only; the remainder carries over to the next accrual.
  const int64_t seconds = absl::ToInt64Seconds(now - storage_since_);
  if (seconds <= 0) return absl::OkStatus();
  absl::StatusOr<std::vector<registry::CheckpointRecord>> all = registry_.AllCheckpoints();
  if (!all.ok()) return all.status();
  storage_since_ += absl::Seconds(seconds);
  // A run's base model never changes: read once per run, kept while the run holds checkpoints.
  std::map<std::pair<std::string, std::string>, std::string> model_of_run;
  for (const registry::CheckpointRecord& c : *all) {
    auto [it, added] = model_of_run.try_emplace({c.tenant, c.run_id});
    if (added) {
      auto known = model_of_run_.find(it->first);
      if (known != model_of_run_.end()) {
        it->second = known->second;
      } else if (absl::StatusOr<registry::RunRecord> run = registry_.GetRun(c.tenant, c.run_id); run.ok()) {
        it->second = run->base_model;
      }
    }
    Add(Who{c.tenant, 0, "", c.run_id, it->second}, "storage_byte_seconds", c.size_bytes * seconds, now);
  }
  model_of_run_ = std::move(model_of_run);
  return absl::OkStatus();
}

absl::Status UsageMeter::Flush(absl::Time now) {
  absl::MutexLock flush(&flush_mu_);
  absl::Status storage = AccrueStorageLocked(now);
  absl::flat_hash_map<Key, int64_t> batch;
  {
    absl::MutexLock lock(&mu_);
    batch.swap(pending_);
  }
  std::vector<registry::UsageRecord> rows;
  rows.reserve(batch.size());
  for (const auto& [k, amount] : batch) {
    const auto& [bucket, tenant, key_id, session, run, base_model, kind] = k;
    rows.push_back({absl::FromUnixMicros(bucket), tenant, key_id, session, run, kind, amount, base_model});
  }
  if (absl::Status s = registry_.AddUsage(rows); !s.ok()) {
    absl::MutexLock lock(&mu_);
    for (const auto& [k, amount] : batch) pending_[k] += amount;  // kept for the next flush
    return s;
  }
  return storage;
}

}  // namespace twinkle
