#include "core/training/coordinator.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <atomic>
#include <random>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/log.h"
#include "core/training/lr_scheduler.h"
#include "core/ipc/messages.h"
#include "core/ipc/training_messages.h"
#include "core/storage/names.h"
#include "core/training/inputs.h"

namespace twinkle::training {
namespace {

constexpr char kLog[] = "training";
// Twinkle's transformers backend defaults (twinkle-api.md §7).
constexpr double kDefaultLr = 1e-5;
constexpr double kDefaultWeightDecay = 0.01;

// Twinkle class names → the engine's loss names; engine names pass through.
std::string EngineLossName(const std::string& cls) {
  static const std::map<std::string, std::string> kAliases = {
      {"CrossEntropyLoss", "twinkle:cross_entropy"}, {"GRPOLoss", "twinkle:grpo"},
      {"GSPOLoss", "twinkle:gspo"},                  {"CISPOLoss", "twinkle:cispo"},
      {"BNPOLoss", "twinkle:bnpo"},                  {"DRGRPOLoss", "twinkle:dr_grpo"},
      {"DPOLoss", "twinkle:dpo"}};
  auto it = kAliases.find(cls);
  return it == kAliases.end() ? cls : it->second;
}

bool IsTwinkleLoss(const std::string& name) { return name.rfind("twinkle:", 0) == 0; }

// Twinkle's keyword names → the engine optimizer's.
absl::StatusOr<std::map<std::string, double>> OptimizerHyper(const std::map<std::string, double>& config) {
  static const std::map<std::string, std::string> kNames = {
      {"lr", "learning_rate"}, {"learning_rate", "learning_rate"}, {"weight_decay", "weight_decay"},
      {"beta1", "beta1"},      {"beta2", "beta2"},                 {"eps", "eps"},
      {"momentum", "momentum"}, {"dampening", "dampening"},        {"nesterov", "nesterov"},
      {"max_grad_norm", "grad_clip_norm"}};
  std::map<std::string, double> out = {{"learning_rate", kDefaultLr}, {"weight_decay", kDefaultWeightDecay}};
  for (const auto& [key, value] : config) {
    auto it = kNames.find(key);
    if (it == kNames.end()) {
      std::vector<std::string> known;
      for (const auto& [k, v] : kNames) known.push_back(k);
      return absl::InvalidArgumentError(absl::StrCat("config.", key, ": unknown optimizer argument (accepted: ",
                                                     absl::StrJoin(known, ", "), ")"));
    }
    if (!std::isfinite(value)) return absl::InvalidArgumentError(absl::StrCat("config.", key, ": not finite"));
    out[it->second] = value;
  }
  return out;
}

bool ValidName(const std::string& name) {
  if (name.empty() || name.size() > 128) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.';
  });
}

std::string Hex8(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%08llx", static_cast<unsigned long long>(v & 0xffffffffULL));
  return buf;
}

std::string FormatNumber(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

}  // namespace

// ---- state ---------------------------------------------------------------------------------

struct TrainingCoordinator::Session {
  std::string tenant;
  absl::Time last_heartbeat;
};

struct TrainingCoordinator::Adapter {
  // Fixed at creation.
  std::string tenant, name, key, run_id, session_id;
  LoraArgs lora;
  int32_t gradient_accumulation_steps = 1;
  absl::Time created;
  std::atomic<int64_t> last_request_ns{0};  // any thread: set at every submission

  // Scheduler thread only from here on.
  ipc::LossSpecMsg loss{"twinkle:cross_entropy", {}, {}};
  std::string optimizer_cls = "adamw";
  std::map<std::string, double> hyper = {{"learning_rate", kDefaultLr}, {"weight_decay", kDefaultWeightDecay}};
  std::optional<SchedulerSpec> schedule;
  std::unique_ptr<LrScheduler> scheduler;
  int64_t lr_steps = 0;        // lr_step calls that acted
  int64_t backward_count = 0;  // backwards ever: gates the accumulation window
  int64_t optimizer_steps = 0;

  bool created_on_engine = false;
  int64_t num_parameters = 0;
  bool resident = false;
  bool lost = false;           // the engine restarted while it was resident
  uint64_t generation = 0;
  uint64_t last_use = 0;
  std::optional<ipc::Message> host_state;  // offloaded: get_adapter_state's reply

  std::optional<PackedOp> last_forward;
  std::optional<double> last_loss;
  // calculate_metric accumulators since the last call.
  double loss_sum = 0;
  int64_t loss_count = 0;
  std::optional<double> last_grad_norm, last_lr;

  bool Synced() const {  // Twinkle's do_grad_sync, without its off-by-one
    return gradient_accumulation_steps <= 1 ||
           (backward_count > 0 && backward_count % gradient_accumulation_steps == 0);
  }
  double LearningRate() const {
    const double base = hyper.at("learning_rate");
    return scheduler ? scheduler->LearningRate(base, lr_steps) : base;
  }
};

struct TrainingCoordinator::FusedPayload {
  std::shared_ptr<Adapter> adapter;
  std::optional<PackedOp> packed;  // empty: Backward, which uses the adapter's last Forward
  ForwardMode mode = ForwardMode::kForwardOnly;
  bool disable_lora = false;
};

struct TrainingCoordinator::ControlPayload {
  std::function<FutureResult()> run;
};

class TrainingCoordinator::Runner final : public sched::Executor {
 public:
  explicit Runner(TrainingCoordinator& c) : c_(c) {}
  std::vector<FutureResult> Execute(const std::vector<const sched::Op*>& batch) override {
    if (batch.size() == 1 && batch[0]->kind == sched::OpKind::kOther) {
      c_.current_op_ = batch[0]->id;
      return {std::any_cast<const ControlPayload&>(batch[0]->payload).run()};
    }
    return c_.RunFused(batch);
  }

