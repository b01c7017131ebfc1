// TrainingCoordinator: lifecycle (the scheduler's executor, the checkpoint I/O thread),
// sessions, and adapters (add, remove, release, housekeeping, run listings). Submission of
// ops is in coordinator_submit.cc, their execution in coordinator_execution.cc, checkpoints
// in coordinator_checkpoints.cc.
#include "core/training/coordinator.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <random>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "core/common/log.h"
#include "core/ipc/messages.h"
#include "core/ipc/training_messages.h"
#include "core/training/coordinator_state.h"
#include "core/storage/names.h"
#include "core/training/inputs.h"

namespace twinkle::training {
namespace {

using coordinator_internal::kLog;

std::string Hex8(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%08llx", static_cast<unsigned long long>(v & 0xffffffffULL));
  return buf;
}

}  // namespace

class TrainingCoordinator::Runner final : public sched::Executor {
 public:
  explicit Runner(TrainingCoordinator& c) : c_(c) {}
  std::vector<FutureResult> Execute(const std::vector<const sched::Op*>& batch) override {
    if (batch.size() == 1 && batch[0]->kind == sched::OpKind::kOther) {
      c_.current_op_ = batch[0]->id;
      const auto* control = std::any_cast<ControlPayload>(&batch[0]->payload);
      if (control == nullptr) return {absl::InternalError("a control op without its payload")};
      return {control->run()};
    }
    return c_.RunFused(batch);
  }

 private:
  TrainingCoordinator& c_;
};

// ---- lifecycle -----------------------------------------------------------------------------

TrainingCoordinator::TrainingCoordinator(CoordinatorOptions options, EngineLink& engine,
                                         FutureStore& futures, const Clock& clock)
    : options_(std::move(options)), engine_(engine), futures_(futures), clock_(clock), started_at_(clock.Now()) {
  runner_ = std::make_unique<Runner>(*this);
  sched::SchedulerOptions so = options_.scheduler;
  // A fused step's adapters must all be resident at once.
  so.max_ops_per_step = std::max(1, std::min(so.max_ops_per_step, options_.max_loras));
  so.max_activation_bytes_per_step = options_.activation_memory_bytes;
  scheduler_ = std::make_unique<sched::Scheduler>(so, *runner_, futures_, clock_);
}

TrainingCoordinator::~TrainingCoordinator() { Stop(); }

void TrainingCoordinator::Start() {
  io_jobs_.Start();
  export_jobs_.Start();
  scheduler_->Start();
}

void TrainingCoordinator::Stop() {
  scheduler_->Stop();
  io_jobs_.Stop();      // finishes the writes already started
  export_jobs_.Stop();  // exports still running are cancelled (their child killed)
}

CoordinatorStats TrainingCoordinator::stats() const {
  absl::MutexLock lock(&mu_);
  CoordinatorStats s = stats_;
  s.adapters = static_cast<int32_t>(adapters_.size());
  return s;
}

int32_t TrainingCoordinator::adapter_count() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int32_t>(adapters_.size());
}

bool TrainingCoordinator::HasAdapter(const std::string& tenant, const std::string& name) const {
  absl::MutexLock lock(&mu_);
  return adapters_.count(absl::StrCat(tenant, "/", name)) > 0;
}

// ---- sessions ------------------------------------------------------------------------------

absl::StatusOr<std::string> TrainingCoordinator::CreateSession(const TenantContext& tenant) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  std::string id;
  {
    absl::MutexLock lock(&mu_);
    // Bounded by tenants x max_sessions, so counting is cheap next to the registry write.
    const auto open = std::count_if(sessions_.begin(), sessions_.end(),
                                    [&](const auto& s) { return s.second.tenant == tenant.id; });
    if (open >= tenant.max_sessions) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tenant '", tenant.id, "' has ", open, " open sessions, its limit (max_sessions) is ", tenant.max_sessions,
          ": end one (Tinker: ServiceClient close / sessions/{id}/finish) or let one stop heartbeating"));
    }
    id = absl::StrCat("s", next_session_++, "-", Hex8(rng()));
    sessions_[id] = Session{tenant.id, clock_.Now()};
  }
  if (options_.registry != nullptr) (void)options_.registry->PutSession(id, tenant.id, clock_.Now());
  return id;
}

