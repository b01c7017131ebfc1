#include "core/engine/export.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <exception>
#include <fstream>
#include <map>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/engine/model/hf_config.h"
#include "core/engine/model/loader.h"
#include "core/engine/model/safetensors.h"
#include "core/storage/checkpoint_dir.h"
#include "core/storage/filesystem.h"
#include "core/storage/safetensors_writer.h"

namespace twinkle::engine {
namespace {

namespace fs = std::filesystem;

// Copied as they are when present: what tokenizers and generation need next to the weights.
constexpr const char* kSideFiles[] = {
    "tokenizer.json",    "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json",        "merges.txt",            "tokenizer.model",         "chat_template.jinja",
    "generation_config.json", "preprocessor_config.json", "video_preprocessor_config.json"};

// PEFT's names: base_model.model.<module>.lora_A.weight / .lora_B.weight.
constexpr char kPeftPrefix[] = "base_model.model.";
constexpr char kLoraA[] = ".lora_A.weight";
constexpr char kLoraB[] = ".lora_B.weight";

absl::StatusOr<std::string> ReadWhole(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path.string()));
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string ShapeString(c10::IntArrayRef shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

struct LoraPair {
  at::Tensor a;  // [r, in], fp32, owning
  at::Tensor b;  // [out, r]
};

struct Adapter {
  double scale = 1;
  // By the base weight each pair changes ("<module>.weight").
  std::map<std::string, LoraPair> pairs;
};

absl::StatusOr<Adapter> ReadAdapter(const fs::path& dir) {
  absl::StatusOr<std::string> config_text = ReadWhole(dir / "adapter_config.json");
  if (!config_text.ok()) return config_text.status();
  const nlohmann::json config = nlohmann::json::parse(*config_text, nullptr, false);
  if (config.is_discarded() || !config.is_object() || !config.contains("r") || !config.contains("lora_alpha") ||
      !config["r"].is_number() || !config["lora_alpha"].is_number() || config["r"].get<double>() <= 0) {
    return absl::DataLossError(absl::StrCat((dir / "adapter_config.json").string(),
                                            ": not a PEFT LoRA config (r, lora_alpha)"));
  }
  const double rank = config["r"].get<double>();
  const double alpha = config["lora_alpha"].get<double>();
  const bool rslora = config.value("use_rslora", false);
  Adapter adapter;
  adapter.scale = rslora ? alpha / std::sqrt(rank) : alpha / rank;

  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(dir / "adapter_model.safetensors");
  if (!file.ok()) return file.status();
  auto tensor = [&](const TensorInfo& info) {
    const absl::Span<const uint8_t> bytes = (*file)->Data(info);
    at::ScalarType type = at::kFloat;
    if (info.dtype == SafetensorsDtype::kBF16) type = at::kBFloat16;
    if (info.dtype == SafetensorsDtype::kF16) type = at::kHalf;
    if (info.dtype == SafetensorsDtype::kF64) type = at::kDouble;
    return at::from_blob(const_cast<uint8_t*>(bytes.data()), info.shape, at::TensorOptions().dtype(type))
        .to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  };
  for (const TensorInfo& info : (*file)->tensors()) {
    if (!IsFloatingPoint(info.dtype) || info.shape.size() != 2) {
      return absl::DataLossError(absl::StrCat("adapter tensor '", info.name, "' is not a 2-D float matrix"));
    }
    const bool is_a = absl::EndsWith(info.name, kLoraA);
    if (!absl::StartsWith(info.name, kPeftPrefix) || (!is_a && !absl::EndsWith(info.name, kLoraB))) {
      return absl::DataLossError(absl::StrCat("adapter tensor '", info.name,
                                              "' is not a PEFT LoRA weight (base_model.model.<module>.lora_A/B.weight)"));
    }
    const size_t suffix = is_a ? sizeof(kLoraA) - 1 : sizeof(kLoraB) - 1;
    const std::string module =
        info.name.substr(sizeof(kPeftPrefix) - 1, info.name.size() - suffix - (sizeof(kPeftPrefix) - 1));
    LoraPair& pair = adapter.pairs[module + ".weight"];
    (is_a ? pair.a : pair.b) = tensor(info);
  }
  for (const auto& [weight, pair] : adapter.pairs) {
    if (!pair.a.defined() || !pair.b.defined()) {
      return absl::DataLossError(absl::StrCat("adapter: ", weight, " has only one of lora_A and lora_B"));
    }
    if (pair.a.size(0) != pair.b.size(1)) {
      return absl::DataLossError(absl::StrCat("adapter: ", weight, ": lora_A ", ShapeString(pair.a.sizes()),
                                              " and lora_B ", ShapeString(pair.b.sizes()), " disagree on the rank"));
    }
  }
  return adapter;
}

std::string StoredDtypeName(SafetensorsDtype dtype) {
  return IsFloatingPoint(dtype) ? "F32" : std::string(SafetensorsDtypeName(dtype));
}

absl::StatusOr<ExportResult> Export(const ExportRequest& request) {
  c10::NoGradGuard no_grad;
  absl::StatusOr<ModelConfig> config = ReadModelConfig(request.model_dir);
  if (!config.ok()) return config.status();
  absl::StatusOr<MappedWeights> base = MappedWeights::Open(request.model_dir);
  if (!base.ok()) return base.status();
  absl::StatusOr<Adapter> adapter = ReadAdapter(request.adapter_dir);
  if (!adapter.ok()) return adapter.status();

  // What each output tensor is made of: a base tensor, plus a LoRA delta where targeted. A
  // tied lm_head the adapter changes becomes a tensor of its own, from the embedding.
  std::map<std::string, std::string> source_of;  // output name -> base tensor name
  for (const std::string& name : base->names()) source_of[name] = name;
  const std::string embed = config->text_prefix + "embed_tokens.weight";
  bool untie = false;
  for (const auto& [weight, pair] : adapter->pairs) {
    if (absl::EndsWith(weight, ".mlp.experts.weight") || absl::EndsWith(weight, ".mlp.experts.base_layer.weight")) {
      return absl::UnimplementedError(absl::StrCat(
          "the adapter has LoRA on the MoE experts (", weight.substr(0, weight.size() - 7),
          ", PEFT target_parameters), which merged export does not support yet; the adapter "
          "checkpoint itself loads in PEFT"));
    }
    if (source_of.count(weight) == 0) {
      if (weight == "lm_head.weight" && config->tie_word_embeddings && base->Find(embed) != nullptr) {
        source_of[weight] = embed;
        untie = true;
      } else {
        return absl::FailedPreconditionError(absl::StrCat("the adapter changes ", weight,
                                                          ", which the base model does not have"));
      }
    }
    const TensorInfo& info = *base->Find(source_of[weight]);
    if (info.shape.size() != 2 || info.shape[0] != pair.b.size(0) || info.shape[1] != pair.a.size(1)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the adapter's ", weight, " (lora_B ", ShapeString(pair.b.sizes()), ", lora_A ", ShapeString(pair.a.sizes()),
          ") does not fit the base weight of shape ", ShapeString(info.shape)));
    }
  }

