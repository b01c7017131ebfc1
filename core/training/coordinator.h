#pragma once
// The coordinator's training logic, independent of any transport: tenants' adapters and
// sessions, the per-adapter Twinkle training state (loss, optimizer, LR schedule, gradient
// accumulation), adapter residency on the device, and the Executor that turns the
// scheduler's picks into engine calls.
//
// Threading: the registry (adapters, sessions) is guarded by a mutex; everything an op
// changes on an adapter (optimizer settings, counters, residency) is touched only on the
// scheduler thread, because every such change is itself a queued op. That is what keeps an
// adapter's calls in submission order without further locking: a set_optimizer queued
// after a forward_backward takes effect after it, exactly as it would in a local script.
//
// Residency: at most `max_loras` adapters live on the device. Before a step runs, the
// adapters it needs are made resident; the least recently used others are offloaded to host
// memory (their complete state: weights, gradients, optimizer state, counters) and reloaded
// on demand, bit-identically. An engine restart sets resident adapters back to their last
// restore point (the state after their last optimizer step or other state change), so a
// worker crash costs each tenant at most the gradients accumulated since (reported, never
// silently dropped).

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/common/clock.h"
#include "core/futures/future_store.h"
#include "core/scheduler/scheduler.h"
#include "core/registry/registry.h"
#include "core/ipc/training_messages.h"
#include "core/training/checkpoints.h"
#include "core/training/engine_link.h"
#include "core/training/job_thread.h"
#include "core/training/types.h"

namespace twinkle::training {

// One merged export: a saved adapter folded into the base model (see core/engine/export.h).
struct MergedExportJob {
  std::string model_dir;    // the base model
  std::string adapter_dir;  // the checkpoint's folder
  std::string parent;       // where the merged model's folder goes
  std::string name;
};
struct MergedExportDone {
  std::string path;
  int64_t bytes = 0;
};
// Runs one export to completion (the server: a `twinkle-engine export` process); gives up
// with Cancelled once `cancelled` returns true.
using MergedExporter = std::function<absl::StatusOr<MergedExportDone>(const MergedExportJob& job,
                                                                      const std::function<bool()>& cancelled)>;

struct CoordinatorOptions {
  sched::SchedulerOptions scheduler;
  int32_t max_loras = 16;                  // adapters resident on the device at once
  int32_t max_adapters = 64;               // on this coordinator's base model, all tenants
  // How the refusal beyond max_adapters names its holder and its key: one model, "the
  // server" and limits.max_adapters; several, "base model 'x'" and models[i].max_adapters.
  std::string capacity_holder = "the server";
  std::string capacity_key = "limits.max_adapters";
  int32_t max_lora_rank = 64;              // server-wide (the engine's own limit)
  int64_t max_tokens_per_request = 32768;  // server-wide hard limit on one request
  // Longest sequence a forward/forward_backward may hold (model.max_context_tokens); 0 = the
  // model's max_position_embeddings as the engine reports it (no limit when unknown).
  int64_t max_context_tokens = 0;
  // Memory admission (engine.activation_memory_mib, in bytes): a forward/forward_backward
  // whose estimated activation memory (the engine's ActivationCost) exceeds it is refused
  // when submitted, and no fused step sums above it. 0 = none; also none while the engine
  // reports no cost.
  int64_t activation_memory_bytes = 0;
  absl::Duration adapter_timeout = absl::Seconds(1800);       // session silent this long
  absl::Duration adapter_max_lifetime = absl::Seconds(36000);
  std::string base_model;                             // recorded with runs
  std::string model_dir;                              // the base model's HF folder (exports)
  registry::Registry* registry = nullptr;             // runs are recorded when set
  CheckpointStore* checkpoints = nullptr;             // save/load need it
  // Keep a host copy of each resident adapter's state after every state change, so an engine
  // restart restores it (see Adapter::restore_point). Costs one get_adapter_state per
  // optimizer step and host memory for one state per resident adapter.
  bool restore_points = true;
  MergedExporter exporter;  // SubmitExport needs it
};

struct CoordinatorStats {
  int32_t adapters = 0;
  int32_t resident = 0;
  int64_t offloads = 0;
  int64_t reloads = 0;
  int64_t expired = 0;
  int64_t restored = 0;  // adapters set back to their restore point after an engine restart
  int64_t lost = 0;      // adapters an engine restart left without state (no restore point)
};

class TrainingCoordinator {
 public:
  TrainingCoordinator(CoordinatorOptions options, EngineLink& engine, FutureStore& futures,
                      const Clock& clock = RealClock());
  ~TrainingCoordinator();

