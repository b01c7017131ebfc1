#include "core/engine/export.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "core/engine/model/loader.h"
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
    "generation_config.json"};

// LoadModel hands the text model's weights over under "model.", whatever the checkpoint's
// prefix.
std::string HfLinearName(const ModelConfig& config, int64_t layer, LinearKind kind) {
  ModelConfig loaded = config;
  loaded.text_prefix = "model.";
  return LinearModulePath(loaded, layer, kind) + ".weight";
}

absl::StatusOr<std::string> ReadWhole(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path.string()));
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

absl::StatusOr<ExportResult> ExportMergedModel(const Adapter& adapter, const fs::path& model_dir,
                                               const fs::path& parent, const std::string& name) {
  c10::NoGradGuard no_grad;
  absl::StatusOr<LoadedModel> base = LoadModel(model_dir, at::kFloat, c10::Device(c10::kCPU));
  if (!base.ok()) return base.status();
  std::map<std::string, at::Tensor>& weights = base->weights;
  const ModelConfig& config = base->config;
  if (config.has_vision) {
    // The merged model would have to be written back as the ConditionalGeneration
    // checkpoint, vision tower included, which LoadModel does not keep.
    return absl::UnimplementedError(absl::StrCat("exporting a merged ", config.architecture,
                                                 " model is not supported yet"));
  }
  const bool untie = config.tie_word_embeddings && adapter.targets(LinearKind::kLmHead);
  if (untie) weights["lm_head.weight"] = weights.at("model.embed_tokens.weight").clone();

  for (LinearKind kind : {LinearKind::kQ, LinearKind::kK, LinearKind::kV, LinearKind::kO, LinearKind::kGate,
                          LinearKind::kUp, LinearKind::kDown, LinearKind::kLmHead, LinearKind::kInProjQkv,
                          LinearKind::kInProjZ, LinearKind::kInProjB, LinearKind::kInProjA,
                          LinearKind::kOutProj}) {
    if (!adapter.targets(kind)) continue;
    const int64_t layers = kind == LinearKind::kLmHead ? 1 : config.num_hidden_layers;
    for (int64_t layer = 0; layer < layers; ++layer) {
      if (!adapter.a(layer, kind).defined()) continue;  // a hybrid layer without this linear
      const std::string hf = HfLinearName(config, layer, kind);
      auto it = weights.find(hf);
      if (it == weights.end()) return absl::InternalError(absl::StrCat("base model has no weight ", hf));
      // W [out, in] += scale · B [out, r] · A [r, in], in fp32 as PEFT's merge does.
      const at::Tensor a = adapter.a(layer, kind).detach().to(at::kCPU, at::kFloat);
      const at::Tensor b = adapter.b(layer, kind).detach().to(at::kCPU, at::kFloat);
      it->second = it->second + at::mm(b, a) * adapter.scale();
    }
  }

  std::map<std::string, storage::TensorBytes> tensors;
  int64_t total = 0;
  for (auto& [tensor_name, t] : weights) {
    const at::Tensor c = t.contiguous();
    storage::TensorBytes bytes;
    bytes.dtype = "F32";
    bytes.shape.assign(c.sizes().begin(), c.sizes().end());
    bytes.bytes.assign(static_cast<const char*>(c.data_ptr()), c.nbytes());
    total += static_cast<int64_t>(c.nbytes());
    tensors.emplace(tensor_name, std::move(bytes));
  }
  absl::StatusOr<std::string> model = storage::SerializeSafetensors(tensors, {{"format", "pt"}});
  if (!model.ok()) return model.status();
  weights.clear();

  std::vector<storage::FileContent> files;
  files.push_back({"model.safetensors", *std::move(model)});
  absl::StatusOr<std::string> config_text = ReadWhole(model_dir / "config.json");
  if (!config_text.ok()) return config_text.status();
  nlohmann::json config_json = nlohmann::json::parse(*config_text, nullptr, false);
  if (config_json.is_discarded()) return absl::DataLossError("config.json of the base model is not JSON");
  if (untie) config_json["tie_word_embeddings"] = false;
  config_json["torch_dtype"] = "float32";
  if (config_json.contains("dtype")) config_json["dtype"] = "float32";
  files.push_back({"config.json", config_json.dump(2)});
  for (const char* side : kSideFiles) {
    if (!fs::exists(model_dir / side)) continue;
    absl::StatusOr<std::string> text = ReadWhole(model_dir / side);
    if (!text.ok()) return text.status();
    files.push_back({side, *std::move(text)});
  }
  const nlohmann::json metadata = {{"kind", "merged_model"},
                                   {"adapter_rank", adapter.config().rank},
                                   {"untied_lm_head", untie}};
  absl::StatusOr<fs::path> dir =
      storage::WriteCheckpointDir(storage::RealFileSystem(), parent, name, files, metadata);
  if (!dir.ok()) return dir.status();
  int64_t bytes = 0;
  for (const storage::FileContent& f : files) bytes += static_cast<int64_t>(f.bytes.size());
  (void)total;
  return ExportResult{dir->string(), bytes};
}

}  // namespace twinkle::engine
