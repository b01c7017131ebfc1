#pragma once
// Merged export: a saved adapter folded into the base weights (W' = W + scale · B · A for
// every linear it targets), written as a complete HF model directory that transformers and
// vLLM load like any other model: model.safetensors, config.json (tie_word_embeddings turned
// off when the adapter changed a tied lm_head), and the tokenizer and generation files copied.
// Written atomically through core/storage (temp dir, fsync, metadata last, rename).
//
// It streams: the base checkpoint is memory-mapped and each tensor is converted, merged and
// written on its own, so the peak is about one tensor in fp32 (plus the adapter), whatever
// the model's size. It runs in a process of its own (`twinkle-engine export`, started by the
// coordinator), never in a device worker: the device keeps training meanwhile.

#include <filesystem>
#include <string>

#include "absl/status/statusor.h"

namespace twinkle::engine {

struct ExportRequest {
  std::filesystem::path model_dir;    // the base model's HF folder
  std::filesystem::path adapter_dir;  // a PEFT adapter: adapter_model.safetensors + adapter_config.json
  std::filesystem::path parent;       // as storage::WriteCheckpointDir takes them
  std::string name;
};

struct ExportResult {
  std::string path;
  int64_t bytes = 0;
};

// Every tensor of the base checkpoint is written (floating-point ones as float32, merged in
// fp32 as PEFT's merge does; others unchanged), vision towers included. Errors name the file
// and tensor: an adapter tensor with no base weight or a shape that does not fit is
// FailedPrecondition; unreadable files keep their loader codes.
absl::StatusOr<ExportResult> ExportMergedModel(const ExportRequest& request);

}  // namespace twinkle::engine
