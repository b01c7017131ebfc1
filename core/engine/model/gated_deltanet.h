#pragma once
// The numerics of Qwen3.5's Gated DeltaNet (linear attention) block, over packed batches:
// the rows of several sequences concatenated into one [N] dimension. No state and no
// convolution ever crosses a sequence boundary. Everything is plain ATen (autograd-capable,
// any device), written step for step as transformers 5.23's torch fallbacks compute it
// (causal_conv1d_fn / causal_conv1d_update, torch_chunk_gated_delta_rule,
// torch_recurrent_gated_delta_rule, Qwen3_5RMSNormGated), so the engine matches it to
// rounding.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace twinkle::engine {

// Applies the elementwise `fn` (sigmoid, softplus, silu, cos, ...) to x so that a row's
// result does not depend on how many rows the tensor has. ATen's CPU loops run the last
// (fewer than two vector widths of) elements of a tensor through the scalar function
// (std::exp) instead of the vectorised one (Sleef), a last-bit difference: a tenant's rows
// would round differently fused with others than alone whenever the element count is not a
// multiple of the vector width (Qwen3.5's [N, heads] gate inputs, [N, 8] rotary angles).
// On CPU the flat tensor is padded to a multiple of 64 elements, so every element takes
// the vectorised path, forward and backward (the gradient is padded the same way). Exact
// for tensors below ATen's parallel grain (32768 elements); larger ones are split across
// threads at boundaries that depend on their size, as every elementwise op of the engine.
at::Tensor TailFree(const at::Tensor& x, const std::function<at::Tensor(const at::Tensor&)>& fn);

// Causal depthwise conv1d + SiLU over packed sequences. x [N, C]; weight [C, 1, K] (the
// checkpoint's conv1d.weight, no bias). Row t of a sequence sees rows t-K+1..t of the same
// sequence only (zeros before its start), as F.conv1d with padding K-1 cut to the length.
at::Tensor PackedCausalConv1d(const at::Tensor& x, const at::Tensor& weight,
                              const std::vector<int64_t>& seq_lens);

// The conv state each sequence leaves for decoding: its last K-1 input rows (x as given to
// PackedCausalConv1d), zero-padded in front when shorter, as [S, C, K-1].
at::Tensor ConvStates(const at::Tensor& x, int64_t kernel, const std::vector<int64_t>& seq_lens);

// One decode step of the conv for B sequences: x [B, C] (their new rows), state [B, C, K-1]
// (their conv states, updated to the last K-1 rows). Returns SiLU(conv) [B, C].
at::Tensor CausalConv1dStep(const at::Tensor& x, const at::Tensor& weight, at::Tensor& state);

// The gated delta rule in its chunked form (chunks of 64, the UT transform by triangular
// solves, a scan over chunks), over packed sequences, each from a zero state.
// q, k: [N, nk, dk]; v: [N, nv, dv]; g (log decay), beta: [N, nv]; nv a multiple of nk.
// q and k are L2-normalised inside (use_qk_l2norm_in_kernel) and q scaled by dk^-1/2.
// Consecutive sequences of the same group (seq_groups; empty = one group) share batched
// matrix products, never sequences of different groups. Returns [N, nv, dv] in q's dtype;
// final_states, when given, receives every sequence's last state [S, nv, dk, dv] (float32).
at::Tensor ChunkGatedDeltaRule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& g, const at::Tensor& beta,
                               const std::vector<int64_t>& seq_lens,
                               const std::vector<int64_t>& seq_groups, at::Tensor* final_states);

// The recurrent form, one token for each of B sequences: q, k [B, nk, dk], v [B, nv, dv],
// g, beta [B, nv]; state [B, nv, dk, dv] float32, replaced by the updated state. Returns
// [B, nv, dv] in q's dtype.
at::Tensor RecurrentGatedDeltaStep(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& g, const at::Tensor& beta, at::Tensor& state);

// Qwen3_5RMSNormGated over the last dim: weight * rms_norm(x) * silu(gate), the norm in
// float32, weight applied in x's dtype (weight is not zero-centred here).
at::Tensor GatedRmsNorm(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight,
                        double eps);

}  // namespace twinkle::engine
