#pragma once
// Checkpoints on disk, per tenant and run, in the layout Twinkle and PEFT users expect:
//
//   <data_dir>/tenants/<tenant>/runs/<run_id>/weights/<name>/          (training)
//       adapter_model.safetensors   PEFT key names, fp32
//       adapter_config.json         PEFT's LoraConfig fields (PeftModel.from_pretrained loads it)
//       trainer_state.json          checkpoint_version, cur_step, gradient_accumulation_steps,
//                                   consumed_train_samples, lr_scheduler, optimizer settings,
//                                   loss, RNG state (seed, micro-batch counter)
//       optimizer.safetensors       optimizer state tensors (when saved with the optimizer)
//       optimizer.json              optimizer kind, hyper-parameters, step
//       checkpoint_metadata.json    size and SHA-256 of every file above; written last
//   <data_dir>/tenants/<tenant>/runs/<run_id>/sampler_weights/<name>/   (adapter files only)
//
// Directories are written atomically (core/storage); the registry records a checkpoint only
// once its directory is complete, and Recover() reconciles the two at startup. Paths
// `twinkle://<run_id>/weights/<name>` (or `tinker://…`, or `sampler_weights`) resolve only
// inside the caller's tenant.
//
// The coordinator writes the files itself, from the tensors get_adapter_state returns (they
// already cross the IPC for offloading), so one writer owns atomicity, the registry and the
// fault-injection seam.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/ipc/envelope.h"
#include "core/ipc/messages.h"
#include "core/ipc/training_messages.h"
#include "core/registry/registry.h"
#include "core/storage/filesystem.h"
#include "core/training/lr_scheduler.h"
#include "core/training/types.h"

namespace twinkle::training {

enum class CheckpointKind { kTraining, kSampler };

struct CheckpointPath {
  std::string run_id;
  CheckpointKind kind = CheckpointKind::kTraining;
  std::string name;
  std::string checkpoint_id() const;  // "weights/<name>" | "sampler_weights/<name>"
  std::string uri(absl::string_view scheme = "twinkle") const;
};

// "twinkle://<run_id>/weights/<name>" (also tinker://, sampler_weights). InvalidArgument
// naming `field` otherwise; names are validated as path components.
absl::StatusOr<CheckpointPath> ParseCheckpointPath(absl::string_view path, absl::string_view field);

// Everything about an adapter's training that is not a tensor.
struct TrainerState {
  int64_t cur_step = 0;  // backwards so far (Twinkle's cur_step)
  int32_t gradient_accumulation_steps = 1;
  int64_t consumed_train_samples = 0;
  std::optional<SchedulerSpec> lr_scheduler;
  int64_t lr_steps = 0;
  int64_t optimizer_steps = 0;
  std::string optimizer_kind = "adamw";
  std::map<std::string, double> optimizer_hyper;
  ipc::LossSpecMsg loss;
  int64_t micro_batches_since_step = 0;
  uint64_t seed = 0;
};

// What to write: the adapter's state as get_adapter_state returned it.
struct CheckpointContent {
  const ipc::Message* state = nullptr;  // reply frames; body is an ipc::AdapterStateReply
  bool include_optimizer = true;
  TrainerState trainer;
  LoraArgs lora;
};

// A checkpoint read back and verified, in the form set_adapter_state takes.
struct LoadedCheckpoint {
  std::vector<std::string> buffers;
  std::map<std::string, ipc::TensorDesc> weights;
  std::map<std::string, ipc::TensorDesc> optimizer;  // empty unless asked for and present
  std::optional<TrainerState> trainer;               // training checkpoints
  LoraArgs lora;
  nlohmann::json metadata;
};

class CheckpointStore {
 public:
  CheckpointStore(std::string data_dir, storage::FileSystem& fs, registry::Registry& registry,
                  std::string base_model);

  // Startup: removes temp dirs, restores dirs a crash left mid-replace, drops registry rows
  // whose directory is gone or incomplete, and registers complete directories the registry
  // misses (a crash between the rename and the registry write). Returns one line per change.
  absl::StatusOr<std::vector<std::string>> Recover();

  // Writes the checkpoint (atomically) and records it. Blocking I/O: call off the scheduler
  // thread.
  absl::StatusOr<registry::CheckpointRecord> Save(const std::string& tenant, const std::string& run_id,
                                                  CheckpointKind kind, const std::string& name,
                                                  const CheckpointContent& content);

  // `path_or_name`: a twinkle:// or tinker:// path, or a bare name of `default_run_id`'s
  // training checkpoints. NotFound (like an unknown one) for another tenant's.
  absl::StatusOr<registry::CheckpointRecord> Resolve(const std::string& tenant, const std::string& path_or_name,
                                                     const std::string& default_run_id);

  // Reads and verifies every file (sizes, SHA-256) and parses the tensors.
  absl::StatusOr<LoadedCheckpoint> Load(const registry::CheckpointRecord& record, bool with_optimizer);

  // Removes the directory and the registry row.
  absl::Status Delete(const std::string& tenant, const std::string& run_id, const std::string& checkpoint_id);

  std::string RunDir(const std::string& tenant, const std::string& run_id) const;
  std::string TenantRoot(const std::string& tenant) const;

 private:
  const std::string data_dir_;
  storage::FileSystem& fs_;
  registry::Registry& registry_;
  const std::string base_model_;
};

}  // namespace twinkle::training
