#include "core/training/checkpoints.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/types/span.h"
#include "core/common/log.h"
#include "core/engine/model/safetensors.h"
#include "core/storage/checkpoint_dir.h"
#include "core/storage/names.h"
#include "core/storage/safetensors_writer.h"

namespace twinkle::training {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr char kLog[] = "checkpoints";
constexpr char kAdapterWeights[] = "adapter_model.safetensors";
constexpr char kAdapterConfig[] = "adapter_config.json";
constexpr char kTrainerState[] = "trainer_state.json";
constexpr char kOptimizerTensors[] = "optimizer.safetensors";
constexpr char kOptimizerConfig[] = "optimizer.json";
constexpr int kCheckpointVersion = 1;

// Every checkpoint kind: its folder under a run (also the checkpoint id's first part) and its
// name in the registry. The one table both directions read.
struct KindInfo {
  CheckpointKind kind;
  const char* dir;
  const char* name;
};
constexpr KindInfo kKinds[] = {{CheckpointKind::kTraining, "weights", "training"},
                               {CheckpointKind::kSampler, "sampler_weights", "sampler"},
                               {CheckpointKind::kExternal, "external_weights", "external"}};

const KindInfo& InfoOf(CheckpointKind kind) {
  for (const KindInfo& k : kKinds) {
    if (k.kind == kind) return k;
  }
  return kKinds[0];
}

const char* KindDir(CheckpointKind kind) { return InfoOf(kind).dir; }

// The LoRA-able linears of the decoders we load, by PEFT's module names, in groups: full
// attention, the MLP, and Qwen3.5's Gated DeltaNet (linear attention). "all-linear" is all of
// them but lm_head, as in PEFT.
constexpr const char* kAttnKinds[] = {"q_proj", "k_proj", "v_proj", "o_proj"};
constexpr const char* kMlpKinds[] = {"gate_proj", "up_proj", "down_proj"};
constexpr const char* kLinearAttnKinds[] = {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"};
constexpr absl::Span<const char* const> kKindGroups[] = {kAttnKinds, kMlpKinds, kLinearAttnKinds};

// "model.layers.0.mlp.up_proj" -> "up_proj".
std::string KindOf(absl::string_view module) {
  const size_t dot = module.rfind('.');
  return std::string(dot == absl::string_view::npos ? module : module.substr(dot + 1));
}

// adapter_config.json's target_modules where the engine has not stated them (an import, whose
// targets are explicit): "all-linear" as the attention and MLP kinds.
std::vector<std::string> PeftTargetModules(const std::vector<std::string>& targets) {
  std::vector<std::string> out;
  const auto add = [&out](const std::string& name) {
    if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
  };
  for (const std::string& t : targets) {
    if (t != "all-linear") {
      add(t);
      continue;
    }
    for (const char* kind : kAttnKinds) add(kind);
    for (const char* kind : kMlpKinds) add(kind);
  }
  return out;
}

// `peft`: the engine's statement of the targets on its model (get_adapter_state), which
// wins where it has any: it knows what "all-linear" resolves to there, and which names PEFT
// turns into target_parameters (Qwen3-MoE's experts and router).
json PeftAdapterConfig(const LoraArgs& lora, const std::string& base_model,
                       const ipc::PeftTargets* peft = nullptr) {
  const bool engine = peft != nullptr && (!peft->target_modules.empty() || !peft->target_parameters.empty());
  json target_parameters = nullptr;
  json rank_pattern = json::object(), alpha_pattern = json::object();
  if (engine && !peft->target_parameters.empty()) {
    target_parameters = peft->target_parameters;
    for (const auto& [k, v] : peft->rank_pattern) rank_pattern[k] = v;
    for (const auto& [k, v] : peft->alpha_pattern) alpha_pattern[k] = v;
  }
  return json{{"peft_type", "LORA"},
              {"task_type", "CAUSAL_LM"},
              {"base_model_name_or_path", base_model},
              {"r", lora.rank},
              {"lora_alpha", lora.alpha},
              {"lora_dropout", lora.dropout},
              {"target_modules", engine ? peft->target_modules : PeftTargetModules(lora.targets)},
              {"target_parameters", target_parameters},
              {"use_rslora", lora.use_rslora},
              {"bias", "none"},
              {"fan_in_fan_out", false},
              {"inference_mode", true},
              {"init_lora_weights", true},
              {"modules_to_save", nullptr},
              {"use_dora", false},
              {"rank_pattern", rank_pattern},
              {"alpha_pattern", alpha_pattern}};
}

json TrainerStateJson(const TrainerState& t) {
  json j{{"checkpoint_version", kCheckpointVersion},
         {"cur_step", t.cur_step},
         {"gradient_accumulation_steps", t.gradient_accumulation_steps},
         {"consumed_train_samples", t.consumed_train_samples},
         {"lr_steps", t.lr_steps},
         {"optimizer_steps", t.optimizer_steps},
         {"optimizer", {{"name", t.optimizer_kind}, {"config", t.optimizer_hyper}}},
         {"loss", {{"name", t.loss.name}, {"config", t.loss.config}, {"string_config", t.loss.string_config}}},
         {"rng", {{"seed", t.seed}, {"micro_batches_since_step", t.micro_batches_since_step}}}};
  j["lr_scheduler"] = t.lr_scheduler ? json{{"name", t.lr_scheduler->name}, {"config", t.lr_scheduler->config}}
                                     : json(nullptr);
  return j;
}

absl::StatusOr<TrainerState> ParseTrainerState(const json& j) {
  try {
    TrainerState t;
    if (j.at("checkpoint_version").get<int>() > kCheckpointVersion) {
      return absl::FailedPreconditionError(absl::StrCat("trainer_state.json: checkpoint_version ",
                                                        j.at("checkpoint_version").get<int>(),
                                                        " is newer than this server's ", kCheckpointVersion));
    }
    t.cur_step = j.at("cur_step").get<int64_t>();
    t.gradient_accumulation_steps = j.at("gradient_accumulation_steps").get<int32_t>();
    t.consumed_train_samples = j.at("consumed_train_samples").get<int64_t>();
    t.lr_steps = j.value("lr_steps", int64_t{0});
    t.optimizer_steps = j.value("optimizer_steps", int64_t{0});
    t.optimizer_kind = j.at("optimizer").at("name").get<std::string>();
    t.optimizer_hyper = j.at("optimizer").at("config").get<std::map<std::string, double>>();
    t.loss.name = j.at("loss").at("name").get<std::string>();
    t.loss.config = j.at("loss").at("config").get<std::map<std::string, double>>();
    t.loss.string_config = j.at("loss").value("string_config", std::map<std::string, std::string>{});
    t.seed = j.at("rng").at("seed").get<uint64_t>();
    t.micro_batches_since_step = j.at("rng").at("micro_batches_since_step").get<int64_t>();
    if (!j.at("lr_scheduler").is_null()) {
      t.lr_scheduler = SchedulerSpec{j.at("lr_scheduler").at("name").get<std::string>(),
                                     j.at("lr_scheduler").at("config").get<std::map<std::string, double>>()};
    }
    return t;
  } catch (const json::exception& e) {
    return absl::DataLossError(absl::StrCat("trainer_state.json: ", e.what()));
  }
}

absl::StatusOr<LoraArgs> ParseAdapterConfig(const json& j) {
  try {
    LoraArgs lora;
    lora.rank = j.at("r").get<int64_t>();
    lora.alpha = j.at("lora_alpha").get<double>();
    lora.dropout = j.value("lora_dropout", 0.0);
    lora.use_rslora = j.value("use_rslora", false);
    const json& targets = j.at("target_modules");
    lora.targets = targets.is_string() ? std::vector<std::string>{targets.get<std::string>()}
                                       : targets.get<std::vector<std::string>>();
    // Qwen3-MoE as PEFT writes it: the experts' and router's LoRA are target_parameters (back
    // to the names they came from), gate_up_proj's rank and alpha doubled by the patterns.
    bool gate_up = false;
    if (j.contains("target_parameters") && !j["target_parameters"].is_null()) {
      for (const std::string& p : j["target_parameters"].get<std::vector<std::string>>()) {
        const auto is = [&p](const std::string& name) { return p == name || absl::EndsWith(p, "." + name); };
        if (is("gate_up_proj")) {
          gate_up = true;
          lora.targets.insert(lora.targets.end(), {"gate_proj", "up_proj"});
        } else if (is("down_proj")) {
          lora.targets.push_back("down_proj");
        } else if (is("gate.weight")) {
          lora.targets.push_back("gate");
        } else {
          return absl::DataLossError(absl::StrCat("adapter_config.json: target_parameters '", p,
                                                  "' is not supported (gate_up_proj, down_proj, gate.weight)"));
        }
      }
    }
    const std::string pattern = ".*\\.gate_up_proj";
    const auto expect = [&](const char* key, double want) -> absl::Status {
      if (!j.contains(key) || j[key].is_null() || j[key].empty()) {
        return gate_up ? absl::DataLossError(absl::StrCat("adapter_config.json: ", key, " must hold {\"", pattern,
                                                          "\": ", want, "} with target_parameters gate_up_proj"))
                       : absl::OkStatus();
      }
      if (!gate_up || j[key].size() != 1 || !j[key].contains(pattern) || j[key][pattern].get<double>() != want) {
        return absl::DataLossError(absl::StrCat("adapter_config.json: ", key, " ", j[key].dump(),
                                                " is not supported (only {\"", pattern, "\": ", want,
                                                "}, as PEFT writes it for the experts' gate_up_proj)"));
      }
      return absl::OkStatus();
    };
    if (absl::Status s = expect("rank_pattern", 2.0 * static_cast<double>(lora.rank)); !s.ok()) return s;
    if (absl::Status s = expect("alpha_pattern", 2.0 * lora.alpha); !s.ok()) return s;
    return lora;
  } catch (const json::exception& e) {
    return absl::DataLossError(absl::StrCat("adapter_config.json: ", e.what()));
  }
}

// Frames of a get_adapter_state reply as safetensors tensors.
absl::StatusOr<std::map<std::string, storage::TensorBytes>> ToTensorBytes(
    const std::map<std::string, ipc::TensorDesc>& descs, const ipc::Message& state) {
  std::map<std::string, storage::TensorBytes> out;
  for (const auto& [name, desc] : descs) {
    if (absl::Status s = ipc::ValidateTensor(desc, state.buffers); !s.ok()) return s;
    absl::StatusOr<std::string> dtype = storage::SafetensorsDtype(desc.dtype);
    if (!dtype.ok()) return dtype.status();
    out[name] = storage::TensorBytes{*dtype, desc.shape, state.buffers[desc.frame]};
  }
  return out;
}

absl::StatusOr<std::string> IpcDtype(engine::SafetensorsDtype dtype) {
  switch (dtype) {
    case engine::SafetensorsDtype::kF32: return std::string("float32");
    case engine::SafetensorsDtype::kF16: return std::string("float16");
    case engine::SafetensorsDtype::kBF16: return std::string("bfloat16");
    case engine::SafetensorsDtype::kI64: return std::string("int64");
    case engine::SafetensorsDtype::kI32: return std::string("int32");
    case engine::SafetensorsDtype::kU8: return std::string("uint8");
    case engine::SafetensorsDtype::kBool: return std::string("bool");
    default:
      return absl::DataLossError(absl::StrCat("unsupported tensor dtype ",
                                              std::string(engine::SafetensorsDtypeName(dtype))));
  }
}

// Parses a safetensors file held in `bytes` into frames appended to `buffers`.
absl::StatusOr<std::map<std::string, ipc::TensorDesc>> ReadTensors(const std::string& bytes, const std::string& what,
                                                                   std::vector<std::string>& buffers) {
  const absl::Span<const uint8_t> span(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  absl::StatusOr<std::vector<engine::TensorInfo>> tensors = engine::ParseSafetensorsHeader(span, what);
  if (!tensors.ok()) return absl::DataLossError(tensors.status().message());
  std::map<std::string, ipc::TensorDesc> out;
  for (const engine::TensorInfo& t : *tensors) {
    absl::StatusOr<std::string> dtype = IpcDtype(t.dtype);
    if (!dtype.ok()) return dtype.status();
    ipc::TensorDesc desc{*dtype, t.shape, static_cast<uint32_t>(buffers.size())};
    buffers.emplace_back(bytes.substr(t.file_offset, t.nbytes()));
    out[t.name] = desc;
  }
  return out;
}

std::string Rfc3339(absl::Time t) { return absl::FormatTime(absl::RFC3339_full, t, absl::UTCTimeZone()); }

// An RFC 3339 time field of checkpoint metadata; nullopt when absent or unparsable.
std::optional<absl::Time> MetadataTime(const json& metadata, const char* field) {
  if (!metadata.is_object() || !metadata.contains(field) || !metadata[field].is_string()) return std::nullopt;
  absl::Time t;
  std::string error;
  if (!absl::ParseTime(absl::RFC3339_full, metadata[field].get<std::string>(), &t, &error)) return std::nullopt;
  return t;
}

}  // namespace

const char* CheckpointKindName(CheckpointKind kind) { return InfoOf(kind).name; }

absl::Status ValidateTtl(int64_t ttl_seconds, absl::string_view field) {
  if (ttl_seconds < 1 || ttl_seconds > kMaxTtlSeconds) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(field), ": ", ttl_seconds,
                                                   " is out of range (1 to ", kMaxTtlSeconds,
                                                   " seconds, or null for no expiry)"));
  }
  return absl::OkStatus();
}

