// Typed view of a Hugging Face model directory's config.json for the decoder families the
// engine implements: the dense family (Llama, Qwen2, Qwen3) and the Qwen3.5 hybrid (Gated
// DeltaNet linear-attention layers interleaved with gated full attention). Parsing is strict on purpose: a config the
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
  // "llama", "qwen2", "qwen3", "qwen3_5_text"; for Qwen3_5ForConditionalGeneration the
  // text model's ("qwen3_5_text"), whose settings are read from config.json's text_config.
  std::string model_type;
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

  // ---- Qwen3.5 (hybrid) ----
  // Per layer: true = Gated DeltaNet (linear attention), false = full attention. Empty for
  // the dense family (every layer full attention). From `layer_types`, or from
  // `full_attention_interval` (default 4) as transformers derives it.
  std::vector<bool> linear_layers;
  int64_t linear_conv_kernel = 0;  // linear_conv_kernel_dim
  int64_t linear_num_key_heads = 0;
  int64_t linear_num_value_heads = 0;
  int64_t linear_key_head_dim = 0;
  int64_t linear_value_head_dim = 0;
  // Only the first head_dim * partial_rotary_factor dims of a head are rotated.
  double partial_rotary_factor = 1.0;
  // q_proj emits [query | gate] per head; the attention output is scaled by sigmoid(gate).
  bool attn_output_gate = false;
  // RMSNorms scale by (1 + w) (the gated norm inside the DeltaNet block excepted).
  bool zero_centered_norm = false;
  // Where the text model's weights live in the checkpoint: "model." for CausalLM
  // checkpoints, "model.language_model." for ConditionalGeneration ones. The loader hands
  // the weights over under "model." whatever the checkpoint says.
  std::string text_prefix = "model.";
  // ConditionalGeneration checkpoint: a vision tower (model.visual.*) the engine skips.
  bool has_vision = false;

  // ---- Mixture of experts (Qwen3-MoE) ----
  // Per layer: a sparse MoE block (router + experts) instead of the dense MLP. Empty for
  // models without experts. From decoder_sparse_step and mlp_only_layers, as transformers.
  std::vector<bool> moe_layers;
  int64_t num_experts = 0;            // num_experts or num_local_experts
  int64_t experts_per_token = 0;      // num_experts_per_tok (top-k)
  int64_t moe_intermediate_size = 0;  // each expert's SwiGLU width
  bool norm_topk_prob = false;        // renormalise the top-k routing weights to sum 1
  // Qwen3.5-MoE: a shared expert (SwiGLU of this width) every token goes through, scaled by
  // sigmoid(shared_expert_gate(x)) and added to the routed experts' output. 0 = none.
  int64_t shared_expert_intermediate_size = 0;

  bool is_moe_layer(int64_t layer) const {
    return !moe_layers.empty() && moe_layers[static_cast<size_t>(layer)];
  }
  bool hybrid() const { return !linear_layers.empty(); }
  bool is_linear_layer(int64_t layer) const {
    return hybrid() && linear_layers[static_cast<size_t>(layer)];
  }
  // Dims rotated by RoPE: int(head_dim * partial_rotary_factor), as transformers truncates.
  int64_t rotary_dim() const {
    return static_cast<int64_t>(static_cast<double>(head_dim) * partial_rotary_factor);
  }
  // Gated DeltaNet sizes.
  int64_t linear_key_dim() const { return linear_num_key_heads * linear_key_head_dim; }
  int64_t linear_value_dim() const { return linear_num_value_heads * linear_value_head_dim; }
  int64_t linear_conv_dim() const { return 2 * linear_key_dim() + linear_value_dim(); }
};

// Reads and validates `model_dir`/config.json. Errors are InvalidArgument (NotFound when
// the file is missing) and name the file and offending key.
absl::StatusOr<ModelConfig> ReadModelConfig(const std::filesystem::path& model_dir);

// Same as ReadModelConfig but from JSON text; `name_for_errors` stands in for the path.
absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text,
                                             std::string_view name_for_errors);

// Every weight the checkpoint must contain, keyed by its HF name in the checkpoint (the
// text model under config.text_prefix), with its shape. lm_head.weight is absent when the
// embeddings are tied. MoE experts come fused (mlp.experts.gate_up_proj [E, 2I, H],
// mlp.experts.down_proj [E, H, I]) or, with per_expert, one module per expert
// (mlp.experts.E.{gate,up,down}_proj.weight), as published checkpoints store them.
std::map<std::string, std::vector<int64_t>> ExpectedWeightShapes(const ModelConfig& config,
                                                                 bool per_expert = false);

}  // namespace twinkle::engine