 private:
  TrainingCoordinator& c_;
};

// ---- lifecycle -----------------------------------------------------------------------------

TrainingCoordinator::TrainingCoordinator(CoordinatorOptions options, EngineLink& engine,
                                         FutureStore& futures, const Clock& clock)
    : options_(std::move(options)), engine_(engine), futures_(futures), clock_(clock) {
  runner_ = std::make_unique<Runner>(*this);
  sched::SchedulerOptions so = options_.scheduler;
  // A fused step's adapters must all be resident at once.
  so.max_ops_per_step = std::max(1, std::min(so.max_ops_per_step, options_.max_loras));
  scheduler_ = std::make_unique<sched::Scheduler>(so, *runner_, futures_, clock_);
}

TrainingCoordinator::~TrainingCoordinator() { Stop(); }

void TrainingCoordinator::Start() {
  io_thread_ = std::thread([this] { IoLoop(); });
  scheduler_->Start();
}

void TrainingCoordinator::Stop() {
  scheduler_->Stop();
  {
    absl::MutexLock lock(&io_mu_);
    io_stop_ = true;
  }
  if (io_thread_.joinable()) io_thread_.join();  // finishes the writes already started
}

void TrainingCoordinator::IoLoop() {
  while (true) {
    std::function<void()> job;
    {
      absl::MutexLock lock(&io_mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(io_mu_) { return io_stop_ || !io_jobs_.empty(); };
      io_mu_.Await(absl::Condition(&ready));
      if (io_jobs_.empty()) return;
      job = std::move(io_jobs_.front());
      io_jobs_.pop_front();
    }
    job();
  }
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

// ---- sessions ------------------------------------------------------------------------------

std::string TrainingCoordinator::CreateSession(const TenantContext& tenant) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  std::string id;
  {
    absl::MutexLock lock(&mu_);
    id = absl::StrCat("s", next_session_++, "-", Hex8(rng()));
    sessions_[id] = Session{tenant.id, clock_.Now()};
  }
  if (options_.registry != nullptr) (void)options_.registry->PutSession(id, tenant.id, clock_.Now());
  return id;
}

absl::Status TrainingCoordinator::Heartbeat(const TenantContext& tenant, const std::string& session_id) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end() || it->second.tenant != tenant.id) {
    return absl::NotFoundError(absl::StrCat("no session '", session_id, "'"));
  }
  it->second.last_heartbeat = clock_.Now();
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
  return std::any_cast<OpOutput>(**r);
}

absl::StatusOr<AddAdapterResult> TrainingCoordinator::AddAdapter(const TenantContext& tenant,
                                                                 const AddAdapterArgs& args) {
  if (!ValidName(args.name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "adapter_name: '", args.name, "' must be 1-128 characters of letters, digits, '_', '-', '.'"));
  }
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
      return absl::FailedPreconditionError(absl::StrCat("the server holds its maximum of ", options_.max_adapters,
                                                        " adapters (limits.max_adapters)"));
    }
    adapter->run_id = absl::StrCat(args.session_id.empty() ? Hex8(std::hash<std::string>{}(adapter->key) ^
                                                                  absl::ToUnixNanos(adapter->created))
                                                           : args.session_id,
                                   "-", args.name);
    adapters_[adapter->key] = adapter;
  }
  // Created on the engine by a queued op, so residency bookkeeping stays on one thread.
  absl::StatusOr<uint64_t> id = SubmitControlOp(
      tenant, adapter,
      [this, adapter]() -> FutureResult {
        SyncGeneration();
        if (absl::Status s = EnsureResident(*adapter, {adapter.get()}); !s.ok()) return s;
        return OpOutput{};
      },
      {});
  absl::StatusOr<OpOutput> done = id.ok() ? WaitFor(*id, tenant.id) : absl::StatusOr<OpOutput>(id.status());
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
    return OpOutput{};
  }};
  absl::StatusOr<uint64_t> id = scheduler_->Submit(std::move(op));
  if (id.ok()) (void)futures_.Wait(*id, adapter->tenant, absl::InfiniteDuration());
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

// ---- submission ----------------------------------------------------------------------------