absl::Status TrainingCoordinator::Heartbeat(const TenantContext& tenant, const std::string& session_id) {
  const absl::Status unknown = absl::NotFoundError(absl::StrCat("no session '", session_id, "'"));
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(session_id);
    if (it != sessions_.end() && it->second.tenant == tenant.id) {
      it->second.last_heartbeat = clock_.Now();
      return absl::OkStatus();
    }
    if (it != sessions_.end() || options_.registry == nullptr || resumed_.count(session_id) > 0 ||
        not_resumable_.contains(absl::StrCat(tenant.id, "\n", session_id))) {
      return unknown;
    }
  }
  // An earlier run's session, after a restart: the SDK keeps heartbeating it and creating
  // models in it, so it goes on (read outside mu_: a SQLite read).
  absl::StatusOr<registry::SessionRecord> row = options_.registry->GetSession(session_id, tenant.id);
  const bool resumable = row.ok() && row->finished == absl::InfinitePast() && row->created < started_at_;
  absl::MutexLock lock(&mu_);
  if (!resumable) {
    // Remembered unless the read itself failed (it may succeed next time).
    if (row.ok() || absl::IsNotFound(row.status())) {
      std::string key = absl::StrCat(tenant.id, "\n", session_id);
      if (not_resumable_.insert(key).second) {
        not_resumable_order_.push_back(std::move(key));
        if (not_resumable_order_.size() > kMaxNotResumable) {
          not_resumable_.erase(not_resumable_order_.front());
          not_resumable_order_.pop_front();
        }
      }
    }
    return unknown;
  }
  if (sessions_.count(session_id) > 0 || !resumed_.insert(session_id).second) return unknown;
  const auto open = std::count_if(sessions_.begin(), sessions_.end(),
                                  [&](const auto& s) { return s.second.tenant == tenant.id; });
  if (open >= tenant.max_sessions) {
    resumed_.erase(session_id);
    return absl::FailedPreconditionError(absl::StrCat(
        "tenant '", tenant.id, "' has ", open, " open sessions, its limit (max_sessions) is ", tenant.max_sessions,
        ": session '", session_id, "' of before the restart cannot resume until one ends"));
  }
  sessions_[session_id] = Session{tenant.id, clock_.Now()};
  LogInfo(kLog, absl::StrCat("tenant ", tenant.id, ": session ", session_id, " resumed after a restart"));
  return absl::OkStatus();
}

void TrainingCoordinator::JoinSession(const std::string& tenant, const std::string& session_id) {
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = sessions_.try_emplace(session_id, Session{tenant, clock_.Now()});
  if (!inserted && it->second.tenant == tenant) it->second.last_heartbeat = clock_.Now();
}

bool TrainingCoordinator::SessionAlive(const std::string& tenant, const std::string& session_id) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  return it != sessions_.end() && it->second.tenant == tenant;
}

absl::Status TrainingCoordinator::EndSession(const TenantContext& tenant, const std::string& session_id) {
  std::vector<std::shared_ptr<Adapter>> owned;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end() || it->second.tenant != tenant.id) {
      return absl::NotFoundError(absl::StrCat("no session '", session_id, "'"));
    }
    sessions_.erase(it);
    for (const auto& [key, a] : adapters_) {
      if (a->tenant == tenant.id && a->session_id == session_id) owned.push_back(a);
    }
  }
  for (const std::shared_ptr<Adapter>& a : owned) {
    LogInfo(kLog, absl::StrCat("tenant ", a->tenant, ": adapter ", a->name, " released: its session ended"));
    Release(a, absl::AbortedError(absl::StrCat("adapter '", a->name, "' was released: its session ", session_id,
                                               " ended")));
  }
  return absl::OkStatus();
}