std::string CheckpointPath::checkpoint_id() const { return absl::StrCat(KindDir(kind), "/", name); }

std::string CheckpointPath::uri(absl::string_view scheme) const {
  return absl::StrCat(std::string(scheme), "://", run_id, "/", checkpoint_id());
}

absl::StatusOr<CheckpointPath> ParseCheckpointPath(absl::string_view path, absl::string_view field) {
  absl::string_view rest = path;
  if (!absl::ConsumePrefix(&rest, "twinkle://") && !absl::ConsumePrefix(&rest, "tinker://")) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(field), ": '", std::string(path),
                                                   "' is not a twinkle:// or tinker:// checkpoint path"));
  }
  const std::vector<std::string> parts = absl::StrSplit(rest, '/');
  const KindInfo* kind = nullptr;
  for (const KindInfo& k : kKinds) {
    if (parts.size() == 3 && parts[1] == k.dir) kind = &k;
  }
  if (kind == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(field), ": '", std::string(path),
                                                   "' must look like twinkle://<run_id>/weights/<name>, "
                                                   "twinkle://<run_id>/sampler_weights/<name> "
                                                   "or twinkle://<run_id>/external_weights/<name>"));
  }
  if (absl::Status s = storage::ValidatePathName(parts[0], absl::StrCat(std::string(field), " run id")); !s.ok()) {
    return s;
  }
  if (absl::Status s = storage::ValidatePathName(parts[2], absl::StrCat(std::string(field), " name")); !s.ok()) {
    return s;
  }
  return CheckpointPath{parts[0], kind->kind, parts[2]};
}

