#include "core/engine/model/loader.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <sys/mman.h>
#include <unistd.h>

#include <bit>
#include <cstring>
#include <exception>
#include <fstream>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "core/common/log.h"
#include "core/engine/model/safetensors.h"
#include "nlohmann/json.hpp"

namespace twinkle::engine {
namespace {

// safetensors stores little-endian bytes, which from_blob reinterprets as native.
static_assert(std::endian::native == std::endian::little, "big-endian hosts unsupported");

constexpr char kSingleFile[] = "model.safetensors";
constexpr char kIndexFile[] = "model.safetensors.index.json";
constexpr std::uintmax_t kMaxIndexBytes = 64u << 20;

// Where one weight's bytes live.
struct WeightSource {
  const SafetensorsFile* file = nullptr;
  const TensorInfo* info = nullptr;
};

struct OpenedCheckpoint {
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, WeightSource> weights;
};

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// The vision tower of a ConditionalGeneration checkpoint: not loaded (text only).
bool IsVisionWeight(const std::string& name, const ModelConfig& config) {
  return config.has_vision && absl::StartsWith(name, "model.visual.");
}

// Checkpoint entries that are not parameters of the model: transformers used to save the
// RoPE inverse-frequency buffer, tied checkpoints sometimes still carry lm_head, published
// Qwen3.5 checkpoints carry multi-token-prediction weights (mtp.*, which transformers
// ignores too), and ConditionalGeneration ones a vision tower.
bool IsIgnored(const std::string& name, const ModelConfig& config) {
  if (absl::EndsWith(name, "rotary_emb.inv_freq")) return true;
  if (config.hybrid() && absl::StartsWith(name, "mtp.")) return true;
  if (IsVisionWeight(name, config)) return true;
  return config.tie_word_embeddings && name == "lm_head.weight";
}

c10::ScalarType ToScalarType(SafetensorsDtype dtype) {
  switch (dtype) {
    case SafetensorsDtype::kF64:
      return c10::ScalarType::Double;
    case SafetensorsDtype::kF32:
      return c10::ScalarType::Float;
    case SafetensorsDtype::kF16:
      return c10::ScalarType::Half;
    case SafetensorsDtype::kBF16:
      return c10::ScalarType::BFloat16;
    case SafetensorsDtype::kI64:
      return c10::ScalarType::Long;
    case SafetensorsDtype::kI32:
      return c10::ScalarType::Int;
    case SafetensorsDtype::kI16:
      return c10::ScalarType::Short;
    case SafetensorsDtype::kI8:
      return c10::ScalarType::Char;
    case SafetensorsDtype::kU8:
      return c10::ScalarType::Byte;
    case SafetensorsDtype::kBool:
      return c10::ScalarType::Bool;
  }
  return c10::ScalarType::Undefined;
}

absl::Status OpenSingle(const std::filesystem::path& path, OpenedCheckpoint* out) {
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  if (!file.ok()) return file.status();
  for (const TensorInfo& info : (*file)->tensors()) {
    out->weights[info.name] = {file->get(), &info};
  }
  out->files.push_back(*std::move(file));
  return absl::OkStatus();
}

absl::Status OpenSharded(const std::filesystem::path& dir, const std::filesystem::path& index,
                         OpenedCheckpoint* out) {
  const std::string iname = index.string();
  auto invalid = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(iname, ": ", what));
  };
  std::error_code ec;
  const std::uintmax_t size = std::filesystem::file_size(index, ec);
  if (ec) return absl::InvalidArgumentError(absl::StrCat(iname, ": ", ec.message()));
  if (size > kMaxIndexBytes) return invalid("too large for an index");
  std::string text(static_cast<size_t>(size), '\0');
  std::ifstream in(index, std::ios::binary);
  in.read(text.data(), static_cast<std::streamsize>(size));
  if (!in || in.gcount() != static_cast<std::streamsize>(size)) return invalid("read failed");

