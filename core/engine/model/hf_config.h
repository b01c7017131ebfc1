// Typed view of a Hugging Face model directory's config.json for the dense decoder family
// the engine implements (Llama, Qwen2, Qwen3). Parsing is strict on purpose: a config the
// engine would silently misread (an unknown architecture, a RoPE variant we do not
// implement, sliding-window attention) is rejected at load time with the file and key named,
// instead of producing a model that trains on wrong activations.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace twinkle::engine {

enum class RopeScalingType {
  kNone,    // Plain RoPE ("default" in transformers).
  kLinear,  // Positions divided by `factor`.
  kLlama3,  // Llama 3.x frequency-dependent scaling.
};

struct RopeScaling {
  RopeScalingType type = RopeScalingType::kNone;
  double factor = 1.0;
  // Only meaningful for kLlama3.
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct ModelConfig {
  std::string architecture;  // architectures[0], e.g. "LlamaForCausalLM".
  std::string model_type;    // "llama", "qwen2" or "qwen3".
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // Defaults to num_attention_heads (no GQA).
  int64_t head_dim = 0;             // Defaults to hidden_size / num_attention_heads.
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  int64_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  // q/k/v projections carry a bias (always for Qwen2; `attention_bias` for Llama/Qwen3).
  bool attention_bias = false;
  // o_proj carries a bias. Differs from attention_bias: Qwen2 has qkv bias but no o bias,
  // while Llama/Qwen3 put a bias on all four projections when attention_bias is set.
  bool o_proj_bias = false;
  // gate/up/down projections carry a bias (Llama's `mlp_bias`).
  bool mlp_bias = false;
  // Qwen3 applies an RMSNorm over head_dim to q and k before RoPE.
  bool qk_norm = false;
  // "torch_dtype" (transformers 4) or "dtype" (transformers 5); empty when absent.
  std::string torch_dtype;
};

// Reads and validates `model_dir`/config.json. Errors are InvalidArgument (NotFound when
// the file is missing) and name the file and offending key.
absl::StatusOr<ModelConfig> ReadModelConfig(const std::filesystem::path& model_dir);

// Same as ReadModelConfig but from JSON text; `name_for_errors` stands in for the path.
absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text,
                                             std::string_view name_for_errors);

// Every weight the checkpoint must contain, keyed by its HF name, with its shape.
// lm_head.weight is absent when the embeddings are tied.
std::map<std::string, std::vector<int64_t>> ExpectedWeightShapes(const ModelConfig& config);

}  // namespace twinkle::engine
