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
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/engine/model/hf_config.h"
#include "core/engine/model/safetensors.h"

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

// The weights of an HF model directory as stored, memory-mapped (model.safetensors, or the
// shards of model.safetensors.index.json, validated as LoadModel validates them) and not
// checked against the config: every tensor the checkpoint holds, vision towers and all.
// What merged export streams from, one tensor at a time.
class MappedWeights {
 public:
  static absl::StatusOr<MappedWeights> Open(const std::filesystem::path& dir);

  std::vector<std::string> names() const;  // sorted
  // nullptr when the checkpoint has no such tensor.
  const TensorInfo* Find(const std::string& name) const;
  // The tensor in its stored dtype, viewing the mapping: valid while *this lives.
  at::Tensor View(const std::string& name) const;
  // Drops the tensor's pages from this process (a later View reads them again from the
  // file), so streaming through a checkpoint does not accumulate it in memory.
  void Release(const std::string& name) const;

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, std::pair<const SafetensorsFile*, const TensorInfo*>> tensors_;
};

}  // namespace twinkle::engine