// ---- adapters ------------------------------------------------------------------------------

absl::StatusOr<std::shared_ptr<TrainingCoordinator::Adapter>> TrainingCoordinator::Find(
    const TenantContext& tenant, const std::string& name) const {
  absl::MutexLock lock(&mu_);
  // Keys embed the tenant, so another tenant's adapter is simply not found.
  auto it = adapters_.find(absl::StrCat(tenant.id, "/", name));
  if (it == adapters_.end()) return absl::NotFoundError(absl::StrCat("no adapter '", name, "'"));
  it->second->last_request_ns = absl::ToUnixNanos(clock_.Now());
  return it->second;
}

namespace {
RunInfo MakeRunInfo(const std::string& run_id, const std::string& name, const std::string& tenant,
                    const LoraArgs& lora, absl::Time created, int64_t last_request_ns) {
  RunInfo r;
  r.run_id = run_id;
  r.adapter_name = name;
  r.tenant = tenant;
  r.lora_rank = lora.rank;
  r.target_modules = lora.targets;
  r.created = created;
  r.last_request = last_request_ns > 0 ? absl::FromUnixNanos(last_request_ns) : created;
  return r;
}
}  // namespace

std::vector<RunInfo> TrainingCoordinator::ListRuns(const TenantContext& tenant) const {
  std::vector<RunInfo> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [key, a] : adapters_) {
    if (a->tenant != tenant.id) continue;
    out.push_back(MakeRunInfo(a->run_id, a->name, a->tenant, a->lora, a->created, a->last_request_ns));
  }
  std::sort(out.begin(), out.end(), [](const RunInfo& x, const RunInfo& y) { return x.created > y.created; });
  return out;
}

absl::StatusOr<RunInfo> TrainingCoordinator::GetRun(const TenantContext& tenant, const std::string& run_id) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [key, a] : adapters_) {
    if (a->tenant == tenant.id && a->run_id == run_id) {
      return MakeRunInfo(a->run_id, a->name, a->tenant, a->lora, a->created, a->last_request_ns);
    }
  }
  return absl::NotFoundError(absl::StrCat("no training run '", run_id, "'"));
}

absl::StatusOr<OpOutput> TrainingCoordinator::WaitFor(uint64_t id, const std::string& tenant) {
  absl::StatusOr<FutureResult> r = futures_.Wait(id, tenant, absl::InfiniteDuration());
  if (!r.ok()) return r.status();
  if (!r->ok()) return r->status();
  absl::StatusOr<const OpOutput*> out = ValueAs<OpOutput>(**r, "training result");
  if (!out.ok()) return out.status();
  return **out;
}

