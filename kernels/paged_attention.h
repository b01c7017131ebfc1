#pragma once
// Decode attention over a paged KV cache (generation): one new query token per sequence
// against every key and value of that sequence so far, read in place from the cache blocks.
//
// The cache of one layer is K and V, each [num_blocks, block_size, kv_heads, head_dim]; a
// sequence's token t sits in block blocks[t / block_size], slot t % block_size. The new
// token's own key and value must already be written there.
//
// On CPU with float32 the work is one task per (sequence, head): scores q·k/√d in token
// order, softmax (max-subtracted, exp, sum in token order), then Σ p_t·v_t / Σ p_t. Every
// sum runs in a fixed order on that sequence's data only, without fused multiply-adds, so a
// sequence's output does not depend on the other sequences, the batch size or the thread
// count. Elsewhere (other devices or dtypes) each sequence's blocks are gathered
// (index_select) and go through ATen's scaled_dot_product_attention.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace twinkle::kernels {

struct PagedSequenceView {
  const int64_t* blocks = nullptr;  // block table (host memory), >= ceil(length / block_size)
  int64_t length = 0;               // tokens to attend to, the new one included (>= 1)
};

// q [S, heads, head_dim]; k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim],
// contiguous, q's dtype and device; heads a multiple of kv_heads (GQA: head h reads kv head
// h / (heads / kv_heads)). Returns [S, heads, head_dim] in q's dtype, scale 1/√head_dim.
at::Tensor PagedDecodeAttention(const at::Tensor& q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache,
                                const std::vector<PagedSequenceView>& seqs);

// The same through gather + scaled_dot_product_attention on any device or dtype (the
// fallback, and the reference the CPU kernel is tested against).
at::Tensor PagedDecodeAttentionGather(const at::Tensor& q, const at::Tensor& k_cache,
                                      const at::Tensor& v_cache,
                                      const std::vector<PagedSequenceView>& seqs);

}  // namespace twinkle::kernels