CheckpointStore::CheckpointStore(std::string data_dir, storage::FileSystem& fs, registry::Registry& registry,
                                 std::string base_model, const Clock& clock)
    : data_dir_(std::move(data_dir)), fs_(fs), registry_(registry), base_model_(std::move(base_model)),
      clock_(clock) {}

std::string CheckpointStore::TenantRoot(const std::string& tenant) const {
  return (fs::path(data_dir_) / "tenants" / tenant).string();
}

std::string CheckpointStore::RunDir(const std::string& tenant, const std::string& run_id) const {
  return (fs::path(TenantRoot(tenant)) / "runs" / run_id).string();
}

absl::StatusOr<registry::CheckpointRecord> CheckpointStore::Save(const std::string& tenant, const std::string& run_id,
                                                                 CheckpointKind kind, const std::string& name,
                                                                 const CheckpointContent& content) {
  if (absl::Status s = storage::ValidatePathName(name, "name"); !s.ok()) return s;
  if (absl::Status s = storage::ValidatePathName(run_id, "run_id"); !s.ok()) return s;
  absl::StatusOr<ipc::AdapterStateReply> state =
      ipc::Unpack<ipc::AdapterStateReply>(content.state->envelope.body, "get_adapter_state reply");
  if (!state.ok()) return state.status();

  std::vector<storage::FileContent> files;
  absl::StatusOr<std::map<std::string, storage::TensorBytes>> weights = ToTensorBytes(state->weights, *content.state);
  if (!weights.ok()) return weights.status();
  absl::StatusOr<std::string> adapter = storage::SerializeSafetensors(*weights, {{"format", "pt"}});
  if (!adapter.ok()) return adapter.status();
  files.push_back({kAdapterWeights, *std::move(adapter)});
  files.push_back({kAdapterConfig, PeftAdapterConfig(content.lora, base_model_, &state->peft).dump(2)});
  const bool training = kind == CheckpointKind::kTraining;
  const bool with_optimizer = training && content.include_optimizer;
  if (training) files.push_back({kTrainerState, TrainerStateJson(content.trainer).dump(2)});
  if (with_optimizer) {
    absl::StatusOr<std::map<std::string, storage::TensorBytes>> opt = ToTensorBytes(state->optimizer, *content.state);
    if (!opt.ok()) return opt.status();
    absl::StatusOr<std::string> bytes = storage::SerializeSafetensors(*opt);
    if (!bytes.ok()) return bytes.status();
    files.push_back({kOptimizerTensors, *std::move(bytes)});
    files.push_back({kOptimizerConfig, json{{"name", state->optimizer_kind},
                                            {"step", state->step},
                                            {"config", content.trainer.optimizer_hyper}}.dump(2)});
  }
  const CheckpointPath path{run_id, kind, name};
  const absl::Time now = clock_.Now();
  const auto has = [&](const std::string& t) {
    const std::vector<std::string> m = PeftTargetModules(content.lora.targets);
    return std::find(m.begin(), m.end(), t) != m.end();
  };
  const json metadata{{"checkpoint_version", kCheckpointVersion},
                      {"base_model", base_model_},
                      {"tenant", tenant},
                      {"run_id", run_id},
                      {"checkpoint_id", path.checkpoint_id()},
                      {"checkpoint_type", CheckpointKindName(kind)},
                      {"twinkle_path", path.uri()},
                      {"is_lora", true},
                      {"lora_rank", content.lora.rank},
                      {"train_attn", has("q_proj")},
                      {"train_mlp", has("gate_proj")},
                      {"train_unembed", has("lm_head")},
                      {"has_optimizer", with_optimizer},
                      {"created", Rfc3339(now)}};
  return WriteAndRecord(tenant, run_id, kind, name, files, metadata, content.ttl_seconds);
}