absl::StatusOr<AddAdapterResult> TrainingCoordinator::AddAdapter(const TenantContext& tenant,
                                                                 const AddAdapterArgs& args) {
  // The same rule as checkpoint names (an adapter's name names its run folder): "..", "."
  // and names starting with '.' are refused along with any character outside [A-Za-z0-9._-].
  if (absl::Status s = storage::ValidatePathName(args.name, "adapter_name"); !s.ok()) return s;
  const LoraArgs& lora = args.lora;
  if (lora.rank <= 0) return absl::InvalidArgumentError(absl::StrCat("config.r: ", lora.rank, " must be positive"));
  if (lora.rank > options_.max_lora_rank) {
    return absl::InvalidArgumentError(absl::StrCat("config.r: ", lora.rank, " above the server's limit of ",
                                                   options_.max_lora_rank, " (limits.max_lora_rank)"));
  }
  if (lora.rank > tenant.max_lora_rank) {
    return absl::FailedPreconditionError(absl::StrCat("config.r: ", lora.rank, " above your quota of ",
                                                      tenant.max_lora_rank, " (max_lora_rank)"));
  }
  if (!(lora.alpha > 0) || !std::isfinite(lora.alpha)) {
    return absl::InvalidArgumentError(absl::StrCat("config.lora_alpha: ", lora.alpha, " must be positive"));
  }
  if (!(lora.dropout >= 0 && lora.dropout < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("config.lora_dropout: ", lora.dropout, " must be in [0, 1)"));
  }
  if (args.gradient_accumulation_steps < 1) {
    return absl::InvalidArgumentError(absl::StrCat("gradient_accumulation_steps: ", args.gradient_accumulation_steps,
                                                   " must be at least 1"));
  }
  auto adapter = std::make_shared<Adapter>();
  adapter->tenant = tenant.id;
  adapter->name = args.name;
  adapter->key = absl::StrCat(tenant.id, "/", args.name);
  adapter->session_id = args.session_id;
  adapter->lora = lora;
  adapter->gradient_accumulation_steps = args.gradient_accumulation_steps;
  adapter->created = clock_.Now();
  {
    absl::MutexLock lock(&mu_);
    if (!args.session_id.empty()) {
      auto s = sessions_.find(args.session_id);
      if (s == sessions_.end() || s->second.tenant != tenant.id) {
        return absl::NotFoundError(absl::StrCat("session_id: no session '", args.session_id, "'"));
      }
    }
    if (adapters_.count(adapter->key)) {
      return absl::AlreadyExistsError(absl::StrCat("adapter '", args.name, "' already exists"));
    }
    int32_t mine = 0;
    for (const auto& [key, a] : adapters_) mine += a->tenant == tenant.id;
    if (mine >= tenant.max_adapters) {
      return absl::FailedPreconditionError(absl::StrCat("you have ", mine, " adapters, your quota (max_adapters) is ",
                                                        tenant.max_adapters, "; remove one first"));
    }
    if (static_cast<int32_t>(adapters_.size()) >= options_.max_adapters) {
      return absl::FailedPreconditionError(absl::StrCat(options_.capacity_holder, " holds its maximum of ",
                                                        options_.max_adapters, " adapters (", options_.capacity_key,
                                                        ")"));
    }
    adapter->run_id = absl::StrCat(args.session_id.empty() ? Hex8(std::hash<std::string>{}(adapter->key) ^
                                                                  absl::ToUnixNanos(adapter->created))
                                                           : args.session_id,
                                   "-", args.name);
    adapters_[adapter->key] = adapter;
  }
  // Created on the engine by a queued op, so residency bookkeeping stays on one thread.
  absl::StatusOr<uint64_t> id = SubmitControlOp(
      tenant, adapter, "add_adapter",
      [this, adapter]() -> FutureResult {
        SyncGeneration();
        if (absl::Status s = EnsureResident(*adapter, {adapter.get()}); !s.ok()) return s;
        return OpOutput{};
      },
      {});
  absl::StatusOr<OpOutput> done = id.ok() ? WaitFor(*id, tenant.id) : absl::StatusOr<OpOutput>(id.status());
  if (id.ok()) futures_.Release(*id);  // an internal op: its id was never handed out
  if (!done.ok()) {
    absl::MutexLock lock(&mu_);
    adapters_.erase(adapter->key);
    return done.status();
  }
  if (options_.registry != nullptr) {
    registry::RunRecord run;
    run.run_id = adapter->run_id;
    run.tenant = tenant.id;
    run.adapter_name = args.name;
    run.base_model = options_.base_model;
    nlohmann::json lora_json = {{"r", lora.rank}, {"lora_alpha", lora.alpha}, {"lora_dropout", lora.dropout},
                                {"target_modules", lora.targets}, {"use_rslora", lora.use_rslora}};
    run.lora_config_json = lora_json.dump();
    run.created = run.last_request = adapter->created;
    if (absl::Status s = options_.registry->PutRun(run); !s.ok()) {
      LogWarning(kLog, absl::StrCat("recording run ", adapter->run_id, ": ", s.message()));
    }
  }
  LogInfo(kLog, absl::StrCat("tenant ", tenant.id, ": adapter ", args.name, " added (r=", lora.rank, ")"));
  // num_parameters was set on the scheduler thread; the future's completion orders it before us.
  return AddAdapterResult{args.name, adapter->num_parameters, adapter->run_id};
}

