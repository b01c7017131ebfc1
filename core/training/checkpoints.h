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
//   <data_dir>/tenants/<tenant>/runs/<run_id>/external_weights/<name>/  (adapter files only:
//       a PEFT directory for download, save_weights_external)
//
// Retention: a checkpoint may carry an expiry (ttl on save, SetTtl later); Reap() deletes
// the expired ones (directory first, durably, then the registry row: a crash in between
// leaves a row without a directory, which Recover() drops, so a restart finishes the
// deletion). An expired checkpoint that is not yet reaped resolves as NotFound.
// Quota: Save, Copy and Import refuse (RESOURCE_EXHAUSTED naming the quota, the usage and
// the size) a checkpoint that would take the tenant's bytes past its storage quota; the
// size is known exactly before anything is written (the files are built in memory), and
// concurrent writers of one tenant reserve their bytes.
// Sharing: Resolve (every read path: load, sample, weights info, export) falls back to a
// published checkpoint of another tenant; writes (Delete, SetTtl, publish) are owner-only.
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
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/common/clock.h"
#include "core/ipc/envelope.h"
#include "core/ipc/messages.h"
#include "core/ipc/training_messages.h"
#include "core/registry/registry.h"
#include "core/storage/checkpoint_dir.h"
#include "core/storage/filesystem.h"
#include "core/storage/tar_stream.h"
#include "core/training/lr_scheduler.h"
#include "core/training/types.h"

namespace twinkle::training {

enum class CheckpointKind { kTraining, kSampler, kExternal };

// "training" | "sampler" | "external" (the registry's kind).
const char* CheckpointKindName(CheckpointKind kind);

// The longest TTL a checkpoint may carry (Tinker's bound: 10 years) and the shortest (1 s;
// Tinker's service asks for 1 hour, which we do not force on self-hosted users).
inline constexpr int64_t kMaxTtlSeconds = int64_t{10} * 366 * 24 * 3600;
// InvalidArgument naming `field` unless 1 <= ttl_seconds <= kMaxTtlSeconds.
absl::Status ValidateTtl(int64_t ttl_seconds, absl::string_view field);

struct CheckpointPath {
  std::string run_id;
  CheckpointKind kind = CheckpointKind::kTraining;
  std::string name;
  std::string checkpoint_id() const;  // "weights/<name>" | "sampler_weights/<name>" | "external_weights/<name>"
  std::string uri(absl::string_view scheme = "twinkle") const;
};

// "twinkle://<run_id>/weights/<name>" (also tinker://, sampler_weights). InvalidArgument
// naming `field` otherwise; names are validated as path components.
absl::StatusOr<CheckpointPath> ParseCheckpointPath(absl::string_view path, absl::string_view field);

// The shapes of every tensor of the HF model in `model_dir` (its *.safetensors headers).
absl::StatusOr<std::map<std::string, std::vector<int64_t>>> BaseWeightShapes(const std::string& model_dir);

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
  std::optional<int64_t> ttl_seconds;  // set: the checkpoint expires this long after it is saved
};