absl::StatusOr<registry::CheckpointRecord> CheckpointStore::WriteAndRecord(
    const std::string& tenant, const std::string& run_id, CheckpointKind kind, const std::string& name,
    const std::vector<storage::FileContent>& files, const json& metadata, std::optional<int64_t> ttl_seconds,
    const std::function<absl::Status()>& before_write) {
  if (ttl_seconds) {
    if (absl::Status s = ValidateTtl(*ttl_seconds, "ttl_seconds"); !s.ok()) return s;
  }
  const CheckpointPath path{run_id, kind, name};
  int64_t size = 0;
  for (const storage::FileContent& f : files) size += static_cast<int64_t>(f.bytes.size());
  // The quota, decided before anything is written: what the tenant holds (less the
  // checkpoint this one replaces), plus what its other writers have reserved, plus this.
  const int64_t quota = quotas_.For(tenant);
  int64_t reserved = 0;
  if (quota > 0) {
    // Read under the lock: a writer that finishes between the read and the reservation would
    // otherwise be counted neither as stored nor as reserved.
    absl::MutexLock lock(&reserve_mu_);
    absl::StatusOr<int64_t> used = registry_.TenantStorageBytes(tenant);
    if (!used.ok()) return used.status();
    int64_t replaced = 0;
    if (absl::StatusOr<registry::CheckpointRecord> old = registry_.GetCheckpoint(tenant, run_id, path.checkpoint_id());
        old.ok()) {
      replaced = old->size_bytes;
    }
    const int64_t in_flight = reserved_[tenant];
    const int64_t after = *used - replaced + in_flight + size;
    if (after > quota) {
      return absl::FailedPreconditionError(absl::StrCat(
          "storage quota: tenant '", tenant, "' has a quota of ", quota, " bytes and uses ", *used - replaced + in_flight,
          " bytes; checkpoint ", path.checkpoint_id(), " needs ", size, " more (", after,
          " > ", quota, "); delete checkpoints or set TTLs to free space"));
    }
    reserved_[tenant] += size;
    reserved = size;
  }
  // The reservation ends when the row is recorded (in the same critical section, so the bytes
  // are never counted twice nor missed), or when the write fails.
  auto release_locked = [this, &tenant, &reserved]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(reserve_mu_) {
    if (reserved == 0) return;
    if ((reserved_[tenant] -= reserved) == 0) reserved_.erase(tenant);
    reserved = 0;
  };
  absl::Cleanup release = [this, &release_locked] {
    absl::MutexLock lock(&reserve_mu_);
    release_locked();
  };
  if (before_write) {
    if (absl::Status s = before_write(); !s.ok()) return s;
  }
  // The creation time and expiry are kept in the checkpoint's own metadata too (the same
  // values as its registry row), so that a checkpoint registered again from its directory
  // (Recover) keeps them.
  const absl::Time now = clock_.Now();
  std::optional<absl::Time> expires;
  if (ttl_seconds) expires = now + absl::Seconds(*ttl_seconds);
  json stored = metadata.is_object() ? metadata : json::object();
  stored["created"] = Rfc3339(now);
  if (expires) {
    stored["expires_at"] = Rfc3339(*expires);
  } else {
    stored.erase("expires_at");  // a copy's source may carry one
  }
  const fs::path parent = fs::path(RunDir(tenant, run_id)) / KindDir(kind);
  absl::StatusOr<fs::path> dir = storage::WriteCheckpointDir(fs_, parent, name, files, stored);
  if (!dir.ok()) return dir.status();
  registry::CheckpointRecord record{tenant, run_id, path.checkpoint_id(), CheckpointKindName(kind), dir->string(),
                                    size, now, expires, false};
  absl::MutexLock lock(&reserve_mu_);
  absl::Status put = registry_.PutCheckpoint(record);
  release_locked();
  if (!put.ok()) return put;
  return record;
}

absl::StatusOr<registry::CheckpointRecord> CheckpointStore::Resolve(const std::string& tenant,
                                                                    const std::string& path_or_name,
                                                                    const std::string& default_run_id) {
  CheckpointPath path;
  if (absl::StrContains(path_or_name, "://")) {
    absl::StatusOr<CheckpointPath> parsed = ParseCheckpointPath(path_or_name, "name");
    if (!parsed.ok()) return parsed.status();
    path = *parsed;
  } else {
    if (absl::Status s = storage::ValidatePathName(path_or_name, "name"); !s.ok()) return s;
    path = CheckpointPath{default_run_id, CheckpointKind::kTraining, path_or_name};
  }
  absl::StatusOr<registry::CheckpointRecord> record =
      registry_.GetCheckpoint(tenant, path.run_id, path.checkpoint_id());
  // Another tenant's checkpoint is readable once published (and never writable).
  if (absl::IsNotFound(record.status())) record = registry_.GetPublishedCheckpoint(path.run_id, path.checkpoint_id());
  if (absl::IsNotFound(record.status()) || (record.ok() && record->expires && *record->expires <= clock_.Now())) {
    return absl::NotFoundError(absl::StrCat("no checkpoint '", path.uri(), "'"));
  }
  return record;
}