  const nlohmann::json root = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) return invalid("not a JSON object");
  auto map_it = root.find("weight_map");
  if (map_it == root.end() || !map_it->is_object()) {
    return invalid("key 'weight_map' missing or not an object");
  }

  // weight name -> shard file name, validated before any shard is opened.
  std::map<std::string, std::string> weight_map;
  std::set<std::string> shards;
  for (const auto& [weight, shard] : map_it->items()) {
    if (!shard.is_string()) {
      return invalid(absl::StrCat("weight_map entry '", weight, "' is not a string"));
    }
    const std::string s = shard.get<std::string>();
    // Shards must sit beside the index: no paths, so an index cannot point elsewhere.
    if (s.empty() || s == "." || s == ".." || s.find('/') != std::string::npos ||
        s.find('\0') != std::string::npos) {
      return invalid(absl::StrCat("weight_map entry '", weight, "' names shard '", s,
                                  "', which is not a plain file name"));
    }
    weight_map[weight] = s;
    shards.insert(s);
  }

  for (const std::string& shard : shards) {
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(dir / shard);
    if (!file.ok()) return file.status();
    // Every tensor in a shard must be where the index says, or two shards could disagree.
    for (const TensorInfo& info : (*file)->tensors()) {
      auto it = weight_map.find(info.name);
      if (it == weight_map.end()) {
        return invalid(absl::StrCat("tensor '", info.name, "' is in shard '", shard,
                                    "' but not listed in weight_map"));
      }
      if (it->second != shard) {
        return invalid(absl::StrCat("tensor '", info.name, "' is in shard '", shard,
                                    "' but weight_map places it in '", it->second, "'"));
      }
      out->weights[info.name] = {file->get(), &info};
    }
    out->files.push_back(*std::move(file));
  }
  for (const auto& [weight, shard] : weight_map) {
    if (out->weights.count(weight) == 0) {
      return absl::InvalidArgumentError(absl::StrCat((dir / shard).string(), ": weight '", weight,
                                                     "' is listed in ", kIndexFile,
                                                     " but missing from this shard"));
    }
  }
  return absl::OkStatus();
}

// The weights files of `dir`, with transformers' precedence: a single file wins over an index.
absl::Status OpenCheckpoint(const std::filesystem::path& dir, OpenedCheckpoint* out) {
  std::error_code ec;
  if (std::filesystem::is_regular_file(dir / kSingleFile, ec)) return OpenSingle(dir / kSingleFile, out);
  if (std::filesystem::is_regular_file(dir / kIndexFile, ec)) return OpenSharded(dir, dir / kIndexFile, out);
  return absl::NotFoundError(absl::StrCat(dir.string(), ": neither ", kSingleFile, " nor ", kIndexFile, " found"));
}

// Whether the checkpoint stores MoE experts one module per expert (as transformers saves
// and Qwen publishes them) rather than fused.
bool PerExpertLayout(const ModelConfig& config, const OpenedCheckpoint& ckpt) {
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    if (!config.is_moe_layer(i)) continue;
    return ckpt.weights.count(
               absl::StrCat(config.text_prefix, "layers.", i, ".mlp.experts.0.gate_proj.weight")) > 0;
  }
  return false;
}

// Per-expert weights become the fused layout the engine computes with:
// mlp.experts.gate_up_proj [E, 2I, H] (gate rows, then up rows) and mlp.experts.down_proj
// [E, H, I], as transformers' Qwen3MoeExperts holds them.
void FuseExperts(const ModelConfig& config, std::map<std::string, at::Tensor>& weights) {
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    if (!config.is_moe_layer(i)) continue;
    const std::string p = absl::StrCat("model.layers.", i, ".mlp.experts.");
    std::vector<at::Tensor> gate_up, down;
    for (int64_t e = 0; e < config.num_experts; ++e) {
      const std::string x = absl::StrCat(p, e, ".");
      auto take = [&](const std::string& name) {
        auto node = weights.extract(x + name);
        return node.mapped();
      };
      const at::Tensor g = take("gate_proj.weight"), u = take("up_proj.weight");
      gate_up.push_back(at::cat({g, u}, 0));
      down.push_back(take("down_proj.weight"));
    }
    weights[p + "gate_up_proj"] = at::stack(gate_up, 0);
    weights[p + "down_proj"] = at::stack(down, 0);
  }
}

