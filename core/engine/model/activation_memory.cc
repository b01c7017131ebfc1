#include "core/engine/model/activation_memory.h"

#include <algorithm>
#include <cmath>

namespace twinkle::engine {
namespace {

constexpr double kF32 = 4;       // float32 internals (norms, softmax, log-sum-exps)
constexpr int64_t kDeltaChunk = 64;  // gated_deltanet.cc's kChunk
constexpr int64_t kAssumedRank = 64;
constexpr double kBackwardLayers = 3;
constexpr int64_t kRuntimeBytes = int64_t{64} << 20;

// What a step keeps, in bytes per token (or per token²), element counts times sizes read
// off decoder.cc's code paths. Each term names the tensors autograd saves.
struct Widths {
  double s, h, q, kv, heads, inter, rank;
};

// RmsNorm over `w` columns: the float32 input and normalised rows, and the output.
double NormKept(double w, double s) { return w * (2 * kF32 + s); }

// A full-attention layer's attention block (input norm to o_proj's input).
double AttentionKept(const ModelConfig& c, const Widths& w) {
  const double s = w.s;
  double b = NormKept(w.h, s);                                   // input_layernorm
  b += (w.q * (c.attn_output_gate ? 2 : 1) + 2 * w.kv) * s;      // q/k/v projections
  if (c.qk_norm) b += NormKept(w.q, s) + NormKept(w.kv, s);
  b += 2 * (w.q + w.kv) * s;                                     // RoPE: rotate_half, rotated
  b += 2 * w.q * s + w.heads * kF32;                             // attention out, reshaped; lse
  if (c.attn_output_gate) b += 2 * w.q * s;                      // sigmoid(gate), gated out
  b += 4 * w.rank * s;                                           // LoRA x·Aᵀ of q, k, v, o
  return b;
}

// A Gated DeltaNet layer's attention block (float32 inside the chunked rule).
double LinearAttentionKept(const ModelConfig& c, const Widths& w) {
  const double s = w.s, nv = static_cast<double>(c.linear_num_value_heads);
  const double dk = static_cast<double>(c.linear_key_head_dim), dv = static_cast<double>(c.linear_value_head_dim);
  const double conv = static_cast<double>(c.linear_conv_dim()), vd = static_cast<double>(c.linear_value_dim());
  double b = NormKept(w.h, s);
  b += (conv + vd + 2 * nv) * s;           // in_proj_qkv, z, b, a
  b += 2 * conv * s;                       // causal conv out, silu
  b += (3 * 2 * nv * dk + 2 * nv * dv) * kF32;  // q/k repeated, float, l2-normed; v, v_beta
  b += nv * dk * kF32;                     // k_beta
  b += 4 * nv * kDeltaChunk * kF32;        // [C, C] chunk matrices per head, per row
  b += 2 * nv * dk * dv / kDeltaChunk * kF32;  // the state before each chunk
  b += 2 * nv * dv * kF32 + NormKept(vd, s) + vd * s;  // rule out, gated norm, out_proj in
  b += 4 * w.rank * s;
  return b;
}

// The feed-forward block (post norm to the residual add).
double FeedForwardKept(const ModelConfig& c, int64_t layer, const Widths& w) {
  const double s = w.s;
  double b = NormKept(w.h, s);  // post_attention_layernorm
  if (!c.is_moe_layer(layer)) return b + 4 * w.inter * s + 3 * w.rank * s;  // gate, silu, up, product
  const double e = static_cast<double>(c.num_experts), k = static_cast<double>(c.experts_per_token);
  const double im = static_cast<double>(c.moe_intermediate_size);
  b += e * (s + kF32) + k * (16 + s);          // router logits, softmax; top-k ids, weights
  b += k * (3 * w.h + 4 * im) * s + w.h * s;   // per (row, k): x rows, gate_up, silu, product,
                                               // down, weighted; the output
  b += k * 3 * w.rank * s;
  if (c.shared_expert_intermediate_size > 0) {
    b += 4 * static_cast<double>(c.shared_expert_intermediate_size) * s + 3 * s;
  }
  return b;
}

int64_t Bytes(double b) { return static_cast<int64_t>(std::ceil(b)); }

}  // namespace

ActivationCost ActivationCostOf(const ModelConfig& c, const ActivationSetup& setup) {
  const double s = static_cast<double>(setup.itemsize);
  const Widths w{s,
                 static_cast<double>(c.hidden_size),
                 static_cast<double>(c.num_attention_heads * c.head_dim),
                 static_cast<double>(c.num_key_value_heads * c.head_dim),
                 static_cast<double>(c.num_attention_heads),
                 static_cast<double>(c.intermediate_size),
                 static_cast<double>(setup.max_lora_rank > 0 ? setup.max_lora_rank : kAssumedRank)};
  // Per layer: what autograd keeps from forward to backward.
  double all_layers = 0, widest_layer = 0;
  int64_t full_attention_layers = 0;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const bool linear = c.is_linear_layer(i);
    if (!linear) ++full_attention_layers;
    const double layer = (linear ? LinearAttentionKept(c, w) : AttentionKept(c, w)) + FeedForwardKept(c, i, w);
    all_layers += layer;
    widest_layer = std::max(widest_layer, layer);
  }
  // Checkpointing keeps each layer's input, and one layer's activations while it is
  // recomputed in backward.
  const double layers = setup.checkpointing ? static_cast<double>(c.num_hidden_layers) * w.h * s + widest_layer
                                            : all_layers;
  // Around the layers: the embedding output, the final norm (its output is what the chunked
  // log-probs keep), targets, weights, log-sum-exps and log-probs, the request's and reply's
  // frames.
  const double around = w.h * s + NormKept(w.h, s) + 64;
  // Backward through a layer: its saved activations are still there while their gradients
  // are made, and the allocator does not hand freed blocks back at once. Measured on CPU
  // (tests/engine/test_memory_estimate.py, fp32 Qwen3, hidden 128 and 256): a checkpointed
  // step's per-token peak is about 2.2x (inputs + one layer), so the working set is taken as
  // kBackwardLayers layers' activations.
  const double backward = kBackwardLayers * widest_layer;

  ActivationCost cost;
  cost.token_bytes = Bytes(layers + around + backward);
  // One chunk of logits at a time, forward or backward: the lm_head product in the dtype,
  // then float32 logits and their gradient (measured: ~2 float32 copies per element).
  cost.chunk_rows = std::max<int64_t>(setup.logit_chunk_rows, 1);
  cost.chunk_row_bytes = Bytes(static_cast<double>(c.vocab_size) * (2 * kF32 + s));
  // The first step's runtime workspaces and allocator slack (measured ~35-45 MiB on CPU
  // over the loaded worker beyond the terms above).
  cost.fixed_bytes = kRuntimeBytes;
  if (!setup.flash_attention) {
    // Math attention: softmax([heads, L, L]) kept per full-attention layer (one when
    // checkpointing), plus the scores, the causal mask and the gradient while one runs.
    const double kept = setup.checkpointing ? 1 : static_cast<double>(full_attention_layers);
    cost.seq_sq_bytes = full_attention_layers == 0 ? 0 : Bytes((kept + 3) * w.heads * s);
  }
  return cost;
}

}  // namespace twinkle::engine