absl::StatusOr<LoadedCheckpoint> CheckpointStore::Load(const registry::CheckpointRecord& record, bool with_optimizer) {
  const fs::path dir(record.path);
  // Never follow a registry row outside its tenant's root (defence in depth).
  if (!storage::IsInside(TenantRoot(record.tenant), dir)) {
    return absl::InternalError(absl::StrCat("checkpoint ", record.checkpoint_id, " lies outside its tenant's root"));
  }
  absl::StatusOr<json> metadata = storage::VerifyCheckpointDir(fs_, dir);
  if (!metadata.ok()) return metadata.status();
  LoadedCheckpoint out;
  out.metadata = *metadata;
  absl::StatusOr<std::string> weights = fs_.ReadFile(dir / kAdapterWeights);
  if (!weights.ok()) return weights.status();
  absl::StatusOr<std::map<std::string, ipc::TensorDesc>> w = ReadTensors(*weights, kAdapterWeights, out.buffers);
  if (!w.ok()) return w.status();
  out.weights = *std::move(w);
  absl::StatusOr<std::string> config = fs_.ReadFile(dir / kAdapterConfig);
  if (!config.ok()) return config.status();
  absl::StatusOr<LoraArgs> lora = ParseAdapterConfig(json::parse(*config, nullptr, false));
  if (!lora.ok()) return lora.status();
  out.lora = *lora;
  if (fs_.Exists(dir / kTrainerState)) {
    absl::StatusOr<std::string> text = fs_.ReadFile(dir / kTrainerState);
    if (!text.ok()) return text.status();
    absl::StatusOr<TrainerState> trainer = ParseTrainerState(json::parse(*text, nullptr, false));
    if (!trainer.ok()) return trainer.status();
    out.trainer = *trainer;
  }
  if (with_optimizer) {
    if (!fs_.Exists(dir / kOptimizerTensors)) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint ", record.checkpoint_id,
                                                        " was saved without its optimizer state"));
    }
    absl::StatusOr<std::string> bytes = fs_.ReadFile(dir / kOptimizerTensors);
    if (!bytes.ok()) return bytes.status();
    absl::StatusOr<std::map<std::string, ipc::TensorDesc>> o = ReadTensors(*bytes, kOptimizerTensors, out.buffers);
    if (!o.ok()) return o.status();
    out.optimizer = *std::move(o);
  }
  return out;
}

absl::Status CheckpointStore::Delete(const std::string& tenant, const std::string& run_id,
                                     const std::string& checkpoint_id) {
  absl::StatusOr<registry::CheckpointRecord> record = registry_.GetCheckpoint(tenant, run_id, checkpoint_id);
  if (!record.ok()) return record.status();
  if (!storage::IsInside(TenantRoot(tenant), record->path)) {
    return absl::InternalError(absl::StrCat("checkpoint ", checkpoint_id, " lies outside its tenant's root"));
  }
  // The directory first, durably (renamed away and the parent fsynced): a crash after it
  // leaves a registry row whose directory is gone, which Recover() drops; a deleted
  // checkpoint never comes back (re-registering an orphan directory would revive it).
  if (absl::Status s = storage::DeleteCheckpointDir(fs_, record->path); !s.ok()) return s;
  return registry_.DeleteCheckpoint(tenant, run_id, checkpoint_id);
}

absl::StatusOr<std::vector<std::string>> CheckpointStore::Recover() {
  std::vector<std::string> changes;
  const fs::path tenants = fs::path(data_dir_) / "tenants";
  if (absl::Status s = storage::CreateDirsDurably(fs_, tenants); !s.ok()) return s;
  absl::StatusOr<std::vector<std::string>> tenant_names = fs_.ListDir(tenants);
  if (!tenant_names.ok()) return tenant_names.status();
  for (const std::string& tenant : *tenant_names) {
    const fs::path runs = tenants / tenant / "runs";
    if (!fs_.Exists(runs)) continue;
    absl::StatusOr<std::vector<std::string>> run_ids = fs_.ListDir(runs);
    if (!run_ids.ok()) return run_ids.status();
    for (const std::string& run_id : *run_ids) {
      for (const KindInfo& k : kKinds) {
        const CheckpointKind kind = k.kind;
        const fs::path parent = runs / run_id / KindDir(kind);
        if (!fs_.Exists(parent)) continue;
        absl::StatusOr<std::vector<std::string>> recovered = storage::RecoverDir(fs_, parent);
        if (!recovered.ok()) return recovered.status();
        for (const std::string& r : *recovered) changes.push_back(absl::StrCat((parent / r).string(), ": cleaned up"));
        absl::StatusOr<std::vector<std::string>> names = fs_.ListDir(parent);
        if (!names.ok()) return names.status();
        for (const std::string& name : *names) {
          if (!storage::ValidatePathName(name, "name").ok()) continue;  // not ours
          const fs::path dir = parent / name;
          const CheckpointPath path{run_id, kind, name};
          if (registry_.GetCheckpoint(tenant, run_id, path.checkpoint_id()).ok()) continue;
          absl::StatusOr<std::string> text = fs_.ReadFile(dir / storage::kMetadataFile);
          if (!text.ok()) continue;  // incomplete: never listed
          const json metadata = json::parse(*text, nullptr, false);
          if (metadata.is_discarded()) continue;
          int64_t size = 0;
          if (metadata.contains("files")) {
            for (const auto& [file, info] : metadata["files"].items()) size += info.value("size", int64_t{0});
          }
          if (!registry_.GetRun(tenant, run_id).ok()) {
            registry::RunRecord run;
            run.run_id = run_id;
            run.tenant = tenant;
            run.adapter_name = run_id;
            run.base_model = metadata.value("base_model", base_model_);
            run.lora_config_json = json{{"r", metadata.value("lora_rank", 0)}}.dump();
            run.created = run.last_request = absl::Now();
            (void)registry_.PutRun(run);
          }
          // Its creation time and expiry as its metadata recorded them (a TTL survives).
          registry::CheckpointRecord record{tenant, run_id, path.checkpoint_id(), CheckpointKindName(kind),
                                            dir.string(), size, MetadataTime(metadata, "created").value_or(absl::Now()),
                                            MetadataTime(metadata, "expires_at"), false};
          if (absl::Status s = registry_.PutCheckpoint(record); !s.ok()) return s;
          changes.push_back(absl::StrCat(dir.string(), ": registered (complete on disk, missing from the registry)"));
        }
      }
    }
  }
  absl::StatusOr<std::vector<registry::CheckpointRecord>> all = registry_.AllCheckpoints();
  if (!all.ok()) return all.status();
  for (const registry::CheckpointRecord& c : *all) {
    if (fs_.Exists(fs::path(c.path) / storage::kMetadataFile)) continue;
    if (absl::Status s = registry_.DeleteCheckpoint(c.tenant, c.run_id, c.checkpoint_id); !s.ok()) return s;
    changes.push_back(absl::StrCat(c.path, ": unregistered (directory gone or incomplete)"));
  }
  for (const std::string& change : changes) LogInfo(kLog, change);
  return changes;
}