// Compares the checkpoint's tensors with what the config implies, before any copy.
absl::Status CheckWeights(const std::filesystem::path& dir, const ModelConfig& config,
                          const OpenedCheckpoint& ckpt) {
  const std::map<std::string, std::vector<int64_t>> expected =
      ExpectedWeightShapes(config, PerExpertLayout(config, ckpt));
  std::vector<std::string> missing;
  for (const auto& [name, shape] : expected) {
    auto it = ckpt.weights.find(name);
    if (it == ckpt.weights.end()) {
      missing.push_back(name);
      continue;
    }
    const TensorInfo& info = *it->second.info;
    if (info.shape != shape) {
      return absl::InvalidArgumentError(
          absl::StrCat(it->second.file->path().string(), ": weight '", name, "' has shape ",
                       ShapeString(info.shape), " but config.json implies ", ShapeString(shape)));
    }
    if (!IsFloatingPoint(info.dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat(it->second.file->path().string(), ": weight '", name, "' has dtype ",
                       std::string(SafetensorsDtypeName(info.dtype)),
                       "; only floating-point weights can be loaded"));
    }
  }
  if (!missing.empty()) {
    const std::vector<int64_t>& shape = expected.at(missing.front());
    std::string more;
    if (missing.size() > 1) more = absl::StrCat(" (and ", missing.size() - 1, " more)");
    return absl::InvalidArgumentError(absl::StrCat(dir.string(), ": missing weight '",
                                                   missing.front(), "' of shape ",
                                                   ShapeString(shape), more));
  }
  for (const auto& [name, source] : ckpt.weights) {
    if (expected.count(name) == 0 && !IsIgnored(name, config)) {
      return absl::InvalidArgumentError(
          absl::StrCat(source.file->path().string(), ": unexpected weight '", name, "' of shape ",
                       ShapeString(source.info->shape), " for ", config.architecture));
    }
  }
  return absl::OkStatus();
}

// Copies one tensor out of the mapping into an owning tensor of `dtype` on `device`.
at::Tensor CopyWeight(const WeightSource& source, c10::ScalarType dtype, c10::Device device) {
  const TensorInfo& info = *source.info;
  const absl::Span<const uint8_t> bytes = source.file->Data(info);
  const c10::ScalarType file_type = ToScalarType(info.dtype);
  const auto address = reinterpret_cast<uintptr_t>(bytes.data());
  if (address % SafetensorsDtypeSize(info.dtype) == 0) {
    // from_blob only views the read-only mapping; copy=true guarantees .to() never returns
    // that view even when dtype and device already match.
    at::Tensor view = at::from_blob(const_cast<uint8_t*>(bytes.data()), info.shape,
                                    at::TensorOptions().dtype(file_type));
    return view.to(device, dtype, /*non_blocking=*/false, /*copy=*/true);
  }
  // The format does not promise alignment (headers are usually padded to 8, not always);
  // typed kernels must not read misaligned data, so stage through an aligned buffer.
  at::Tensor staged = at::empty(info.shape, at::TensorOptions().dtype(file_type));
  if (!bytes.empty()) std::memcpy(staged.data_ptr(), bytes.data(), bytes.size());
  return staged.to(device, dtype);
}