  void Start();
  void Stop();

  // Sessions (Twinkle's create_session / heartbeat). Unknown or another tenant's: NotFound.
  // A tenant holding max_sessions live sessions gets FAILED_PRECONDITION naming the limit
  // (it does not clear by itself while they heartbeat: end one, or let one expire).
  absl::StatusOr<std::string> CreateSession(const TenantContext& tenant);
  // Keeps the session alive. A session of an earlier run of the server (in the registry,
  // not finished, created before this start) is resumed by its first heartbeat after a
  // restart (its adapters are not: they died with the engine), once: one that ends or expires
  // afterwards stays ended. NotFound for anything else (and another tenant's).
  absl::Status Heartbeat(const TenantContext& tenant, const std::string& session_id);
  // A live session that a sibling coordinator of this server created (several base models:
  // one session may hold adapters of every model, server/model_set.h): known here too from
  // now on, or its heartbeat refreshed when it already is. Not written to the registry and
  // not counted against max_sessions: the creating coordinator did both. Another tenant's
  // session of that id is left alone.
  void JoinSession(const std::string& tenant, const std::string& session_id);
  // Whether `session_id` is a live session of `tenant` (it has not ended or expired).
  bool SessionAlive(const std::string& tenant, const std::string& session_id) const;
  // Ends the session: it is forgotten (heartbeats get NotFound) and its adapters are released
  // (their queued ops fail ABORTED); blocks until they are off the engine. NotFound when it is
  // not a live session of the tenant.
  absl::Status EndSession(const TenantContext& tenant, const std::string& session_id);

  // Registers the adapter and creates it on the engine; blocks until done.
  absl::StatusOr<AddAdapterResult> AddAdapter(const TenantContext& tenant, const AddAdapterArgs& args);
  // Fails the adapter's queued work (CANCELLED), removes it from the engine; blocks.
  absl::Status RemoveAdapter(const TenantContext& tenant, const std::string& name);

  // Queued work: each returns the future id at once (the result lands in the FutureStore as
  // an OpOutput). Bad input → INVALID_ARGUMENT naming the field, before anything is queued.
  absl::StatusOr<uint64_t> SubmitForward(const TenantContext& tenant, const std::string& name,
                                         ForwardMode mode, const ForwardArgs& args,
                                         bool disable_lora, const SubmitOptions& options);
  // Recomputes the adapter's last Forward with gradients.
  absl::StatusOr<uint64_t> SubmitBackward(const TenantContext& tenant, const std::string& name,
                                          const SubmitOptions& options);
  absl::StatusOr<uint64_t> SubmitCalculateLoss(const TenantContext& tenant, const std::string& name,
                                               const SubmitOptions& options);
  absl::StatusOr<uint64_t> SubmitControl(const TenantContext& tenant, const std::string& name,
                                         Control control, double max_norm, double norm_type,
                                         const SubmitOptions& options);
  absl::StatusOr<uint64_t> SubmitSetLoss(const TenantContext& tenant, const std::string& name,
                                         const std::string& loss_cls,
                                         const std::map<std::string, double>& config,
                                         const std::map<std::string, std::string>& string_config);
  absl::StatusOr<uint64_t> SubmitSetOptimizer(const TenantContext& tenant, const std::string& name,
                                              const std::string& optimizer_cls,
                                              const std::map<std::string, double>& config);
  absl::StatusOr<uint64_t> SubmitSetLrScheduler(const TenantContext& tenant, const std::string& name,
                                                const std::string& scheduler_cls,
                                                const std::map<std::string, double>& config);
  absl::StatusOr<uint64_t> SubmitCalculateMetric(const TenantContext& tenant, const std::string& name,
                                                 bool is_training);
  absl::StatusOr<uint64_t> SubmitGetTrainConfigs(const TenantContext& tenant, const std::string& name);
  // The adapter's LoRA weights by PEFT key (fp32).
  absl::StatusOr<uint64_t> SubmitGetStateDict(const TenantContext& tenant, const std::string& name);