absl::StatusOr<std::vector<std::string>> CheckpointStore::Reap() {
  std::vector<std::string> deleted;
  constexpr int32_t kBatch = 256;
  for (;;) {
    absl::StatusOr<std::vector<registry::CheckpointRecord>> expired = registry_.ExpiredCheckpoints(clock_.Now(), kBatch);
    if (!expired.ok()) return expired.status();
    for (const registry::CheckpointRecord& c : *expired) {
      if (absl::Status s = Delete(c.tenant, c.run_id, c.checkpoint_id); !s.ok() && !absl::IsNotFound(s)) return s;
      LogInfo(kLog, absl::StrCat("tenant ", c.tenant, ": checkpoint ", c.checkpoint_id, " of run ", c.run_id,
                                 " expired at ", Rfc3339(*c.expires), "; deleted"));
      deleted.push_back(absl::StrCat(c.run_id, "/", c.checkpoint_id));
    }
    if (expired->size() < static_cast<size_t>(kBatch)) return deleted;
  }
}

absl::Status CheckpointStore::SetTtl(const std::string& tenant, const std::string& run_id,
                                     const std::string& checkpoint_id, std::optional<int64_t> ttl_seconds) {
  if (ttl_seconds) {
    if (absl::Status s = ValidateTtl(*ttl_seconds, "ttl_seconds"); !s.ok()) return s;
  }
  std::optional<absl::Time> expires;
  if (ttl_seconds) expires = clock_.Now() + absl::Seconds(*ttl_seconds);
  absl::StatusOr<registry::CheckpointRecord> record = registry_.GetCheckpoint(tenant, run_id, checkpoint_id);
  if (!record.ok()) return record.status();
  if (!storage::IsInside(TenantRoot(tenant), record->path)) {
    return absl::InternalError(absl::StrCat("checkpoint ", checkpoint_id, " lies outside its tenant's root"));
  }
  // The metadata first: should the registry write fail, a re-registration from the directory
  // gets the new expiry, which is what the caller asked for.
  if (absl::Status s = storage::UpdateCheckpointMetadata(
          fs_, record->path, json{{"expires_at", expires ? json(Rfc3339(*expires)) : json(nullptr)}});
      !s.ok()) {
    return s;
  }
  return registry_.SetCheckpointExpiry(tenant, run_id, checkpoint_id, expires);
}

absl::StatusOr<json> CheckpointStore::ListFiles(const registry::CheckpointRecord& record) {
  if (!storage::IsInside(TenantRoot(record.tenant), record.path)) {
    return absl::InternalError(absl::StrCat("checkpoint ", record.checkpoint_id, " lies outside its tenant's root"));
  }
  absl::StatusOr<std::string> text = fs_.ReadFile(fs::path(record.path) / storage::kMetadataFile);
  if (!text.ok()) return text.status();
  const json metadata = json::parse(*text, nullptr, false);
  if (!metadata.is_object() || !metadata.contains("files") || !metadata["files"].is_object()) {
    return absl::DataLossError(absl::StrCat("checkpoint ", record.checkpoint_id, ": unreadable metadata"));
  }
  return metadata["files"];
}

absl::StatusOr<storage::StreamedFile> CheckpointStore::ListedFile(const registry::CheckpointRecord& record,
                                                                 const std::string& file) {
  absl::StatusOr<json> files = ListFiles(record);  // also: the directory lies in its tenant's root
  if (!files.ok()) return files.status();
  if (!storage::ValidatePathName(file, "file").ok() || !files->contains(file)) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", record.checkpoint_id, " has no file '", file, "'"));
  }
  const json& info = (*files)[file];
  return storage::StreamedFile{file, fs::path(record.path) / file, info.value("size", int64_t{-1}),
                               info.value("sha256", std::string())};
}

absl::StatusOr<std::string> CheckpointStore::ReadListedFile(const registry::CheckpointRecord& record,
                                                            const std::string& file) {
  absl::StatusOr<storage::StreamedFile> listed = ListedFile(record, file);
  if (!listed.ok()) return listed.status();
  absl::StatusOr<std::string> bytes = fs_.ReadFile(listed->path);
  if (!bytes.ok()) return bytes.status();
  if (static_cast<int64_t>(bytes->size()) != listed->size || storage::Sha256Hex(*bytes) != listed->sha256) {
    return absl::DataLossError(absl::StrCat("checkpoint ", record.checkpoint_id, ": file ", file,
                                            " does not match its recorded size and SHA-256"));
  }
  return bytes;
}

absl::StatusOr<int64_t> CheckpointStore::StorageBytes(const std::string& tenant) {
  return registry_.TenantStorageBytes(tenant);
}

absl::StatusOr<registry::CheckpointRecord> CheckpointStore::Copy(const std::string& tenant,
                                                                 const registry::CheckpointRecord& source,
                                                                 const std::string& dst_run_id, CheckpointKind kind,
                                                                 const std::string& name,
                                                                 std::optional<int64_t> ttl_seconds,
                                                                 const std::function<absl::Status()>& before_write) {
  if (absl::Status s = storage::ValidatePathName(name, "name"); !s.ok()) return s;
  if (!storage::IsInside(TenantRoot(source.tenant), source.path)) {
    return absl::InternalError(absl::StrCat("checkpoint ", source.checkpoint_id, " lies outside its tenant's root"));
  }
  absl::StatusOr<json> metadata = storage::VerifyCheckpointDir(fs_, source.path);
  if (!metadata.ok()) return metadata.status();
  std::vector<storage::FileContent> files;
  if (metadata->contains("files") && (*metadata)["files"].is_object()) {
    for (const auto& [file, info] : (*metadata)["files"].items()) {
      absl::StatusOr<std::string> bytes = fs_.ReadFile(fs::path(source.path) / file);
      if (!bytes.ok()) return bytes.status();
      files.push_back({file, *std::move(bytes)});
    }
  }
  json meta = *metadata;
  meta.erase("files");
  const CheckpointPath path{dst_run_id, kind, name};
  meta["tenant"] = tenant;
  meta["run_id"] = dst_run_id;
  meta["checkpoint_id"] = path.checkpoint_id();
  meta["checkpoint_type"] = CheckpointKindName(kind);
  meta["twinkle_path"] = path.uri();
  meta["created"] = Rfc3339(clock_.Now());
  meta["copied_from"] = absl::StrCat("twinkle://", source.run_id, "/", source.checkpoint_id);
  return WriteAndRecord(tenant, dst_run_id, kind, name, files, meta, ttl_seconds, before_write);
}

