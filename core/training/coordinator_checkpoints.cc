// TrainingCoordinator: checkpoints — save (snapshot in the queue, write on the I/O thread),
// load and resume (read and verify on the caller's thread, apply in the queue), and merged
// export.
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/common/log.h"
#include "core/storage/names.h"
#include "core/training/coordinator.h"
#include "core/training/coordinator_state.h"

namespace twinkle::training {

using coordinator_internal::kLog;

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
  if (args.ttl_seconds) {
    if (absl::Status s = ValidateTtl(*args.ttl_seconds, "ttl_seconds"); !s.ok()) return s;
  }
  const CheckpointKind kind = args.is_external ? CheckpointKind::kExternal
                              : args.is_sampler ? CheckpointKind::kSampler
                                                : CheckpointKind::kTraining;
  std::shared_ptr<Adapter> a = *adapter;
  const char* op_name = args.is_external ? "save_weights_external" : args.is_sampler ? "save_weights_for_sampler" : "save";
  return SubmitControlOp(tenant, a, op_name, [this, a, checkpoint, args, kind]() -> FutureResult {
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
    auto job = [this, a, op, checkpoint, args, kind, trainer, snapshot = std::make_shared<ipc::Message>(*std::move(state))]() {
      CheckpointContent content{snapshot.get(), args.save_optimizer, trainer, a->lora, args.ttl_seconds};
      absl::StatusOr<registry::CheckpointRecord> record =
          options_.checkpoints->Save(a->tenant, a->run_id, kind, checkpoint, content);
      FutureResult result = absl::InternalError("unset");
      if (!record.ok()) result = record.status();
      if (record.ok()) {
        OpOutput out;
        out.checkpoint_uri = CheckpointPath{a->run_id, kind, checkpoint}.uri();
        out.checkpoint_dir = record->path;
        result = FutureValue(std::move(out));
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
    io_jobs_.Post(std::move(job));
    return FutureValue(sched::Deferred{});
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
  return SubmitControlOp(tenant, a, "load", [this, a, data, mode, resume]() -> FutureResult {
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
    req.reset_optimizer = mode == LoadMode::kWeightsFreshOptimizer;
    if (mode == LoadMode::kResume) req.micro_batches_since_step = trainer->micro_batches_since_step;
    absl::StatusOr<ipc::Message> r = CallEngine(ipc::kMethodSetAdapterState, ipc::Pack(req), data->buffers);
    if (!r.ok()) {
      return absl::Status(r.status().code(), absl::StrCat("the checkpoint does not fit adapter '", a->name,
                                                          "': ", r.status().message()));
    }
    a->lost_backwards = 0;  // the loaded state replaces whatever a restart left
    TakeRestorePoint(*a);
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
    } else if (mode == LoadMode::kWeightsFreshOptimizer) {
      a->optimizer_steps = 0;
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
  if (options_.checkpoints == nullptr || !options_.exporter) {
    return absl::UnimplementedError("merged export is not configured");
  }
  if (absl::Status s = storage::ValidatePathName(export_name, "name"); !s.ok()) return s;
  if (checkpoint_path.find("://") == std::string::npos) {
    return absl::InvalidArgumentError("checkpoint_path: expected twinkle://<run_id>/weights/<name>");
  }
  absl::StatusOr<registry::CheckpointRecord> record =
      options_.checkpoints->Resolve(tenant.id, checkpoint_path, "");
  if (!record.ok()) return record.status();
  // Verified here (sizes and SHA-256 of the adapter files), before anything is queued.
  if (absl::StatusOr<LoadedCheckpoint> loaded = options_.checkpoints->Load(*record, false); !loaded.ok()) {
    return loaded.status();
  }
  if (absl::Status s = CheckPending(tenant); !s.ok()) return s;
  MergedExportJob job{options_.model_dir, record->path,
                      (std::filesystem::path(options_.checkpoints->TenantRoot(tenant.id)) / "exports").string(),
                      export_name};
  // The export never touches the device: it runs as a process of its own, from the export
  // thread. Its queue ('#' never appears in adapter names) stays blocked meanwhile, so a
  // tenant has one export running at a time and the next one waits in its queue.
  const std::string key = absl::StrCat(tenant.id, "/#export");
  sched::Op op;
  op.tenant = tenant.id;
  op.adapter = key;
  op.kind = sched::OpKind::kOther;
  op.name = "export";
  op.payload = ControlPayload{[this, job, key, tenant_id = tenant.id]() -> FutureResult {
    const uint64_t op_id = current_op_;
    scheduler_->Block(key);
    export_jobs_.Post([this, job, key, op_id, tenant_id]() {
      const absl::Time started = absl::Now();
      absl::StatusOr<MergedExportDone> done = options_.exporter(job, [this] { return export_jobs_.stopping(); });
      FutureResult result = absl::InternalError("unset");
      if (done.ok()) {
        OpOutput out;
        out.checkpoint_dir = done->path;
        out.value = static_cast<double>(done->bytes);
        result = FutureValue(std::move(out));
        LogInfo(kLog, absl::StrCat("tenant ", tenant_id, ": merged export ", job.name, " written (", done->bytes,
                                   " bytes in ", absl::FormatDuration(absl::Now() - started), ")"));
      } else {
        result = done.status();
        LogWarning(kLog, absl::StrCat("tenant ", tenant_id, ": merged export ", job.name,
                                      " failed: ", done.status().message()));
      }
      futures_.Complete(op_id, std::move(result));
      scheduler_->Unblock(key);
    });
    return FutureValue(sched::Deferred{});
  }};
  return scheduler_->Submit(std::move(op));
}

}  // namespace twinkle::training