// Per-tenant storage quotas in bytes (0 = unlimited).
struct StorageQuotas {
  int64_t default_bytes = 0;
  absl::flat_hash_map<std::string, int64_t> by_tenant;
  int64_t For(const std::string& tenant) const {
    auto it = by_tenant.find(tenant);
    return it == by_tenant.end() ? default_bytes : it->second;
  }
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
                  std::string base_model, const Clock& clock = RealClock());

  // Set once at startup, before any Save.
  void SetQuotas(StorageQuotas quotas) { quotas_ = std::move(quotas); }
  const StorageQuotas& quotas() const { return quotas_; }
  const Clock& clock() const { return clock_; }

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

  // Removes the directory and the registry row (owner only: another tenant's is NotFound).
  absl::Status Delete(const std::string& tenant, const std::string& run_id, const std::string& checkpoint_id);

  // Deletes every checkpoint whose expiry is at or before clock().Now(); returns the
  // tinker paths it deleted. Stops at the first error (the rest are retried next time).
  absl::StatusOr<std::vector<std::string>> Reap();

  // Sets (ttl_seconds) or clears (nullopt) the checkpoint's expiry, counted from now.
  absl::Status SetTtl(const std::string& tenant, const std::string& run_id, const std::string& checkpoint_id,
                      std::optional<int64_t> ttl_seconds);

  // Copies a checkpoint the tenant can read (its own or a published one) into the tenant's
  // run `dst_run_id` (which must exist) as `kind/name`, with an optional TTL. Quota-checked.
  // `before_write` (optional) runs once the copy is admitted (quota included), before anything
  // is written: the caller records the run there; its error is returned as is.
  absl::StatusOr<registry::CheckpointRecord> Copy(const std::string& tenant, const registry::CheckpointRecord& source,
                                                  const std::string& dst_run_id, CheckpointKind kind,
                                                  const std::string& name, std::optional<int64_t> ttl_seconds,
                                                  const std::function<absl::Status()>& before_write = nullptr);

  // Writes a PEFT adapter (adapter_model.safetensors bytes + adapter_config.json text) as the
  // tenant's checkpoint `kind/name` of run `run_id`. The caller validated the content.
  absl::StatusOr<registry::CheckpointRecord> WriteAdapter(const std::string& tenant, const std::string& run_id,
                                                          CheckpointKind kind, const std::string& name,
                                                          std::string safetensors, std::string adapter_config,
                                                          std::optional<int64_t> ttl_seconds,
                                                          const std::function<absl::Status()>& before_write = nullptr);

  // Import of a PEFT LoRA adapter trained elsewhere, as the tenant's training checkpoint
  // weights/<name> of run `run_id` (which must exist). Validated before anything is written
  // (InvalidArgument naming the key or tensor at fault): adapter_config is a LORA config with
  // 1 <= r <= max_rank, no DoRA, bias "none", no modules_to_save or rank/alpha patterns;
  // every tensor is base_model.model.<module>.lora_{A,B}.weight in F32 where <module>.weight
  // is a 2-D weight of the base model ([out, in]; lm_head falls back to the tied embedding),
  // A is [r, in] and B [out, r]; the modules are exactly the base model's modules of the
  // targeted kinds (q/k/v/o_proj, gate/up/down_proj, lm_head), none missing and none extra.
  // The adapter is stored with the server's scale (lora_alpha kDefaultLoraAlpha, rsLoRA off):
  // B is multiplied by its scale / ours, so the adapter computes the same delta.
  // `base_shapes`: the base model's tensor shapes by name (BaseWeightShapes). `before_write`
  // runs once the adapter is valid and admitted (quota included), with its LoraArgs, before
  // anything is written (the caller records the run there); its error is returned as is.
  absl::StatusOr<registry::CheckpointRecord> ImportPeftAdapter(
      const std::string& tenant, const std::string& run_id, const std::string& name, const std::string& safetensors,
      const nlohmann::json& adapter_config, const std::map<std::string, std::vector<int64_t>>& base_shapes,
      int64_t max_rank, std::optional<int64_t> ttl_seconds,
      const std::function<absl::Status(const LoraArgs&)>& before_write);

  // The checkpoint's files as its metadata lists them: {name: {"size", "sha256"}}.
  absl::StatusOr<nlohmann::json> ListFiles(const registry::CheckpointRecord& record);
  // One listed file's bytes, checked against the metadata's size and SHA-256 (DataLoss when
  // they differ); NotFound for a name the metadata does not list.
  absl::StatusOr<std::string> ReadListedFile(const registry::CheckpointRecord& record, const std::string& file);
  // Where one listed file is, with its recorded size and SHA-256, for a reader that streams
  // it in chunks and checks it as it goes (core/storage/tar_stream.h). NotFound as above.
  absl::StatusOr<storage::StreamedFile> ListedFile(const registry::CheckpointRecord& record, const std::string& file);

  // The tenant's checkpoint bytes (registry sum).
  absl::StatusOr<int64_t> StorageBytes(const std::string& tenant);

  std::string RunDir(const std::string& tenant, const std::string& run_id) const;
  std::string TenantRoot(const std::string& tenant) const;

 private:
  const std::string data_dir_;
  storage::FileSystem& fs_;
  registry::Registry& registry_;
  const std::string base_model_;
  const Clock& clock_;
  StorageQuotas quotas_;

  // Writes `files` as kind/name and records it; refuses past the quota before writing.
  absl::StatusOr<registry::CheckpointRecord> WriteAndRecord(const std::string& tenant, const std::string& run_id,
                                                            CheckpointKind kind, const std::string& name,
                                                            const std::vector<storage::FileContent>& files,
                                                            const nlohmann::json& metadata,
                                                            std::optional<int64_t> ttl_seconds,
                                                            const std::function<absl::Status()>& before_write = nullptr);
  // Bytes being written per tenant (reserved by WriteAndRecord while it writes).
  absl::Mutex reserve_mu_;
  absl::flat_hash_map<std::string, int64_t> reserved_ ABSL_GUARDED_BY(reserve_mu_);
};

}  // namespace twinkle::training