absl::Status TrainingCoordinator::RemoveAdapter(const TenantContext& tenant, const std::string& name) {
  absl::StatusOr<std::shared_ptr<Adapter>> adapter = Find(tenant, name);
  if (!adapter.ok()) return adapter.status();
  Release(*adapter, absl::CancelledError(absl::StrCat("adapter '", name, "' was removed")));
  return absl::OkStatus();
}

void TrainingCoordinator::Release(const std::shared_ptr<Adapter>& adapter, const absl::Status& why) {
  {
    absl::MutexLock lock(&mu_);
    if (adapters_.erase(adapter->key) == 0) return;  // already released
  }
  scheduler_->DropAdapter(adapter->key, why);
  // The engine side goes through the queue too (residency is the scheduler thread's).
  sched::Op op;
  op.tenant = adapter->tenant;
  op.adapter = adapter->key;
  op.kind = sched::OpKind::kOther;
  op.name = "remove_adapter";
  op.payload = ControlPayload{[this, adapter]() -> FutureResult {
    SyncGeneration();
    if (adapter->resident && !adapter->lost) {
      ipc::AdapterRequest req{adapter->key};
      absl::StatusOr<ipc::Message> r = CallEngine(ipc::kMethodRemoveAdapter, ipc::Pack(req));
      if (!r.ok()) LogWarning(kLog, absl::StrCat("removing ", adapter->key, ": ", r.status().message()));
    }
    if (adapter->resident) {
      absl::MutexLock lock(&mu_);
      --stats_.resident;
    }
    adapter->resident = false;
    adapter->host_state.reset();
    adapter->restore_point.reset();
    return OpOutput{};
  }};
  absl::StatusOr<uint64_t> id = scheduler_->Submit(std::move(op));
  if (id.ok()) {
    (void)futures_.Wait(*id, adapter->tenant, absl::InfiniteDuration());
    futures_.Release(*id);  // an internal op: its id was never handed out
  }
  scheduler_->DropAdapter(adapter->key, why);  // forget the queue the removal op made
}

void TrainingCoordinator::Housekeep() {
  const absl::Time now = clock_.Now();
  std::vector<std::pair<std::shared_ptr<Adapter>, std::string>> expired;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, a] : adapters_) {
      if (now - a->created >= options_.adapter_max_lifetime) {
        expired.emplace_back(a, "its maximum lifetime (sessions.adapter_max_lifetime_s) ended");
        continue;
      }
      if (a->session_id.empty()) continue;
      auto s = sessions_.find(a->session_id);
      if (s == sessions_.end() || now - s->second.last_heartbeat >= options_.adapter_timeout) {
        expired.emplace_back(a, "its session stopped heartbeating (sessions.adapter_timeout_s)");
      }
    }
    for (auto it = sessions_.begin(); it != sessions_.end();) {
      it = now - it->second.last_heartbeat >= options_.adapter_timeout ? sessions_.erase(it) : std::next(it);
    }
    stats_.expired += static_cast<int64_t>(expired.size());
  }
  for (const auto& [adapter, why] : expired) {
    LogInfo(kLog, absl::StrCat("tenant ", adapter->tenant, ": adapter ", adapter->name, " expired: ", why));
    Release(adapter, absl::AbortedError(absl::StrCat("adapter '", adapter->name, "' expired: ", why)));
  }
}

}  // namespace twinkle::training