absl::StatusOr<LoadedModel> LoadModelImpl(const std::filesystem::path& dir, c10::ScalarType dtype,
                                          c10::Device device) {
  if (!c10::isFloatingType(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("LoadModel: dtype ", c10::toString(dtype), " is not floating-point"));
  }
  absl::StatusOr<ModelConfig> config = ReadModelConfig(dir);
  if (!config.ok()) return config.status();

  OpenedCheckpoint ckpt;
  if (absl::Status s = OpenCheckpoint(dir, &ckpt); !s.ok()) return s;
  if (absl::Status s = CheckWeights(dir, *config, ckpt); !s.ok()) return s;

  LoadedModel model;
  model.config = *std::move(config);
  int64_t vision_tensors = 0;
  const std::string& prefix = model.config.text_prefix;
  for (const auto& [name, source] : ckpt.weights) {
    if (IsVisionWeight(name, model.config)) ++vision_tensors;
    if (IsIgnored(name, model.config)) continue;
    at::Tensor t = CopyWeight(source, dtype, device);
    model.parameter_count += t.numel();
    // The text model's weights are handed over under "model." whatever the checkpoint's
    // prefix ("model.language_model." in ConditionalGeneration checkpoints).
    std::string key = name;
    if (prefix != "model." && absl::StartsWith(name, prefix)) {
      key = "model." + name.substr(prefix.size());
    }
    model.weights.emplace(std::move(key), std::move(t));
  }
  if (PerExpertLayout(model.config, ckpt)) FuseExperts(model.config, model.weights);
  if (model.config.has_vision) {
    LogInfo("engine", absl::StrCat(dir.string(), ": ", model.config.architecture,
                                   ": loading the language model only; the vision tower (",
                                   vision_tensors, " tensors under model.visual.) is skipped "
                                   "and image inputs are not supported"));
  }
  return model;
}

// LibTorch messages can run to pages (dispatcher tables); a Status becomes one log line.
std::string FirstLine(const char* what) {
  std::string msg(what);
  msg = msg.substr(0, msg.find('\n'));
  constexpr size_t kMaxLength = 500;
  if (msg.size() > kMaxLength) msg = msg.substr(0, kMaxLength) + "...";
  return msg;
}

// Weight names come from the checkpoint (JSON escapes allow any control character); keep
// every error one printable log line. The safetensors parser does the same for its errors.
absl::Status OneLine(const absl::Status& status) {
  if (status.ok()) return status;
  std::string msg(status.message());
  for (char& c : msg) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  }
  return absl::Status(status.code(), msg);
}

}  // namespace

absl::StatusOr<LoadedModel> LoadModel(const std::filesystem::path& dir, c10::ScalarType dtype,
                                      c10::Device device) {
  // The engine's boundary with LibTorch: nothing thrown below may escape to the caller.
  try {
    absl::StatusOr<LoadedModel> model = LoadModelImpl(dir, dtype, device);
    if (!model.ok()) return OneLine(model.status());
    return model;
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat(
        dir.string(), ": LibTorch error while loading: ", FirstLine(e.what_without_backtrace())));
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat(dir.string(), ": error while loading: ", FirstLine(e.what())));
  }
}

absl::StatusOr<MappedWeights> MappedWeights::Open(const std::filesystem::path& dir) {
  OpenedCheckpoint ckpt;
  if (absl::Status s = OpenCheckpoint(dir, &ckpt); !s.ok()) return s;
  MappedWeights out;
  out.files_ = std::move(ckpt.files);
  for (const auto& [name, source] : ckpt.weights) out.tensors_[name] = {source.file, source.info};
  return out;
}

void MappedWeights::Release(const std::string& name) const {
  const auto& [file, info] = tensors_.at(name);
  const absl::Span<const uint8_t> bytes = file->Data(*info);
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  // Whole pages inside the tensor only: its neighbours' pages stay.
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(bytes.data()) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(bytes.data()) + bytes.size()) / page * page;
  if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

std::vector<std::string> MappedWeights::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& [name, source] : tensors_) out.push_back(name);
  return out;
}

const TensorInfo* MappedWeights::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : it->second.second;
}

at::Tensor MappedWeights::View(const std::string& name) const {
  const auto& [file, info] = tensors_.at(name);
  const absl::Span<const uint8_t> bytes = file->Data(*info);
  return at::from_blob(const_cast<uint8_t*>(bytes.data()), info->shape,
                       at::TensorOptions().dtype(ToScalarType(info->dtype)));
}

}  // namespace twinkle::engine

