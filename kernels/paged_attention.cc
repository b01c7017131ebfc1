#include "kernels/paged_attention.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace twinkle::kernels {
namespace {

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TWINKLE_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define TWINKLE_CLONES
#endif

typedef float V8 __attribute__((vector_size(32)));
typedef float V8U __attribute__((vector_size(32), aligned(alignof(float)), may_alias));

// Σ a[i]·b[i] over i < d: eight lanes of partial sums in i order, then the lanes added
// pairwise in a fixed order, then the tail. The same rounding in every clone (no FMA: this
// file is built with -ffp-contract=off).
inline __attribute__((always_inline)) float Dot(const float* __restrict a,
                                                const float* __restrict b, int64_t d) {
  V8 acc{};
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    acc += *reinterpret_cast<const V8U*>(a + i) * *reinterpret_cast<const V8U*>(b + i);
  }
  float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < d; ++i) sum += a[i] * b[i];
  return sum;
}

struct Layout {
  int64_t block_size, block_stride, token_stride, d;
};

// One (sequence, head): q [d] against the kv head at `kv_off` within each token's slot.
// `scores` holds length floats.
TWINKLE_CLONES void DecodeHead(const float* q, const float* k_cache, const float* v_cache,
                               const PagedSequenceView& seq, int64_t kv_off, const Layout& l,
                               float scale, float* scores, float* out) {
  const int64_t d = l.d;
  float max_score = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < seq.length; ++t) {
    const int64_t off = seq.blocks[t / l.block_size] * l.block_stride +
                        (t % l.block_size) * l.token_stride + kv_off;
    const float s = Dot(q, k_cache + off, d) * scale;
    scores[t] = s;
    max_score = std::max(max_score, s);
  }
  float sum = 0;
  for (int64_t t = 0; t < seq.length; ++t) {
    scores[t] = std::exp(scores[t] - max_score);
    sum += scores[t];
  }
  std::fill(out, out + d, 0.0f);
  for (int64_t t = 0; t < seq.length; ++t) {
    const float p = scores[t];
    const float* v = v_cache + seq.blocks[t / l.block_size] * l.block_stride +
                     (t % l.block_size) * l.token_stride + kv_off;
    for (int64_t i = 0; i < d; ++i) out[i] += p * v[i];
  }
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < d; ++i) out[i] *= inv;
}

void CheckArgs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const std::vector<PagedSequenceView>& seqs) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "PagedDecodeAttention: want q [S, heads, d] and caches [blocks, block_size, "
              "kv_heads, d], got ",
              q.sizes(), ", ", k_cache.sizes(), ", ", v_cache.sizes());
  TORCH_CHECK(q.size(0) == static_cast<int64_t>(seqs.size()), "PagedDecodeAttention: ", q.size(0),
              " queries for ", seqs.size(), " sequences");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "PagedDecodeAttention: q ", q.sizes(), " does not fit the cache ", k_cache.sizes());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "PagedDecodeAttention: the caches must be contiguous");
  for (const PagedSequenceView& s : seqs) {
    TORCH_CHECK(s.length >= 1 && s.blocks != nullptr, "PagedDecodeAttention: empty sequence");
  }
}

}  // namespace

at::Tensor PagedDecodeAttentionGather(const at::Tensor& q, const at::Tensor& k_cache,
                                      const at::Tensor& v_cache,
                                      const std::vector<PagedSequenceView>& seqs) {
  CheckArgs(q, k_cache, v_cache, seqs);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), d = k_cache.size(3);
  // Every sequence's block ids in one host buffer, copied to the device once.
  std::vector<int64_t> ids, starts;
  for (const PagedSequenceView& seq : seqs) {
    starts.push_back(static_cast<int64_t>(ids.size()));
    ids.insert(ids.end(), seq.blocks, seq.blocks + (seq.length + block_size - 1) / block_size);
  }
  const at::Tensor all_ids =
      at::from_blob(ids.data(), {static_cast<int64_t>(ids.size())}, at::kLong)
          .to(q.device(), false, true);
  std::vector<at::Tensor> outputs;
  outputs.reserve(seqs.size());
  for (size_t s = 0; s < seqs.size(); ++s) {
    const int64_t n = (seqs[s].length + block_size - 1) / block_size;
    const at::Tensor index = all_ids.narrow(0, starts[s], n);
    auto gather = [&](const at::Tensor& cache) {
      return cache.index_select(0, index)
          .view({n * block_size, kv_heads, d})
          .narrow(0, 0, seqs[s].length)
          .transpose(0, 1)
          .unsqueeze(0);
    };
    const at::Tensor o = at::scaled_dot_product_attention(
        q.select(0, static_cast<int64_t>(s)).unsqueeze(1).unsqueeze(0), gather(k_cache),
        gather(v_cache), {}, 0.0, /*is_causal=*/false, /*scale=*/std::nullopt,
        /*enable_gqa=*/kv_heads != q.size(1));
    outputs.push_back(o.squeeze(0).squeeze(1));  // [heads, d]
  }
  return at::stack(outputs, 0);
}

at::Tensor PagedDecodeAttention(const at::Tensor& q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache,
                                const std::vector<PagedSequenceView>& seqs) {
  if (!q.is_cpu() || q.scalar_type() != at::kFloat || k_cache.scalar_type() != at::kFloat ||
      v_cache.scalar_type() != at::kFloat) {
    return PagedDecodeAttentionGather(q, k_cache, v_cache, seqs);
  }
  CheckArgs(q, k_cache, v_cache, seqs);
  const at::Tensor qc = q.contiguous();
  const int64_t num_seqs = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = k_cache.size(2), group = heads / kv_heads;
  const Layout layout{k_cache.size(1), k_cache.size(1) * kv_heads * d, kv_heads * d, d};
  at::Tensor out = at::empty({num_seqs, heads, d}, q.options());
  int64_t max_len = 0;
  for (const PagedSequenceView& s : seqs) max_len = std::max(max_len, s.length);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const float* qp = qc.const_data_ptr<float>();
  const float* kp = k_cache.const_data_ptr<float>();
  const float* vp = v_cache.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  // Threads only for real work: each chunk at least ~2^18 multiply-adds (~100 µs). Waking
  // the pool per layer and step for less costs more than it saves, and far more on a
  // loaded machine, where a parallel region waits for a thread that is not running.
  const int64_t grain =
      std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(2 * max_len * d, 1));
  at::parallel_for(0, num_seqs * heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(max_len);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / heads, h = task % heads;
      DecodeHead(qp + task * d, kp, vp, seqs[s], (h / group) * d, layout, scale, scores.data(),
                 op + task * d);
    }
  });
  return out;
}

}  // namespace twinkle::kernels