  // Tinker's optim_step: applies the adapter's optimizer with these hyper-parameters
  // (learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm; omitted ones keep the
  // engine's defaults), then clears the gradients. Result metrics: grad_norm:mean,
  // learning_rate:mean. Not gated by gradient accumulation.
  absl::StatusOr<uint64_t> SubmitOptimStep(const TenantContext& tenant, const std::string& name,
                                           const std::map<std::string, double>& hyper,
                                           const SubmitOptions& options);

  // Checkpoints. Save snapshots the adapter in its queue, then writes off the scheduler
  // thread: the adapter's later ops wait for the write, other adapters keep training.
  absl::StatusOr<uint64_t> SubmitSave(const TenantContext& tenant, const std::string& name, const SaveArgs& args);
  // Reads and verifies the checkpoint on the calling thread, then queues applying it.
  // `path_or_name`: a twinkle:// / tinker:// path or a name among this adapter's run's
  // training checkpoints. Another tenant's checkpoint is NotFound.
  absl::StatusOr<uint64_t> SubmitLoad(const TenantContext& tenant, const std::string& name,
                                      const std::string& path_or_name, LoadMode mode);

  // Folds a training or sampler checkpoint into the base weights and writes a full HF model
  // directory under the tenant's exports/<export_name>/ (utility RPC, for vLLM users).
  absl::StatusOr<uint64_t> SubmitExport(const TenantContext& tenant, const std::string& checkpoint_path,
                                        const std::string& export_name);

  // ---- For the sampler (core/sampling), which shares the scheduler and the engine. ----

  // An adapter's LoRA weights as its earlier ops left them, with the create_adapter body
  // that rebuilds an adapter of the same shape (PEFT keys; frames index `buffers`).
  struct CapturedWeights {
    ipc::CreateAdapterRequest config;
    std::map<std::string, ipc::TensorDesc> weights;
    std::vector<std::string> buffers;
  };
  // Queues, in adapter `name`'s FIFO, an op that captures its weights and hands them to
  // `then` on the scheduler thread; the op's result is what `then` returns.
  absl::StatusOr<uint64_t> SubmitWithWeights(const TenantContext& tenant, const std::string& name,
                                             std::function<FutureResult(CapturedWeights)> then,
                                             const SubmitOptions& options);
  // Queues `run` in the tenant's private queue `queue` ('#' + queue never collides with an
  // adapter name), charged `tokens` for fair share. It runs on the scheduler thread with its
  // op id and may return sched::Deferred{} and complete the future itself later.
  // `name` is the op's name for idempotency (a replayed key must name the same op).
  absl::StatusOr<uint64_t> SubmitTask(const TenantContext& tenant, const std::string& queue, const char* name,
                                      int64_t tokens,
                                      std::function<FutureResult(uint64_t op_id)> run,
                                      const SubmitOptions& options);
  // The scheduler queue key of SubmitTask's `queue` (for Scheduler::DropAdapter).
  static std::string TaskQueue(const std::string& tenant, const std::string& queue) {
    return tenant + "/#" + queue;
  }

  // Releases adapters whose session went silent for adapter_timeout or whose lifetime
  // ended, and forgets silent sessions. Call periodically.
  void Housekeep();