  std::map<std::string, storage::TensorSpec> specs;
  for (const auto& [name, source] : source_of) {
    const TensorInfo& info = *base->Find(source);
    specs[name] = {StoredDtypeName(info.dtype), info.shape};
  }
  absl::StatusOr<storage::SafetensorsLayout> layout = storage::PlanSafetensors(specs, {{"format", "pt"}});
  if (!layout.ok()) return layout.status();

  // One tensor at a time: convert (floats to fp32), add scale · B · A in fp32, write, free.
  auto write_weights = [&](const storage::AppendFn& append) -> absl::Status {
    if (absl::Status s = append(layout->prefix); !s.ok()) return s;
    for (const storage::SafetensorsLayout::Slot& slot : layout->order) {
      const std::string& source = source_of.at(slot.name);
      auto pair = adapter->pairs.find(slot.name);
      const bool merge = pair != adapter->pairs.end();
      at::Tensor t = base->View(source);  // read-only memory: merged tensors get a copy
      if (at::isFloatingType(t.scalar_type())) t = t.to(at::kFloat, /*non_blocking=*/false, /*copy=*/merge);
      if (merge) t.addmm_(pair->second.b, pair->second.a, /*beta=*/1, /*alpha=*/adapter->scale);
      t = t.contiguous();
      if (static_cast<uint64_t>(t.nbytes()) != slot.nbytes) {
        return absl::InternalError(absl::StrCat("export: ", slot.name, " came out as ", t.nbytes(), " bytes, not ",
                                                slot.nbytes));
      }
      if (absl::Status s = append(absl::string_view(static_cast<const char*>(t.data_ptr()), t.nbytes())); !s.ok()) {
        return s;
      }
      t = at::Tensor();
      base->Release(source);
    }
    return absl::OkStatus();
  };

  std::vector<storage::FileContent> files;
  storage::FileContent weights_file;
  weights_file.name = "model.safetensors";
  weights_file.stream = write_weights;
  files.push_back(std::move(weights_file));
  absl::StatusOr<std::string> config_text = ReadWhole(request.model_dir / "config.json");
  if (!config_text.ok()) return config_text.status();
  nlohmann::json config_json = nlohmann::json::parse(*config_text, nullptr, false);
  if (config_json.is_discarded()) return absl::DataLossError("config.json of the base model is not JSON");
  if (untie) {
    config_json["tie_word_embeddings"] = false;
    if (config_json.contains("text_config")) config_json["text_config"]["tie_word_embeddings"] = false;
  }
  config_json["torch_dtype"] = "float32";
  if (config_json.contains("dtype")) config_json["dtype"] = "float32";
  if (config_json.contains("text_config") && config_json["text_config"].contains("dtype")) {
    config_json["text_config"]["dtype"] = "float32";
  }
  files.push_back({"config.json", config_json.dump(2), {}});
  for (const char* side : kSideFiles) {
    if (!fs::exists(request.model_dir / side)) continue;
    absl::StatusOr<std::string> text = ReadWhole(request.model_dir / side);
    if (!text.ok()) return text.status();
    files.push_back({side, *std::move(text), {}});
  }
  int64_t lora_rank = 0;
  if (!adapter->pairs.empty()) lora_rank = adapter->pairs.begin()->second.a.size(0);
  const nlohmann::json metadata = {{"kind", "merged_model"}, {"adapter_rank", lora_rank}, {"untied_lm_head", untie}};
  absl::StatusOr<fs::path> dir =
      storage::WriteCheckpointDir(storage::RealFileSystem(), request.parent, request.name, files, metadata);
  if (!dir.ok()) return dir.status();
  int64_t bytes = static_cast<int64_t>(layout->file_size);
  for (const storage::FileContent& f : files) bytes += static_cast<int64_t>(f.bytes.size());
  return ExportResult{dir->string(), bytes};
}

}  // namespace

absl::StatusOr<ExportResult> ExportMergedModel(const ExportRequest& request) {
  try {
    return Export(request);
  } catch (const std::exception& e) {  // LibTorch's, at the engine edge
    return absl::InternalError(absl::StrCat("export: ", e.what()));
  }
}

}  // namespace twinkle::engine