absl::StatusOr<registry::CheckpointRecord> CheckpointStore::WriteAdapter(
    const std::string& tenant, const std::string& run_id, CheckpointKind kind, const std::string& name,
    std::string safetensors, std::string adapter_config, std::optional<int64_t> ttl_seconds,
    const std::function<absl::Status()>& before_write) {
  if (absl::Status s = storage::ValidatePathName(name, "name"); !s.ok()) return s;
  if (absl::Status s = storage::ValidatePathName(run_id, "run_id"); !s.ok()) return s;
  std::vector<storage::FileContent> files;
  files.push_back({kAdapterWeights, std::move(safetensors)});
  files.push_back({kAdapterConfig, std::move(adapter_config)});
  const CheckpointPath path{run_id, kind, name};
  const json parsed = json::parse(files[1].bytes, nullptr, false);
  const json metadata{{"checkpoint_version", kCheckpointVersion},
                      {"base_model", base_model_},
                      {"tenant", tenant},
                      {"run_id", run_id},
                      {"checkpoint_id", path.checkpoint_id()},
                      {"checkpoint_type", CheckpointKindName(kind)},
                      {"twinkle_path", path.uri()},
                      {"is_lora", true},
                      {"lora_rank", parsed.is_object() ? parsed.value("r", 0) : 0},
                      {"has_optimizer", false},
                      {"imported", true},
                      {"created", Rfc3339(clock_.Now())}};
  return WriteAndRecord(tenant, run_id, kind, name, files, metadata, ttl_seconds, before_write);
}

// ---- PEFT import ------------------------------------------------------------------------------

absl::StatusOr<std::map<std::string, std::vector<int64_t>>> BaseWeightShapes(const std::string& model_dir) {
  std::map<std::string, std::vector<int64_t>> shapes;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(model_dir, ec)) {
    if (e.path().extension() != ".safetensors") continue;
    absl::StatusOr<std::unique_ptr<engine::SafetensorsFile>> file = engine::SafetensorsFile::Open(e.path());
    if (!file.ok()) return file.status();
    for (const engine::TensorInfo& t : (*file)->tensors()) shapes[t.name] = t.shape;
  }
  if (ec) return absl::FailedPreconditionError(absl::StrCat("reading model directory ", model_dir, ": ", ec.message()));
  if (shapes.empty()) return absl::FailedPreconditionError(absl::StrCat("no safetensors weights in ", model_dir));
  return shapes;
}

namespace {

constexpr char kPeftPrefix[] = "base_model.model.";

absl::Status BadImport(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("import: ", std::string(what)));
}

bool IsTargetKind(const std::string& kind) {
  for (absl::Span<const char* const> group : kKindGroups) {
    for (const char* k : group) if (kind == k) return true;
  }
  return kind == "lm_head";
}

// The base weight a module's LoRA wraps: "<module>.weight"; a tied lm_head is the embedding.
const std::vector<int64_t>* BaseShape(const std::map<std::string, std::vector<int64_t>>& base,
                                      const std::string& module) {
  if (auto it = base.find(module + ".weight"); it != base.end()) return &it->second;
  if (module == "lm_head") {
    for (const auto& [name, shape] : base) {
      if (absl::EndsWith(name, "embed_tokens.weight")) return &shape;
    }
  }
  return nullptr;
}

}  // namespace

