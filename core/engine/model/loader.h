// Loads an HF model directory (config.json + model.safetensors or a sharded
// model.safetensors.index.json) into owning tensors of the requested dtype and device.
// The set of weights is checked against the config before any byte is copied, so a
// checkpoint that does not match its config fails fast and names the weight.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "core/engine/model/hf_config.h"

namespace twinkle::engine {

struct LoadedModel {
  ModelConfig config;
  // Keyed by HF name (see ExpectedWeightShapes), the text model's weights under "model."
  // whatever the checkpoint's prefix; each tensor owns its memory, independent of the
  // files, which are unmapped when LoadModel returns. Vision towers and mtp.* are skipped.
  std::map<std::string, at::Tensor> weights;
  int64_t parameter_count = 0;
};

// Never throws: LibTorch errors are returned as InternalError. Malformed or mismatched
// checkpoints are InvalidArgument/DataLoss naming the file and weight; a missing
// config.json or weights file is NotFound.
absl::StatusOr<LoadedModel> LoadModel(const std::filesystem::path& dir, c10::ScalarType dtype,
                                      c10::Device device);

}  // namespace twinkle::engine
