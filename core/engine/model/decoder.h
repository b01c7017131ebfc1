#pragma once
// The dense decoder family (Llama, Qwen2, Qwen3) over a packed batch: the tokens of every
// sequence are concatenated into one [N] row dimension, so every linear layer runs once over
// all rows of all tenants, and attention runs within each sequence only (no padding, no
// cross-sequence mixing). LoRA terms are added per row segment by a callback, so the model
// knows nothing about adapters.

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
// (logits), one for the whole model rather than one per layer.
enum class LinearKind { kQ, kK, kV, kO, kGate, kUp, kDown, kLmHead };
// PEFT's "all-linear": every linear of every decoder layer, but not lm_head (PEFT leaves the
// output layer out of all-linear; a tenant names lm_head explicitly to train it).
inline constexpr LinearKind kAllLinearKinds[] = {LinearKind::kQ,    LinearKind::kK,  LinearKind::kV,
                                                 LinearKind::kO,    LinearKind::kGate,
                                                 LinearKind::kUp,   LinearKind::kDown};
const char* LinearKindName(LinearKind kind);  // "q_proj", ..., "lm_head"

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
  // Returns logits [N, vocab] in float32. `lora` may be empty (base model only).
  at::Tensor Forward(const at::Tensor& tokens, const std::vector<int64_t>& seq_lens,
                     const std::vector<int64_t>& seq_groups, const LoraSegmentsFn& lora) const;

  // Incremental decoding (generation) over a paged KV cache: per layer K and V, each
  // [num_blocks, block_size, kv_heads, head_dim] (after RoPE), in the model's dtype and on
  // its device. Token t of a sequence lives in block (*blocks)[t / block_size], slot
  // t % block_size. The cache's owner (the sampler's block pool) hands out the blocks.
  struct PagedKv {
    std::vector<at::Tensor> k, v;  // per layer
    int64_t block_size = 0;
  };
  struct PagedSequence {
    const std::vector<int64_t>* blocks = nullptr;  // covers past + count tokens
    int64_t past = 0;   // tokens already in the cache: 0 = prefill
    int64_t count = 0;  // new tokens in this pass: a prefill's prompt, or 1 (a decode step)
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

  // Input and output width of a targetable linear (lm_head: hidden size, vocab size).
  std::pair<int64_t, int64_t> LinearShape(LinearKind kind) const;

 private:
  struct Layer {
    at::Tensor input_norm, post_norm, q_norm, k_norm;
    std::map<LinearKind, at::Tensor> weight, bias;
  };
  at::Tensor Linear(const Layer& layer, int64_t index, LinearKind kind, const at::Tensor& x,
                    const LoraSegmentsFn& lora) const;
  at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight) const;
  at::Tensor Attention(const Layer& layer, int64_t index, const at::Tensor& h,
                       const std::vector<int64_t>& seq_lens,
                       const std::vector<int64_t>& seq_groups, const at::Tensor& cos,
                       const at::Tensor& sin, const LoraSegmentsFn& lora) const;

  // q [N, heads, d], k and v [N, kv_heads, d]: projections, q/k norm and RoPE.
  struct Qkv {
    at::Tensor q, k, v;
  };
  Qkv ProjectQkv(const Layer& layer, int64_t index, const at::Tensor& h, const at::Tensor& cos,
                 const at::Tensor& sin, const LoraSegmentsFn& lora) const;
  at::Tensor PagedAttention(const Layer& layer, int64_t index, const at::Tensor& h,
                            const std::vector<PagedSequence>& seqs, PagedKv& kv,
                            const at::Tensor& slots, const at::Tensor& cos,
                            const at::Tensor& sin, const LoraSegmentsFn& lora) const;
  // RoPE cos/sin [N, head_dim] in the model's dtype for float positions [N] (fp32 angles).
  std::pair<at::Tensor, at::Tensor> Rope(const at::Tensor& positions) const;

  ModelConfig config_;
  at::Tensor embed_, final_norm_, lm_head_;
  std::vector<Layer> layers_;
  at::Tensor inv_freq_;  // [head_dim / 2], float32, RoPE scaling applied
};

// log p(targets[i]) under softmax(logits[i]) for logits [N, vocab] (float) and int64
// targets [N]: logits[i, t_i] - logsumexp(logits[i]), as one autograd node whose backward
// writes the [N, vocab] gradient g_i · (onehot(t_i) - softmax(logits[i])) in one buffer
// (gather + logsumexp as separate ops would allocate and add several of them). Same values,
// forward and backward, as that composition.
at::Tensor TargetLogprobs(const at::Tensor& logits, const at::Tensor& targets);

// RoPE inverse frequencies exactly as transformers computes them (fp32), with linear or
// llama3 scaling.
at::Tensor RopeInverseFrequencies(const ModelConfig& config);

}  // namespace twinkle::engine