absl::Status TrainingCoordinator::CheckPending(const TenantContext& tenant) const {
  const int64_t pending = scheduler_->queued_for_tenant(tenant.id);
  if (pending >= tenant.max_pending_ops) {
    return absl::ResourceExhaustedError(absl::StrCat("you have ", pending, " queued ops, your quota (max_pending_ops) is ",
                                                     tenant.max_pending_ops, "; wait for some to finish"));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitControlOp(const TenantContext& tenant,
                                                              const std::shared_ptr<Adapter>& adapter,
                                                              std::function<FutureResult()> run,
                                                              const SubmitOptions& options) {
  if (absl::Status s = CheckPending(tenant); !s.ok()) return s;
  sched::Op op;
  op.tenant = tenant.id;
  op.adapter = adapter->key;
  op.kind = sched::OpKind::kOther;
  op.deadline = options.deadline;
  op.seq_id = options.seq_id;
  op.idempotency_key = options.idempotency_key;
  op.payload = ControlPayload{std::move(run)};
  return scheduler_->Submit(std::move(op));
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitForward(const TenantContext& tenant, const std::string& name,
                                                            ForwardMode mode, const ForwardArgs& args,
                                                            bool disable_lora, const SubmitOptions& options) {
  absl::StatusOr<std::shared_ptr<Adapter>> adapter = Find(tenant, name);
  if (!adapter.ok()) return adapter.status();
  const int64_t vocab = engine_.vocab_size();
  if (vocab <= 0) return absl::UnavailableError("the engine has not loaded the model yet");
  absl::StatusOr<PackedOp> packed = PackForward(args, vocab, options_.max_tokens_per_request);
  if (!packed.ok()) return packed.status();
  if (packed->tokens > tenant.max_tokens_per_request) {
    return absl::FailedPreconditionError(absl::StrCat("inputs: ", packed->tokens, " tokens, above your quota of ",
                                                      tenant.max_tokens_per_request, " per request (max_tokens_per_request)"));
  }
  if (absl::Status s = CheckPending(tenant); !s.ok()) return s;
  sched::Op op;
  op.tenant = tenant.id;
  op.adapter = (*adapter)->key;
  op.kind = mode == ForwardMode::kForwardBackward ? sched::OpKind::kForwardBackward : sched::OpKind::kForward;
  op.tokens = packed->tokens;
  op.deadline = options.deadline;
  op.seq_id = options.seq_id;
  op.idempotency_key = options.idempotency_key;
  op.payload = FusedPayload{*adapter, *std::move(packed), mode, disable_lora && mode == ForwardMode::kForwardOnly};
  return scheduler_->Submit(std::move(op));
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitBackward(const TenantContext& tenant, const std::string& name,
                                                             const SubmitOptions& options) {
  absl::StatusOr<std::shared_ptr<Adapter>> adapter = Find(tenant, name);
  if (!adapter.ok()) return adapter.status();
  if (absl::Status s = CheckPending(tenant); !s.ok()) return s;
  sched::Op op;
  op.tenant = tenant.id;
  op.adapter = (*adapter)->key;
  op.kind = sched::OpKind::kForwardBackward;
  op.tokens = 1;
  op.deadline = options.deadline;
  op.seq_id = options.seq_id;
  op.idempotency_key = options.idempotency_key;
  op.payload = FusedPayload{*adapter, std::nullopt, ForwardMode::kForwardBackward, false};
  return scheduler_->Submit(std::move(op));
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitCalculateLoss(const TenantContext& tenant,
                                                                  const std::string& name,
                                                                  const SubmitOptions& options) {
  absl::StatusOr<std::shared_ptr<Adapter>> adapter = Find(tenant, name);
  if (!adapter.ok()) return adapter.status();
  Adapter* a = adapter->get();
  return SubmitControlOp(tenant, *adapter, [a]() -> FutureResult {
    if (!a->last_loss) return absl::FailedPreconditionError("calculate_loss: no forward has run on this adapter yet");
    OpOutput out;
    out.value = out.loss = *a->last_loss;
    return out;
  }, options);
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitControl(const TenantContext& tenant, const std::string& name,
                                                            Control control, double max_norm, double norm_type,
                                                            const SubmitOptions& options) {
  absl::StatusOr<std::shared_ptr<Adapter>> adapter = Find(tenant, name);
  if (!adapter.ok()) return adapter.status();
  if (control == Control::kClipGradNorm || control == Control::kClipGradAndStep) {
    if (!(max_norm > 0) || !std::isfinite(max_norm)) {
      return absl::InvalidArgumentError(absl::StrCat("max_grad_norm: ", max_norm, " must be a positive number"));
    }
    if (norm_type != 2 && !std::isinf(norm_type)) {
      return absl::InvalidArgumentError(absl::StrCat("norm_type: ", norm_type, " is not supported (2 or inf)"));
    }
  }
  std::shared_ptr<Adapter> a = *adapter;
  return SubmitControlOp(tenant, a, [this, a, control, max_norm, norm_type]() -> FutureResult {
    return RunControl(*a, control, max_norm, norm_type);
  }, options);
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitSetLoss(const TenantContext& tenant, const std::string& name,
                                                            const std::string& loss_cls,
                                                            const std::map<std::string, double>& config,
                                                            const std::map<std::string, std::string>& string_config) {
  absl::StatusOr<std::shared_ptr<Adapter>> adapter = Find(tenant, name);
  if (!adapter.ok()) return adapter.status();
  const std::string engine_name = EngineLossName(loss_cls);
  const std::vector<std::string> known = engine_.supported_losses();
  if (std::find(known.begin(), known.end(), engine_name) == known.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss_cls: unsupported loss '", loss_cls, "' (supported: CrossEntropyLoss, GRPOLoss, GSPOLoss, CISPOLoss, "
        "BNPOLoss, DRGRPOLoss, DPOLoss, or the engine names ", absl::StrJoin(known, ", "), ")"));
  }
  for (const auto& [key, value] : config) {
    if (!std::isfinite(value)) return absl::InvalidArgumentError(absl::StrCat("config.", key, ": not finite"));
  }
  std::shared_ptr<Adapter> a = *adapter;
  ipc::LossSpecMsg spec{engine_name, config, string_config};
  return SubmitControlOp(tenant, a, [a, spec]() -> FutureResult {
    a->loss = spec;
    return OpOutput{};
  }, {});
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitSetOptimizer(const TenantContext& tenant, const std::string& name,
                                                                 const std::string& optimizer_cls,
                                                                 const std::map<std::string, double>& config) {
  absl::StatusOr<std::shared_ptr<Adapter>> adapter = Find(tenant, name);
  if (!adapter.ok()) return adapter.status();
  const std::string kind = absl::AsciiStrToLower(optimizer_cls);
  if (kind != "adamw" && kind != "adam" && kind != "sgd") {
    return absl::InvalidArgumentError(absl::StrCat("optimizer_cls: unsupported optimizer '", optimizer_cls,
                                                   "' (supported: AdamW, Adam, SGD)"));
  }
  absl::StatusOr<std::map<std::string, double>> hyper = OptimizerHyper(config);
  if (!hyper.ok()) return hyper.status();
  std::shared_ptr<Adapter> a = *adapter;
  return SubmitControlOp(tenant, a, [this, a, kind, hyper = *hyper]() -> FutureResult {
    SyncGeneration();
    if (absl::Status s = EnsureResident(*a, {a.get()}); !s.ok()) return s;
    ipc::SetOptimizerRequest req{a->key, kind};
    absl::StatusOr<ipc::Message> r = CallEngine(ipc::kMethodSetOptimizer, ipc::Pack(req));
    if (!r.ok()) return r.status();
    a->optimizer_cls = kind;
    a->hyper = hyper;
    a->optimizer_steps = 0;
    return OpOutput{};
  }, {});
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitSetLrScheduler(const TenantContext& tenant, const std::string& name,
                                                                   const std::string& scheduler_cls,
                                                                   const std::map<std::string, double>& config) {
  absl::StatusOr<std::shared_ptr<Adapter>> adapter = Find(tenant, name);
  if (!adapter.ok()) return adapter.status();
  SchedulerSpec spec{scheduler_cls, config};
  absl::StatusOr<std::unique_ptr<LrScheduler>> made = LrScheduler::Create(spec);
  if (!made.ok()) return absl::InvalidArgumentError(absl::StrCat("scheduler_cls: ", made.status().message()));
  std::shared_ptr<Adapter> a = *adapter;
  return SubmitControlOp(tenant, a, [a, spec]() -> FutureResult {
    a->schedule = spec;
    a->scheduler = *LrScheduler::Create(spec);
    a->lr_steps = 0;
    return OpOutput{};
  }, {});
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitCalculateMetric(const TenantContext& tenant,
                                                                    const std::string& name, bool is_training) {
  absl::StatusOr<std::shared_ptr<Adapter>> adapter = Find(tenant, name);
  if (!adapter.ok()) return adapter.status();
  std::shared_ptr<Adapter> a = *adapter;
  return SubmitControlOp(tenant, a, [a]() -> FutureResult {
    OpOutput out;
    if (a->loss_count > 0) out.metric_strings["loss"] = FormatNumber(a->loss_sum / static_cast<double>(a->loss_count));
    if (a->last_grad_norm) out.metric_strings["grad_norm"] = FormatNumber(*a->last_grad_norm);
    if (a->last_lr) out.metric_strings["learning rate"] = FormatNumber(*a->last_lr);
    out.metric_strings["iters"] = absl::StrCat(a->optimizer_steps);
    a->loss_sum = 0;
    a->loss_count = 0;
    return out;
  }, {});
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitGetTrainConfigs(const TenantContext& tenant,
                                                                    const std::string& name) {
  absl::StatusOr<std::shared_ptr<Adapter>> adapter = Find(tenant, name);
  if (!adapter.ok()) return adapter.status();
  std::shared_ptr<Adapter> a = *adapter;
  return SubmitControlOp(tenant, a, [a]() -> FutureResult {
    nlohmann::json j;
    j["adapter_name"] = a->name;
    j["run_id"] = a->run_id;
    j["lora"] = {{"r", a->lora.rank}, {"lora_alpha", a->lora.alpha}, {"lora_dropout", a->lora.dropout},
                 {"target_modules", a->lora.targets}, {"use_rslora", a->lora.use_rslora}};
    j["gradient_accumulation_steps"] = a->gradient_accumulation_steps;
    j["loss"] = {{"name", a->loss.name}, {"config", a->loss.config}};
    j["optimizer"] = {{"name", a->optimizer_cls}, {"config", a->hyper}};
    if (a->schedule) j["lr_scheduler"] = {{"name", a->schedule->name}, {"config", a->schedule->config}};
    j["cur_step"] = a->backward_count;
    j["optimizer_steps"] = a->optimizer_steps;
    OpOutput out;
    out.text = j.dump();
    return out;
  }, {});
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitGetStateDict(const TenantContext& tenant,
                                                                 const std::string& name) {
  absl::StatusOr<std::shared_ptr<Adapter>> adapter = Find(tenant, name);
  if (!adapter.ok()) return adapter.status();
  std::shared_ptr<Adapter> a = *adapter;
  return SubmitControlOp(tenant, a, [this, a]() -> FutureResult {
    SyncGeneration();
    if (absl::Status s = EnsureResident(*a, {a.get()}); !s.ok()) return s;
    absl::StatusOr<ipc::Message> r = CallEngine(ipc::kMethodGetAdapterState, ipc::Pack(ipc::AdapterRequest{a->key}));
    if (!r.ok()) return r.status();
    absl::StatusOr<ipc::AdapterStateReply> state =
        ipc::Unpack<ipc::AdapterStateReply>(r->envelope.body, "get_adapter_state reply");
    if (!state.ok()) return state.status();
    OpOutput out;
    for (const auto& [key, desc] : state->weights) {
      absl::StatusOr<std::vector<float>> values = ReadFloats(desc, r->buffers);
      if (!values.ok()) return values.status();
      out.tensors[key] = FloatTensor{desc.shape, *std::move(values)};
    }
    return out;
  }, {});
}

// ---- checkpoints ---------------------------------------------------------------------------

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitSave(const TenantContext& tenant, const std::string& name,
                                                         const SaveArgs& args) {
  if (options_.checkpoints == nullptr) return absl::UnimplementedError("checkpoints are not configured");
  absl::StatusOr<std::shared_ptr<Adapter>> adapter = Find(tenant, name);
  if (!adapter.ok()) return adapter.status();
  // Twinkle names an unnamed checkpoint by the time; names are path components.
  const std::string checkpoint =
      args.name.empty() ? absl::FormatTime("%Y%m%d_%H%M%S", clock_.Now(), absl::UTCTimeZone()) : args.name;
  if (absl::Status s = storage::ValidatePathName(checkpoint, "name"); !s.ok()) return s;
  if (args.consumed_train_samples < 0) {
    return absl::InvalidArgumentError("consumed_train_samples: must not be negative");
  }
  std::shared_ptr<Adapter> a = *adapter;
  return SubmitControlOp(tenant, a, [this, a, checkpoint, args]() -> FutureResult {
    SyncGeneration();
    if (absl::Status s = EnsureResident(*a, {a.get()}); !s.ok()) return s;
    absl::StatusOr<ipc::Message> state =
        CallEngine(ipc::kMethodGetAdapterState, ipc::Pack(ipc::AdapterRequest{a->key}));
    if (!state.ok()) return state.status();
    absl::StatusOr<ipc::AdapterStateReply> body =
        ipc::Unpack<ipc::AdapterStateReply>(state->envelope.body, "get_adapter_state reply");
    if (!body.ok()) return body.status();
    TrainerState trainer;
    trainer.cur_step = a->backward_count;
    trainer.gradient_accumulation_steps = a->gradient_accumulation_steps;
    trainer.consumed_train_samples = args.consumed_train_samples;
    trainer.lr_scheduler = a->schedule;
    trainer.lr_steps = a->lr_steps;
    trainer.optimizer_steps = a->optimizer_steps;
    trainer.optimizer_kind = a->optimizer_cls;
    trainer.optimizer_hyper = a->hyper;
    trainer.loss = a->loss;
    trainer.micro_batches_since_step = body->micro_batches_since_step;
    trainer.seed = a->lora.seed;
    // The snapshot is taken; the write runs on the I/O thread while the adapter's later ops
    // wait (Block) and every other adapter keeps training.
    const uint64_t op = current_op_;
    scheduler_->Block(a->key);
    auto job = [this, a, op, checkpoint, args, trainer, snapshot = std::make_shared<ipc::Message>(*std::move(state))]() {
      CheckpointContent content{snapshot.get(), args.save_optimizer, trainer, a->lora};
      absl::StatusOr<registry::CheckpointRecord> record = options_.checkpoints->Save(
          a->tenant, a->run_id, args.is_sampler ? CheckpointKind::kSampler : CheckpointKind::kTraining, checkpoint,
          content);
      FutureResult result = absl::InternalError("unset");
      if (!record.ok()) result = record.status();
      if (record.ok()) {
        OpOutput out;
        out.checkpoint_uri = CheckpointPath{a->run_id, args.is_sampler ? CheckpointKind::kSampler
                                                                       : CheckpointKind::kTraining,
                                            checkpoint}.uri();
        out.checkpoint_dir = record->path;
        result = std::any(std::move(out));
        LogInfo(kLog, absl::StrCat("tenant ", a->tenant, ": saved ", record->checkpoint_id, " of run ", a->run_id));
        if (options_.registry != nullptr) {
          (void)options_.registry->TouchRun(a->tenant, a->run_id, absl::Now(), trainer.optimizer_steps);
        }
      } else {
        LogError(kLog, absl::StrCat("tenant ", a->tenant, ": saving ", checkpoint, " of run ", a->run_id,
                                    " failed: ", record.status().message()));
      }
      futures_.Complete(op, std::move(result));
      scheduler_->Unblock(a->key);
    };
    {
      absl::MutexLock lock(&io_mu_);
      io_jobs_.push_back(std::move(job));
    }
    return std::any(sched::Deferred{});
  }, {});
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitLoad(const TenantContext& tenant, const std::string& name,
                                                         const std::string& path_or_name, LoadMode mode) {
  if (options_.checkpoints == nullptr) return absl::UnimplementedError("checkpoints are not configured");
  absl::StatusOr<std::shared_ptr<Adapter>> adapter = Find(tenant, name);
  if (!adapter.ok()) return adapter.status();
  std::shared_ptr<Adapter> a = *adapter;
  absl::StatusOr<registry::CheckpointRecord> record =
      options_.checkpoints->Resolve(tenant.id, path_or_name, a->run_id);
  if (!record.ok()) return record.status();
  const bool with_optimizer = mode == LoadMode::kWeightsAndOptimizer || mode == LoadMode::kResume;
  // Read and verify here, on the caller's thread: only applying the state is queued.
  absl::StatusOr<LoadedCheckpoint> loaded = options_.checkpoints->Load(*record, with_optimizer);
  if (!loaded.ok()) return loaded.status();
  if (loaded->lora.rank != a->lora.rank) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint ", record->checkpoint_id, " has LoRA rank ",
                                                      loaded->lora.rank, "; adapter '", name, "' has rank ",
                                                      a->lora.rank));
  }
  const bool resume = mode == LoadMode::kResume || mode == LoadMode::kResumeOnlyModel;
  if (mode == LoadMode::kResume && !loaded->trainer) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint ", record->checkpoint_id,
                                                      " holds no trainer state (a sampler checkpoint?)"));
  }
  auto data = std::make_shared<LoadedCheckpoint>(*std::move(loaded));
  return SubmitControlOp(tenant, a, [this, a, data, mode, resume]() -> FutureResult {
    SyncGeneration();
    if (a->lost) {  // loading a checkpoint is exactly how a lost adapter comes back
      a->lost = false;
      a->resident = false;
      a->host_state.reset();
    }
    if (absl::Status s = EnsureResident(*a, {a.get()}); !s.ok()) return s;
    ipc::SetAdapterStateRequest req;
    req.adapter_id = a->key;
    req.weights = data->weights;
    req.grads = std::map<std::string, ipc::TensorDesc>{};  // a loaded state starts without gradients
    const TrainerState* trainer = data->trainer ? &*data->trainer : nullptr;
    if (mode == LoadMode::kWeightsAndOptimizer || mode == LoadMode::kResume) {
      req.optimizer = data->optimizer;
      if (trainer != nullptr) req.optimizer_kind = trainer->optimizer_kind;
    }
    if (mode == LoadMode::kResume) req.micro_batches_since_step = trainer->micro_batches_since_step;
    absl::StatusOr<ipc::Message> r = CallEngine(ipc::kMethodSetAdapterState, ipc::Pack(req), data->buffers);
    if (!r.ok()) {
      return absl::Status(r.status().code(), absl::StrCat("the checkpoint does not fit adapter '", a->name,
                                                          "': ", r.status().message()));
    }
    OpOutput out;
    if (mode == LoadMode::kResume) {
      a->backward_count = trainer->cur_step;
      a->lr_steps = trainer->lr_steps;
      a->optimizer_steps = trainer->optimizer_steps;
      a->optimizer_cls = trainer->optimizer_kind;
      a->hyper = trainer->optimizer_hyper;
      a->loss = trainer->loss;
      a->schedule = trainer->lr_scheduler;
      a->scheduler.reset();
      if (trainer->lr_scheduler) a->scheduler = *LrScheduler::Create(*trainer->lr_scheduler);
    } else if (mode == LoadMode::kWeightsAndOptimizer && trainer != nullptr) {
      a->optimizer_cls = trainer->optimizer_kind;
      a->optimizer_steps = trainer->optimizer_steps;
    }
    if (resume && trainer != nullptr) {
      out.cur_step = trainer->cur_step;
      out.consumed_train_samples = trainer->consumed_train_samples;
      out.gradient_accumulation_steps = trainer->gradient_accumulation_steps;
    }
    a->last_forward.reset();
    a->last_loss.reset();
    return out;
  }, {});
}

absl::StatusOr<uint64_t> TrainingCoordinator::SubmitExport(const TenantContext& tenant,
                                                           const std::string& checkpoint_path,
                                                           const std::string& export_name) {
  if (options_.checkpoints == nullptr) return absl::UnimplementedError("checkpoints are not configured");
  if (absl::Status s = storage::ValidatePathName(export_name, "name"); !s.ok()) return s;
  if (checkpoint_path.find("://") == std::string::npos) {
    return absl::InvalidArgumentError("checkpoint_path: expected twinkle://<run_id>/weights/<name>");
  }
  absl::StatusOr<registry::CheckpointRecord> record =
      options_.checkpoints->Resolve(tenant.id, checkpoint_path, "");
  if (!record.ok()) return record.status();
  absl::StatusOr<LoadedCheckpoint> loaded = options_.checkpoints->Load(*record, false);
  if (!loaded.ok()) return loaded.status();
  if (absl::Status s = CheckPending(tenant); !s.ok()) return s;
  auto data = std::make_shared<LoadedCheckpoint>(*std::move(loaded));
  // A transient engine adapter on a queue of its own ('#' never appears in adapter names).
  const std::string key = absl::StrCat(tenant.id, "/#export");
  const std::string parent = (std::filesystem::path(options_.checkpoints->TenantRoot(tenant.id)) / "exports").string();
  sched::Op op;
  op.tenant = tenant.id;
  op.adapter = key;
  op.kind = sched::OpKind::kOther;
  op.payload = ControlPayload{[this, data, key, parent, export_name]() -> FutureResult {
    ipc::CreateAdapterRequest create;
    create.adapter_id = key;
    create.rank = data->lora.rank;
    create.alpha = data->lora.alpha;
    create.use_rslora = data->lora.use_rslora;
    create.targets = data->lora.targets;
    absl::StatusOr<ipc::Message> created = CallEngine(ipc::kMethodCreateAdapter, ipc::Pack(create));
    if (!created.ok()) return created.status();
    ipc::SetAdapterStateRequest set;
    set.adapter_id = key;
    set.weights = data->weights;
    absl::StatusOr<ipc::Message> r = CallEngine(ipc::kMethodSetAdapterState, ipc::Pack(set), data->buffers);
    absl::StatusOr<ipc::ExportMergedReply> reply = absl::InternalError("not exported");
    if (!r.ok()) reply = r.status();
    if (r.ok()) {
      r = CallEngine(ipc::kMethodExportMerged,
                     ipc::Pack(ipc::ExportMergedRequest{key, options_.model_dir, parent, export_name}));
      reply = r.ok() ? ipc::Unpack<ipc::ExportMergedReply>(r->envelope.body, "export_merged reply")
                     : absl::StatusOr<ipc::ExportMergedReply>(r.status());
    }
    (void)CallEngine(ipc::kMethodRemoveAdapter, ipc::Pack(ipc::AdapterRequest{key}));
    if (!reply.ok()) return reply.status();
    OpOutput out;
    out.checkpoint_dir = reply->path;
    out.value = static_cast<double>(reply->bytes);
    return out;
  }};
  return scheduler_->Submit(std::move(op));
}

// ---- execution (scheduler thread) ----------------------------------------------------------

absl::StatusOr<ipc::Message> TrainingCoordinator::CallEngine(const char* method, std::string body,
                                                             std::vector<std::string> buffers) {
  ipc::Message m;
  m.envelope.method = method;
  m.envelope.body = std::move(body);
  m.buffers = std::move(buffers);
  return engine_.Call(std::move(m));
}

void TrainingCoordinator::SyncGeneration() {
  const uint64_t gen = engine_.generation();
  if (gen == generation_) return;
  generation_ = gen;
  // A new engine process holds no adapters: resident ones lost their state with the old one.
  absl::MutexLock lock(&mu_);
  for (const auto& [key, a] : adapters_) {
    if (a->resident) {
      a->resident = false;
      a->lost = true;
      --stats_.resident;
      LogError(kLog, absl::StrCat("tenant ", a->tenant, ": adapter ", a->name,
                                  " lost its device state in an engine restart"));
    }
  }
}

absl::Status TrainingCoordinator::CreateOnEngine(Adapter& a) {
  ipc::CreateAdapterRequest req;
  req.adapter_id = a.key;
  req.rank = a.lora.rank;
  req.alpha = a.lora.alpha;
  req.dropout = a.lora.dropout;
  req.use_rslora = a.lora.use_rslora;
  req.targets = a.lora.targets;
  req.seed = a.lora.seed;
  req.optimizer = a.optimizer_cls;
  absl::StatusOr<ipc::Message> r = CallEngine(ipc::kMethodCreateAdapter, ipc::Pack(req));
  if (!r.ok()) return r.status();
  absl::StatusOr<ipc::CreateAdapterReply> reply =
      ipc::Unpack<ipc::CreateAdapterReply>(r->envelope.body, "create_adapter reply");
  if (!reply.ok()) return reply.status();
  a.num_parameters = reply->num_parameters;
  return absl::OkStatus();
}

absl::Status TrainingCoordinator::Offload(Adapter& a) {
  absl::StatusOr<ipc::Message> state = CallEngine(ipc::kMethodGetAdapterState, ipc::Pack(ipc::AdapterRequest{a.key}));
  if (!state.ok()) return state.status();
  absl::StatusOr<ipc::Message> removed = CallEngine(ipc::kMethodRemoveAdapter, ipc::Pack(ipc::AdapterRequest{a.key}));
  if (!removed.ok()) return removed.status();
  a.host_state = *std::move(state);
  a.resident = false;
  absl::MutexLock lock(&mu_);
  ++stats_.offloads;
  --stats_.resident;
  return absl::OkStatus();
}

absl::Status TrainingCoordinator::EnsureResident(Adapter& a, const std::vector<const Adapter*>& pinned) {
  if (a.lost) {
    // Never continue silently from older weights: the client decides (resume from a
    // checkpoint, or remove and start over).
    return absl::AbortedError(absl::StrCat("adapter '", a.name, "': adapter state lost since step ",
                                           a.optimizer_steps, " (the engine worker restarted); "
                                           "resume from checkpoint"));
  }
  a.last_use = ++use_tick_;
  if (a.resident) return absl::OkStatus();
  // Make room: offload the least recently used resident adapter not needed by this step.
  while (true) {
    std::vector<std::shared_ptr<Adapter>> resident;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [key, other] : adapters_) {
        if (other->resident) resident.push_back(other);
      }
    }
    if (static_cast<int32_t>(resident.size()) < options_.max_loras) break;
    std::shared_ptr<Adapter> victim;
    for (const auto& other : resident) {
      if (std::find(pinned.begin(), pinned.end(), other.get()) != pinned.end()) continue;
      if (!victim || other->last_use < victim->last_use) victim = other;
    }
    if (!victim) return absl::ResourceExhaustedError("every resident adapter is in use by this step");
    if (absl::Status s = Offload(*victim); !s.ok()) return s;
  }
  if (absl::Status s = CreateOnEngine(a); !s.ok()) return s;
  if (a.host_state) {
    absl::StatusOr<ipc::AdapterStateReply> state =
        ipc::Unpack<ipc::AdapterStateReply>(a.host_state->envelope.body, "get_adapter_state reply");
    if (!state.ok()) return state.status();
    ipc::SetAdapterStateRequest req;
    req.adapter_id = a.key;
    req.weights = state->weights;
    req.optimizer = state->optimizer;
    req.grads = state->grads;
    req.micro_batches_since_step = state->micro_batches_since_step;
    req.optimizer_kind = state->optimizer_kind;
    absl::StatusOr<ipc::Message> set =
        CallEngine(ipc::kMethodSetAdapterState, ipc::Pack(req), a.host_state->buffers);
    if (!set.ok()) {
      (void)CallEngine(ipc::kMethodRemoveAdapter, ipc::Pack(ipc::AdapterRequest{a.key}));
      return set.status();
    }
    a.host_state.reset();
    absl::MutexLock lock(&mu_);
    ++stats_.reloads;
  }
  a.created_on_engine = true;
  a.resident = true;
  a.generation = generation_;
  absl::MutexLock lock(&mu_);
  ++stats_.resident;
  return absl::OkStatus();
}

FutureResult TrainingCoordinator::RunControl(Adapter& a, Control control, double max_norm, double norm_type) {
  SyncGeneration();
  OpOutput out;
  if (!a.Synced()) {  // inside a gradient-accumulation window: Twinkle does nothing
    out.skipped = true;
    return out;
  }
  if (absl::Status s = EnsureResident(a, {&a}); !s.ok()) return s;
  auto clip = [&]() -> absl::Status {
    ipc::ClipGradNormRequest req{a.key, max_norm, norm_type};
    absl::StatusOr<ipc::Message> r = CallEngine(ipc::kMethodClipGradNorm, ipc::Pack(req));
    if (!r.ok()) return r.status();
    absl::StatusOr<ipc::ClipGradNormReply> reply =
        ipc::Unpack<ipc::ClipGradNormReply>(r->envelope.body, "clip_grad_norm reply");
    if (!reply.ok()) return reply.status();
    out.value = reply->total_norm;
    a.last_grad_norm = reply->total_norm;
    return absl::OkStatus();
  };
  auto step = [&](bool zero_grad) -> absl::Status {
    ipc::OptimStepRequest req;
    req.adapter_id = a.key;
    req.hyper = a.hyper;
    req.hyper["learning_rate"] = a.LearningRate();
    req.zero_grad = zero_grad;
    absl::StatusOr<ipc::Message> r = CallEngine(ipc::kMethodOptimStep, ipc::Pack(req));
    if (!r.ok()) return r.status();
    a.last_lr = req.hyper["learning_rate"];
    ++a.optimizer_steps;
    return absl::OkStatus();
  };
  auto zero = [&]() -> absl::Status {
    absl::StatusOr<ipc::Message> r = CallEngine(ipc::kMethodZeroGrad, ipc::Pack(ipc::AdapterRequest{a.key}));
    return r.status();
  };
  absl::Status s;
  switch (control) {
    case Control::kClipGradNorm:
      s = clip();
      break;
    case Control::kStep:
      s = step(false);
      if (s.ok()) out.value = *a.last_lr;
      break;
    case Control::kZeroGrad:
      s = zero();
      break;
    case Control::kLrStep:
      ++a.lr_steps;
      out.value = a.LearningRate();
      break;
    case Control::kClipGradAndStep:
      s = clip();
      if (s.ok()) s = step(true);  // step, then zero_grad
      if (s.ok()) ++a.lr_steps;
      break;
  }
  if (!s.ok()) return s;
  return out;
}

std::vector<FutureResult> TrainingCoordinator::RunFused(const std::vector<const sched::Op*>& batch) {
  SyncGeneration();
  const bool backward = batch[0]->kind == sched::OpKind::kForwardBackward;
  std::vector<FutureResult> results(batch.size(), absl::InternalError("not run"));
  std::vector<const Adapter*> pinned;
  for (const sched::Op* op : batch) pinned.push_back(std::any_cast<const FusedPayload&>(op->payload).adapter.get());

  // Each op's engine part; ops that cannot run get their error here and stay out.
  ipc::Message request;
  ipc::ForwardRequest body;
  std::vector<size_t> included;
  std::vector<const PackedOp*> packed_of(batch.size(), nullptr);
  for (size_t i = 0; i < batch.size(); ++i) {
    const FusedPayload& p = std::any_cast<const FusedPayload&>(batch[i]->payload);
    Adapter& a = *p.adapter;
    const PackedOp* packed = p.packed ? &*p.packed : (a.last_forward ? &*a.last_forward : nullptr);
    if (packed == nullptr) {
      results[i] = absl::FailedPreconditionError("backward: no forward has run on this adapter yet");
      continue;
    }
    if (absl::Status s = EnsureResident(a, pinned); !s.ok()) {
      results[i] = s;
      continue;
    }
    ipc::TrainOpMsg msg = AppendFrames(*packed, request.buffers);
    msg.adapter_id = a.key;
    msg.disable_adapter = p.disable_lora;
    if (p.mode != ForwardMode::kForwardOnly) {
      msg.loss = a.loss;
      // Tinker's losses take per-token weights where Twinkle's take a mask.
      if (!IsTwinkleLoss(a.loss.name)) {
        for (ipc::DatumMsg& d : msg.datums) {
          auto mask = d.inputs.find("mask");
          if (mask == d.inputs.end()) continue;
          if (a.loss.name == "cross_entropy") d.inputs["weights"] = mask->second;
          d.inputs.erase("mask");
        }
      }
    }
    body.ops.push_back(std::move(msg));
    included.push_back(i);
    packed_of[i] = packed;
  }
  if (included.empty()) return results;
  // One op's engine error must not fail the others: if a fused step fails, run each alone.
  request.envelope.method = backward ? ipc::kMethodForwardBackward : ipc::kMethodForward;
  request.envelope.body = ipc::Pack(body);
  absl::StatusOr<ipc::Message> reply = engine_.Call(std::move(request));
  if (!reply.ok() && included.size() > 1) {
    for (size_t i : included) results[i] = RunFused({batch[i]})[0];
    return results;
  }
  absl::StatusOr<ipc::ForwardReply> parsed =
      reply.ok() ? ipc::Unpack<ipc::ForwardReply>(reply->envelope.body, "forward reply")
                 : absl::StatusOr<ipc::ForwardReply>(reply.status());
  if (parsed.ok() && parsed->ops.size() != included.size()) {
    parsed = absl::InternalError("engine reply: wrong number of op results");
  }
  for (size_t k = 0; k < included.size(); ++k) {
    const size_t i = included[k];
    if (!parsed.ok()) {
      results[i] = parsed.status();
      continue;
    }
    const FusedPayload& p = std::any_cast<const FusedPayload&>(batch[i]->payload);
    Adapter& a = *p.adapter;
    const ipc::OpResultMsg& r = parsed->ops[k];
    OpOutput out;
    absl::Status s;
    for (size_t d = 0; d < r.logprobs.size() && s.ok(); ++d) {
      SequenceResult seq;
      absl::StatusOr<std::vector<float>> lp = ReadFloats(r.logprobs[d], reply->buffers);
      if (!lp.ok()) s = lp.status();
      else seq.logps = *std::move(lp);
      if (s.ok() && d < r.elementwise.size()) {
        absl::StatusOr<std::vector<float>> el = ReadFloats(r.elementwise[d], reply->buffers);
        if (!el.ok()) s = el.status();
        else seq.loss = *std::move(el);
      }
      if (!seq.logps.empty()) seq.logps.back() = 0;  // nothing follows the last token
      for (float v : seq.loss) out.loss += v;
      out.sequences.push_back(std::move(seq));
    }
    if (!s.ok()) {
      results[i] = s;
      continue;
    }
    out.metrics = r.metrics;
    if (p.mode != ForwardMode::kForwardOnly) {
      a.loss_sum += out.loss;
      ++a.loss_count;
    }
    if (p.mode == ForwardMode::kForward) {
      a.last_forward = *packed_of[i];
      a.last_loss = out.loss;
    }
    if (backward) ++a.backward_count;
    results[i] = std::move(out);
  }
  return results;
}

}  // namespace twinkle::training