absl::StatusOr<registry::CheckpointRecord> CheckpointStore::ImportPeftAdapter(
    const std::string& tenant, const std::string& run_id, const std::string& name, const std::string& safetensors,
    const json& config, const std::map<std::string, std::vector<int64_t>>& base, int64_t max_rank,
    std::optional<int64_t> ttl_seconds, const std::function<absl::Status(const LoraArgs&)>& before_write) {
  if (absl::Status s = storage::ValidatePathName(name, "name"); !s.ok()) return s;
  // The config.
  if (!config.is_object()) return BadImport("adapter_config: must be a JSON object");
  if (config.value("peft_type", std::string()) != "LORA") {
    return BadImport("adapter_config.peft_type: must be \"LORA\"");
  }
  if (!config.contains("r") || !config["r"].is_number_integer()) return BadImport("adapter_config.r: must be an integer");
  const int64_t rank = config["r"].get<int64_t>();
  if (rank < 1 || rank > max_rank) {
    return BadImport(absl::StrCat("adapter_config.r: ", rank, " is out of range (1 to ", max_rank, ")"));
  }
  const double alpha = config.contains("lora_alpha") && config["lora_alpha"].is_number()
                           ? config["lora_alpha"].get<double>() : 8.0;  // PEFT's default
  if (!(alpha > 0) || !std::isfinite(alpha)) return BadImport("adapter_config.lora_alpha: must be a positive number");
  const bool rslora = config.value("use_rslora", false);
  if (config.value("use_dora", false)) return BadImport("adapter_config.use_dora: DoRA adapters are not supported");
  if (config.value("bias", std::string("none")) != "none") return BadImport("adapter_config.bias: must be \"none\"");
  if (config.value("fan_in_fan_out", false)) return BadImport("adapter_config.fan_in_fan_out: must be false");
  for (const char* key : {"modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform"}) {
    if (config.contains(key) && !config[key].is_null() && !config[key].empty()) {
      return BadImport(absl::StrCat("adapter_config.", key, ": not supported (must be empty or null)"));
    }
  }
  // The tensors.
  const absl::Span<const uint8_t> span(reinterpret_cast<const uint8_t*>(safetensors.data()), safetensors.size());
  absl::StatusOr<std::vector<engine::TensorInfo>> tensors = engine::ParseSafetensorsHeader(span, "adapter_model.safetensors");
  if (!tensors.ok()) return BadImport(tensors.status().message());
  struct Pair {
    const engine::TensorInfo* a = nullptr;
    const engine::TensorInfo* b = nullptr;
  };
  std::map<std::string, Pair> modules;
  for (const engine::TensorInfo& t : *tensors) {
    absl::string_view rest = t.name;
    const bool is_a = absl::EndsWith(rest, ".lora_A.weight");
    if (!absl::ConsumePrefix(&rest, kPeftPrefix) || (!is_a && !absl::EndsWith(rest, ".lora_B.weight"))) {
      return BadImport(absl::StrCat("tensor '", t.name, "': not a LoRA weight (base_model.model.<module>.lora_A/B.weight)"));
    }
    rest.remove_suffix(std::string_view(".lora_A.weight").size());
    const std::string module(rest);
    if (!IsTargetKind(KindOf(module))) {
      return BadImport(absl::StrCat("tensor '", t.name, "': module kind '", KindOf(module),
                                    "' is not supported (q/k/v/o_proj, gate/up/down_proj, in_proj_qkv/z/b/a, out_proj, lm_head)"));
    }
    if (t.dtype != engine::SafetensorsDtype::kF32) {
      return BadImport(absl::StrCat("tensor '", t.name, "': dtype ", std::string(engine::SafetensorsDtypeName(t.dtype)),
                                    " (F32 is required)"));
    }
    const std::vector<int64_t>* shape = BaseShape(base, module);
    if (shape == nullptr || shape->size() != 2) {
      return BadImport(absl::StrCat("tensor '", t.name, "': the base model has no 2-D weight '", module, ".weight'"));
    }
    const std::vector<int64_t> want = is_a ? std::vector<int64_t>{rank, (*shape)[1]} : std::vector<int64_t>{(*shape)[0], rank};
    if (t.shape != want) {
      return BadImport(absl::StrCat("tensor '", t.name, "': shape [", absl::StrJoin(t.shape, ", "), "], expected [",
                                    absl::StrJoin(want, ", "), "] (r = ", rank, ", base weight [",
                                    absl::StrJoin(*shape, ", "), "])"));
    }
    (is_a ? modules[module].a : modules[module].b) = &t;
  }
  if (modules.empty()) return BadImport("adapter_model.safetensors holds no LoRA weights");
  // Exactly the base model's modules of the targeted kinds, whole groups.
  std::set<std::string> kinds;
  for (const auto& [module, pair] : modules) {
    if (pair.a == nullptr || pair.b == nullptr) {
      return BadImport(absl::StrCat("module '", module, "': lora_", pair.a == nullptr ? "A" : "B", " is missing"));
    }
    kinds.insert(KindOf(module));
  }
  auto group = [&](const auto& names) {
    bool any = false;
    for (const char* k : names) any = any || kinds.contains(k);
    if (any) for (const char* k : names) kinds.insert(k);
  };
  for (absl::Span<const char* const> names : kKindGroups) group(names);
  std::set<std::string> expected;
  for (const auto& [tensor, shape] : base) {
    if (!absl::EndsWith(tensor, ".weight") || shape.size() != 2) continue;
    const std::string module = tensor.substr(0, tensor.size() - std::string_view(".weight").size());
    // The text model's modules only: the engine never runs a vision tower or an MTP head.
    if (absl::StartsWith(module, "mtp.") || absl::StrContains(module, "visual.")) continue;
    if (kinds.contains(KindOf(module)) && KindOf(module) != "lm_head") expected.insert(module);
  }
  if (kinds.contains("lm_head")) expected.insert("lm_head");
  for (const std::string& module : expected) {
    if (!modules.contains(module)) return BadImport(absl::StrCat("module '", module, "' of the base model is missing"));
  }
  for (const auto& [module, pair] : modules) {
    if (!expected.contains(module)) return BadImport(absl::StrCat("module '", module, "' is not a module of the base model"));
  }
  // Re-serialised with our scale: B' = B · (their scale / ours).
  const double theirs = rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / static_cast<double>(rank);
  const double ours = kDefaultLoraAlpha / static_cast<double>(rank);
  const float factor = static_cast<float>(theirs / ours);
  std::map<std::string, storage::TensorBytes> out;
  for (const auto& [module, pair] : modules) {
    for (const engine::TensorInfo* t : {pair.a, pair.b}) {
      std::string bytes = safetensors.substr(t->file_offset, t->nbytes());
      if (t == pair.b && factor != 1.0f) {
        for (size_t i = 0; i + sizeof(float) <= bytes.size(); i += sizeof(float)) {
          float v;
          std::memcpy(&v, bytes.data() + i, sizeof v);
          v *= factor;
          std::memcpy(bytes.data() + i, &v, sizeof v);
        }
      }
      out[t->name] = storage::TensorBytes{"F32", t->shape, std::move(bytes)};
    }
  }
  absl::StatusOr<std::string> weights = storage::SerializeSafetensors(out, {{"format", "pt"}});
  if (!weights.ok()) return weights.status();
  LoraArgs lora;
  lora.rank = rank;
  lora.alpha = kDefaultLoraAlpha;
  lora.use_rslora = false;
  lora.targets.clear();
  for (absl::Span<const char* const> group : kKindGroups) {
    for (const char* k : group) if (kinds.contains(k)) lora.targets.push_back(k);
  }
  if (kinds.contains("lm_head")) lora.targets.push_back("lm_head");
  return WriteAdapter(tenant, run_id, CheckpointKind::kTraining, name, *std::move(weights),
                      PeftAdapterConfig(lora, base_model_).dump(2), ttl_seconds,
                      [&before_write, &lora] { return before_write(lora); });
}

}  // namespace twinkle::training
