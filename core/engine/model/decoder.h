#pragma once
// The decoder families (dense: Llama, Qwen2, Qwen3; hybrid: Qwen3.5, whose layers are Gated
// DeltaNet linear attention or gated full attention as config.layer_types says) over a
// packed batch: the tokens of every sequence are concatenated into one [N] row dimension, so
// every linear layer runs once over all rows of all tenants, and attention, convolutions and
// recurrent states run within each sequence only (no padding, no cross-sequence mixing).
// LoRA terms are added per row segment by a callback, so the model knows nothing about
// adapters.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/engine/model/hf_config.h"
#include "kernels/lora_ops.h"

namespace twinkle::engine {

// The linear layers LoRA can target, in HF/PEFT names. kLmHead is the output projection
// (logits), one for the whole model rather than one per layer. The Gated DeltaNet linears
// (Qwen3.5's linear_attn.*) come last so the earlier values (which seed dropout masks)
// never move.
// The MoE kinds come after them, for the same reason:
// - kRouter: Qwen3-MoE's router `mlp.gate` [E, H] (PEFT: target parameter `gate.weight`).
// - kExpertsGateUp, kExpertsDown: the routed experts' fused parameters `mlp.experts.gate_up_proj`
//   [E, 2I, H] and `mlp.experts.down_proj` [E, H, I] (PEFT's ParamWrapper, 3-D LoRA: A [E·r, in]
//   and B [out, E·r], expert e's pair A[e·r:(e+1)·r] and B[:, e::E]). Never named by a tenant:
//   the adapter maps gate_proj/up_proj/down_proj onto them where PEFT does (Qwen3-MoE).
// - kSharedExpertGate: Qwen3.5-MoE's `mlp.shared_expert_gate` [1, H]. (Its shared expert's
//   gate/up/down projections are kGate/kUp/kDown of that MoE layer.)
enum class LinearKind {
  kQ, kK, kV, kO, kGate, kUp, kDown, kLmHead,
  kInProjQkv, kInProjZ, kInProjB, kInProjA, kOutProj,
  kRouter, kExpertsGateUp, kExpertsDown, kSharedExpertGate,
};
// The per-layer MoE kinds above, in PEFT's parameter order within a layer.
inline constexpr LinearKind kMoeKinds[] = {LinearKind::kExpertsGateUp, LinearKind::kExpertsDown,
                                           LinearKind::kRouter, LinearKind::kSharedExpertGate};
// Whether `kind` is LoRA on a routed expert parameter (3-D, per expert).
inline bool IsExpertKind(LinearKind kind) {
  return kind == LinearKind::kExpertsGateUp || kind == LinearKind::kExpertsDown;
}
// PEFT's "all-linear": every linear of every decoder layer, but not lm_head (PEFT leaves the
// output layer out of all-linear; a tenant names lm_head explicitly to train it). A model
// has only some of them (DecoderModel::HasLinear).
inline constexpr LinearKind kAllLinearKinds[] = {
    LinearKind::kQ,         LinearKind::kK,        LinearKind::kV,        LinearKind::kO,
    LinearKind::kGate,      LinearKind::kUp,       LinearKind::kDown,     LinearKind::kInProjQkv,
    LinearKind::kInProjZ,   LinearKind::kInProjB,  LinearKind::kInProjA,  LinearKind::kOutProj};
// "q_proj", ..., "lm_head", "in_proj_qkv", ..., "gate" (router), "gate_up_proj",
// "down_proj" (experts' parameters), "shared_expert_gate".
const char* LinearKindName(LinearKind kind);
// The module a linear belongs to, as the checkpoint names it: "self_attn", "mlp",
// "linear_attn" (lm_head: "").
const char* LinearKindModule(LinearKind kind);
// The linear's module path in the checkpoint, config.text_prefix included:
// "model.layers.3.linear_attn.in_proj_qkv", "lm_head"; in a Qwen3.5-MoE layer gate_proj is
// "model.layers.3.mlp.shared_expert.gate_proj"; the experts' kinds are the experts module
// "model.layers.3.mlp.experts" (PEFT's nesting, `.base_layer`, is the adapter's business).
std::string LinearModulePath(const ModelConfig& config, int64_t layer, LinearKind kind);

// Returns the LoRA segments to add to layer `layer`'s linear `kind`, whose input is `x`.
// lm_head is asked for with layer 0 (its input is the final-norm output).
using LoraSegmentsFn =
    std::function<std::vector<kernels::LoraSegment>(int64_t layer, LinearKind kind, const at::Tensor& x)>;

class DecoderModel {
 public:
  // Takes the weights as loaded (HF names); they never require grad.
  DecoderModel(ModelConfig config, std::map<std::string, at::Tensor> weights);

