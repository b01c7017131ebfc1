#pragma once
// Merged export: an adapter folded into the base weights (W' = W + scale · B · A for every
// linear it targets), written as a complete HF model directory that transformers and vLLM
// load like any other model: model.safetensors, config.json (tie_word_embeddings turned off
// when the adapter changed a tied lm_head), and the tokenizer and generation files copied.
// Written atomically through core/storage (temp dir, fsync, metadata last, rename).

#include <filesystem>
#include <string>

#include "absl/status/statusor.h"
#include "core/engine/lora/adapter.h"

namespace twinkle::engine {

struct ExportResult {
  std::string path;
  int64_t bytes = 0;
};

// Re-reads the base weights from `model_dir` (so the serving copy stays untouched), merges in
// fp32 and writes float32 tensors. `parent`/`name` as storage::WriteCheckpointDir takes them.
absl::StatusOr<ExportResult> ExportMergedModel(const Adapter& adapter, const std::filesystem::path& model_dir,
                                               const std::filesystem::path& parent, const std::string& name);

}  // namespace twinkle::engine