  // The tenant's training runs (its live adapters), newest first; NotFound for a run that
  // is not the tenant's.
  std::vector<RunInfo> ListRuns(const TenantContext& tenant) const;
  absl::StatusOr<RunInfo> GetRun(const TenantContext& tenant, const std::string& run_id) const;

  sched::Scheduler& scheduler() { return *scheduler_; }
  CoordinatorStats stats() const;
  // Adapters per tenant, for capacity.
  int32_t adapter_count() const;
  // Whether the tenant has an adapter of this name here (routing by adapter with several
  // base models, server/model_set.h).
  bool HasAdapter(const std::string& tenant, const std::string& name) const;

 private:
  struct Adapter;
  struct Session;
  class Runner;
  struct FusedPayload;
  struct ControlPayload;

  absl::StatusOr<std::shared_ptr<Adapter>> Find(const TenantContext& tenant, const std::string& name) const;
  absl::StatusOr<uint64_t> SubmitControlOp(const TenantContext& tenant, const std::shared_ptr<Adapter>& adapter,
                                           const char* name, std::function<FutureResult()> run,
                                           const SubmitOptions& options);
  absl::Status CheckPending(const TenantContext& tenant) const;
  absl::StatusOr<OpOutput> WaitFor(uint64_t id, const std::string& tenant);
  void Release(const std::shared_ptr<Adapter>& adapter, const absl::Status& why);

  // Scheduler thread only.
  absl::Status EnsureResident(Adapter& adapter, const std::vector<const Adapter*>& pinned);
  absl::Status Offload(Adapter& adapter);
  absl::Status CreateOnEngine(Adapter& adapter);
  // After a state change: takes the adapter's restore point (when enabled). A failure leaves
  // none, so a later restart reports the adapter lost rather than restoring stale state.
  void TakeRestorePoint(Adapter& adapter);
  // Before an optimizer step: ABORTED (once) when a restart lost gradients it would apply.
  absl::Status CheckNoLostGradients(Adapter& adapter);
  absl::StatusOr<ipc::Message> CallEngine(const char* method, std::string body,
                                          std::vector<std::string> buffers = {});
  void SyncGeneration();
  std::vector<FutureResult> RunFused(const std::vector<const sched::Op*>& batch);
  FutureResult RunControl(Adapter& adapter, Control control, double max_norm, double norm_type);

  const CoordinatorOptions options_;
  EngineLink& engine_;
  FutureStore& futures_;
  const Clock& clock_;
  std::unique_ptr<Runner> runner_;
  std::unique_ptr<sched::Scheduler> scheduler_;

  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Adapter>> adapters_ ABSL_GUARDED_BY(mu_);  // by key
  std::map<std::string, Session> sessions_ ABSL_GUARDED_BY(mu_);
  uint64_t next_session_ ABSL_GUARDED_BY(mu_) = 1;
  const absl::Time started_at_;  // sessions created before this are an earlier run's
  std::set<std::string> resumed_ ABSL_GUARDED_BY(mu_);  // earlier runs' sessions resumed here
  // Heartbeats of unknown ids found not resumable (tenant "\n" id), so repeating one costs no
  // SQLite read; the oldest kMaxNotResumable, first in first out.
  static constexpr size_t kMaxNotResumable = 4096;
  std::deque<std::string> not_resumable_order_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> not_resumable_ ABSL_GUARDED_BY(mu_);
  CoordinatorStats stats_ ABSL_GUARDED_BY(mu_);

  // Scheduler thread only.
  uint64_t generation_ = 0;
  uint64_t use_tick_ = 0;
  uint64_t current_op_ = 0;  // the id of the op being executed (for Deferred completions)

  // Off the scheduler thread, one at a time each: checkpoint writes, and merged exports
  // (long, so on a thread of their own that saves never wait behind).
  JobThread io_jobs_;
  JobThread export_jobs_;
};

}  // namespace twinkle::training