  const ModelConfig& config() const { return config_; }

  // tokens: int64 [N], the concatenation of sequences of lengths `seq_lens` (sum = N).
  // seq_groups: per sequence, the op (tenant) it belongs to, or empty for one group; work is
  // never batched across groups, so a group's numbers do not depend on the others.
  // Returns the final-norm hidden states [N, hidden] in the model's dtype: what lm_head
  // reads (TargetLogprobs). `lora` may be empty (base model only).
  at::Tensor Hidden(const at::Tensor& tokens, const std::vector<int64_t>& seq_lens,
                    const std::vector<int64_t>& seq_groups, const LoraSegmentsFn& lora) const;

  // log p(targets[i]) under softmax(logits[i]), logits = lm_head(hidden) plus the lm_head
  // LoRA term (`lora`, asked for with layer 0), in float32: targets int64 [N] give [N];
  // [N, K] (soft targets) give [N, K], logits[i, t_ik] - logsumexp(logits[i]). The [N, vocab]
  // logits never exist at once: rows go through lm_head, logsumexp and the gather in chunks
  // of LogitChunkRows(vocab) rows (within each group of seq_groups, so a tenant's chunks are
  // the same fused or alone), and the one autograd node saves only hidden, targets and the
  // rows' log-sum-exps: its backward recomputes each chunk's logits, writes that chunk's
  // gradient g · (onehot(t) - softmax) and backpropagates it through the chunk's lm_head and
  // LoRA term (gradients to hidden and to the lm_head LoRA A/B). Same values, forward and
  // backward, as the full-logits composition up to the order of the LoRA gradient sums.
  // `logits`: when non-null, also receives the float32 logits [N, vocab] (no gradient), for
  // return_logits; only then do they exist whole.
  at::Tensor TargetLogprobs(const at::Tensor& hidden, const at::Tensor& targets,
                            const std::vector<int64_t>& seq_lens,
                            const std::vector<int64_t>& seq_groups, const LoraSegmentsFn& lora,
                            at::Tensor* logits) const;

  // Rows per chunk of TargetLogprobs; 0 = LogitChunkRows's default.
  void set_logit_chunk_rows(int64_t rows) { logit_chunk_rows_ = rows; }
  // Activation checkpointing (engine.activation_checkpointing): with autograd on, each
  // decoder layer keeps only its input and is recomputed in backward. Same gradients.
  void set_activation_checkpointing(bool on) { activation_checkpointing_ = on; }

  // Incremental decoding (generation) over a paged KV cache: per layer K and V, each
  // [num_blocks, block_size, kv_heads, head_dim] (after RoPE), in the model's dtype and on
  // its device. Token t of a sequence lives in block (*blocks)[t / block_size], slot
  // t % block_size. The cache's owner (the sampler's block pool) hands out the blocks.
  // Hybrid models add per-sequence states for their Gated DeltaNet layers, indexed by a
  // sequence's state slot: conv [slots, conv_dim, K-1] (model dtype) and recurrent
  // [slots, value_heads, key_head_dim, value_head_dim] (float32). k/v are undefined for
  // DeltaNet layers, conv/recurrent for full-attention layers (and empty for dense models).
  struct PagedKv {
    std::vector<at::Tensor> k, v;  // per layer
    int64_t block_size = 0;
    std::vector<at::Tensor> conv, recurrent;  // per layer
  };
  struct PagedSequence {
    const std::vector<int64_t>* blocks = nullptr;  // covers past + count tokens
    int64_t past = 0;   // tokens already in the cache: 0 = prefill
    int64_t count = 0;  // new tokens in this pass: a prefill's prompt, or 1 (a decode step)
    int64_t state_slot = -1;  // hybrid models: the sequence's slot in PagedKv::conv/recurrent
  };

  // tokens: int64 [N], the new tokens of every sequence concatenated (count of each, at
  // positions past onwards). Writes their keys and values into the blocks. A prefill
  // (past 0) attends causally within its tokens through the same SDPA call as Forward; a
  // decode step (count 1) attends to the sequence's whole cache through
  // kernels::PagedDecodeAttention, in place. Linear layers run once over all N rows,
  // attention per sequence, never batched across sequences. Returns float32 logits
  // [R, vocab] for the rows `logit_rows` (sorted, into [0, N); null = all N rows); the
  // lm_head LoRA segments, given over the N rows, are mapped onto those. Inference only:
  // call under a NoGradGuard.
  at::Tensor ForwardPaged(const at::Tensor& tokens, const std::vector<PagedSequence>& seqs,
                          PagedKv& kv, const std::vector<int64_t>* logit_rows,
                          const LoraSegmentsFn& lora) const;

  // Input and output width of a targetable linear (lm_head: hidden size, vocab size; an
  // expert parameter: one expert's, e.g. gate_up {H, 2I}); {0, 0} when no layer has it.
  std::pair<int64_t, int64_t> LinearShape(LinearKind kind) const;
  // Whether layer `layer` has linear `kind` (lm_head: layer 0). A Qwen3.5 model has q/k/v/o
  // only in its full-attention layers and in_proj_* / out_proj only in its DeltaNet layers.
  bool HasLinear(int64_t layer, LinearKind kind) const;

 private:
  struct Layer {
    bool linear_attention = false;  // Gated DeltaNet (Qwen3.5) instead of full attention
    bool moe = false;               // sparse MoE block (Qwen3-MoE) instead of the dense MLP
    // MoE: router [E, H] (frozen), experts' gate|up [E, 2I, H] and down [E, H, I].
    // Qwen3.5-MoE's shared expert (SwiGLU) is weight[kGate/kUp/kDown] and its gate [1, H]
    // weight[kSharedExpertGate].
    at::Tensor router, experts_gate_up, experts_down;
    at::Tensor input_norm, post_norm, q_norm, k_norm;
    // Gated DeltaNet: conv1d.weight [C, 1, K], dt_bias, A_log, the gated norm's weight.
    at::Tensor conv_weight, dt_bias, a_log, gated_norm;
    std::map<LinearKind, at::Tensor> weight, bias;
  };
  // Decoder layer `index` over the packed batch: x + attention, then + MLP (or MoE).
  at::Tensor RunLayer(int64_t index, const at::Tensor& x, const std::vector<int64_t>& seq_lens,
                      const std::vector<int64_t>& seq_groups,
                      const std::vector<int64_t>& group_rows, const at::Tensor& cos,
                      const at::Tensor& sin, const LoraSegmentsFn& lora) const;
  at::Tensor Linear(const Layer& layer, int64_t index, LinearKind kind, const at::Tensor& x,
                    const LoraSegmentsFn& lora) const;
  at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight) const;
  // The token mixer of a Gated DeltaNet layer over packed sequences from a zero state.
  // states (prefill for the sampler): where each sequence's conv and recurrent states go.
  struct LinearStates {
    at::Tensor* conv = nullptr;       // [S, C, K-1]
    at::Tensor* recurrent = nullptr;  // [S, nv, dk, dv]
  };
  at::Tensor LinearAttention(const Layer& layer, int64_t index, const at::Tensor& h,
                             const std::vector<int64_t>& seq_lens,
                             const std::vector<int64_t>& seq_groups, const LoraSegmentsFn& lora,
                             const LinearStates& states) const;
  // The same over the sampler's sequences: prefills from a zero state, decode steps by the
  // recurrent form from their slots' states, which are updated.
  at::Tensor PagedLinearAttention(const Layer& layer, int64_t index, const at::Tensor& h,
                                  const std::vector<PagedSequence>& seqs, PagedKv& kv,
                                  const LoraSegmentsFn& lora) const;
  // The layer's SwiGLU MLP: down(silu(gate(x)) * up(x)).
  at::Tensor Mlp(const Layer& layer, int64_t index, const at::Tensor& x,
                 const LoraSegmentsFn& lora) const;
  // A sparse MoE block over row groups (`group_rows`, summing to N): each group is routed
  // and its experts computed on its own (one matrix product per expert hit), so a tenant's
  // numbers do not depend on the rows of other groups. LoRA on the router and the experts
  // per segment (the segments of a group never reach outside it). The shared expert's base
  // products run per group too, its LoRA per segment over all rows like any linear's.
  at::Tensor Moe(const Layer& layer, int64_t index, const at::Tensor& x,
                 const std::vector<int64_t>& group_rows, const LoraSegmentsFn& lora) const;
  // The LoRA segments of one MoE block, rows relative to the rows MoeRows is given.
  struct MoeLora {
    std::vector<kernels::LoraSegment> router, gate_up, down;
  };
  // The routed part over rows `x`: router (+ LoRA), top-k, and per expert one matrix product
  // over its rows, plus per adapter among them one LoRA product pair with that expert's A, B.
  at::Tensor MoeRows(const Layer& layer, const at::Tensor& x, const MoeLora& lora) const;
  at::Tensor Attention(const Layer& layer, int64_t index, const at::Tensor& h,
                       const std::vector<int64_t>& seq_lens,
                       const std::vector<int64_t>& seq_groups, const at::Tensor& cos,
                       const at::Tensor& sin, const LoraSegmentsFn& lora) const;

  // q [N, heads, d], k and v [N, kv_heads, d]: projections, q/k norm and RoPE (over the
  // first rotary_dim dims). gate [N, heads * d]: the output gate (attn_output_gate only).
  struct Qkv {
    at::Tensor q, k, v, gate;
  };
  Qkv ProjectQkv(const Layer& layer, int64_t index, const at::Tensor& h, const at::Tensor& cos,
                 const at::Tensor& sin, const LoraSegmentsFn& lora) const;
  at::Tensor PagedAttention(const Layer& layer, int64_t index, const at::Tensor& h,
                            const std::vector<PagedSequence>& seqs, PagedKv& kv,
                            const at::Tensor& slots, const at::Tensor& cos,
                            const at::Tensor& sin, const LoraSegmentsFn& lora) const;
  // RoPE cos/sin [N, rotary_dim] in the model's dtype for float positions [N] (fp32 angles).
  std::pair<at::Tensor, at::Tensor> Rope(const at::Tensor& positions) const;

  ModelConfig config_;
  at::Tensor embed_, final_norm_, lm_head_;
  std::vector<Layer> layers_;
  at::Tensor inv_freq_;  // [rotary_dim / 2], float32, RoPE scaling applied
  int64_t logit_chunk_rows_ = 0;
  bool activation_checkpointing_ = false;
};

// Logits per chunk of DecoderModel::TargetLogprobs: at most this many float32 values
// (64 MiB) unless configured, so the transient [rows, vocab] buffers (a chunk's logits and
// their gradient) stay the same size whatever the sequence length.
inline constexpr int64_t kLogitChunkElements = int64_t{1} << 24;
// Rows per chunk: `configured` when positive, else max(1, kLogitChunkElements / vocab)
// (e.g. 524 rows for a 32000 vocabulary, 110 for Qwen3's 151936).
int64_t LogitChunkRows(int64_t vocab, int64_t configured = 0);

// RoPE inverse frequencies exactly as transformers computes them (fp32) over the rotated
// dims (config.rotary_dim()), with linear or llama3 scaling.
at::Tensor RopeInverseFrequencies(const ModelConfig& config);

}  // namespace twinkle::engine
