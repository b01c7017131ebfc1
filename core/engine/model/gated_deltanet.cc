#include "core/engine/model/gated_deltanet.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace twinkle::engine {
namespace {

// transformers' torch_chunk_gated_delta_rule default.
constexpr int64_t kChunk = 64;

// transformers' l2norm (aligned with FLA): x * rsqrt(sum(x^2) + eps), eps 1e-6.
at::Tensor L2Norm(const at::Tensor& x) {
  return x * at::rsqrt((x * x).sum(-1, /*keepdim=*/true) + 1e-6);
}

// Grouped value heads: each q/k head serves nv / nk consecutive value heads.
at::Tensor RepeatHeads(const at::Tensor& x, int64_t nv) {
  const int64_t nk = x.size(1);
  return nk == nv ? x : x.repeat_interleave(nv / nk, /*dim=*/1);
}

// Position of every packed row inside its sequence, on `device`.
at::Tensor PositionsInSequence(const std::vector<int64_t>& seq_lens, c10::Device device) {
  std::vector<at::Tensor> parts;
  parts.reserve(seq_lens.size());
  for (int64_t len : seq_lens) parts.push_back(at::arange(len, at::kLong));
  return at::cat(parts).to(device);
}

// The chunked rule for B sequences padded to one length Lp (a multiple of kChunk), as
// transformers computes it after its padding: q, k [B, H, Lp, dk] (normalised, q scaled),
// v [B, H, Lp, dv], g, beta [B, H, Lp], all float32. Returns the output [B, H, Lp, dv] and
// the final state [B, H, dk, dv]. Zero padding (g = beta = k = v = 0) leaves the state
// exactly as it was, so a sequence's final state does not depend on how far it was padded.
std::pair<at::Tensor, at::Tensor> ChunkRule(at::Tensor query, at::Tensor key, at::Tensor value,
                                            const at::Tensor& g, const at::Tensor& beta) {
  const int64_t b = query.size(0), heads = query.size(1), lp = query.size(2);
  const int64_t dk = query.size(3), dv = value.size(3);
  const int64_t nc = lp / kChunk;
  at::Tensor v_beta = value * beta.unsqueeze(-1);
  at::Tensor k_beta = key * beta.unsqueeze(-1);
  auto chunked = [&](const at::Tensor& t) {
    return t.reshape({b, heads, nc, kChunk, t.size(-1)});
  };
  query = chunked(query);
  key = chunked(key);
  k_beta = chunked(k_beta);
  v_beta = chunked(v_beta);
  const at::Tensor decay = g.reshape({b, heads, nc, kChunk});
  const at::Tensor strictly_upper =
      at::ones({kChunk, kChunk}, at::TensorOptions().dtype(at::kBool).device(query.device()))
          .triu(1);
  const at::Tensor cum = decay.cumsum(3);
  const at::Tensor pairwise = (cum.unsqueeze(4) - cum.unsqueeze(3))
                                  .masked_fill(strictly_upper, -std::numeric_limits<float>::infinity())
                                  .exp();
  const at::Tensor key_t = key.transpose(-1, -2);
  const at::Tensor ut_system = at::matmul(k_beta, key_t) * pairwise;
  const at::Tensor intra = at::matmul(query, key_t) * pairwise;
  const at::Tensor decayed_k_beta = k_beta * cum.exp().unsqueeze(-1);
  // The UT transform: (I + strictly_lower(ut_system))^-1 applied by triangular solves.
  const at::Tensor new_values = at::linalg_solve_triangular(ut_system, v_beta, /*upper=*/false,
                                                            /*left=*/true, /*unitriangular=*/true);
  const at::Tensor k_cumdecay = at::linalg_solve_triangular(
      ut_system, decayed_k_beta, /*upper=*/false, /*left=*/true, /*unitriangular=*/true);

  at::Tensor state = at::zeros({b, heads, dk, dv}, new_values.options());
  const at::Tensor q_decayed = query * cum.exp().unsqueeze(-1);
  const at::Tensor k_decayed = key * (cum.narrow(-1, kChunk - 1, 1) - cum).exp().unsqueeze(-1);
  const at::Tensor chunk_decay = cum.select(-1, kChunk - 1).exp().unsqueeze(-1).unsqueeze(-1);
  std::vector<at::Tensor> outputs;
  outputs.reserve(nc);
  for (int64_t i = 0; i < nc; ++i) {
    const at::Tensor v_new = new_values.select(2, i) - at::matmul(k_cumdecay.select(2, i), state);
    const at::Tensor inter = at::matmul(q_decayed.select(2, i), state);
    outputs.push_back(inter + at::matmul(intra.select(2, i), v_new));
    state = state * chunk_decay.select(2, i) +
            at::matmul(k_decayed.select(2, i).transpose(-1, -2), v_new);
  }
  return {at::stack(outputs, 2).reshape({b, heads, lp, dv}), state};
}

}  // namespace

at::Tensor TailFree(const at::Tensor& x, const std::function<at::Tensor(const at::Tensor&)>& fn) {
  constexpr int64_t kMultiple = 64;  // two AVX-512 float vectors, four AVX2 ones
  const int64_t n = x.numel();
  const int64_t padded = (n + kMultiple - 1) / kMultiple * kMultiple;
  if (!x.is_cpu() || padded == n) return fn(x);
  const at::Tensor flat = at::constant_pad_nd(x.reshape({n}), {0, padded - n});
  return fn(flat).narrow(0, 0, n).view(x.sizes());
}

at::Tensor PackedCausalConv1d(const at::Tensor& x, const at::Tensor& weight,
                              const std::vector<int64_t>& seq_lens) {
  const int64_t n = x.size(0), channels = x.size(1), kernel = weight.size(-1);
  const at::Tensor w = weight.reshape({channels, kernel}).to(x.scalar_type());
  const at::Tensor pos = PositionsInSequence(seq_lens, x.device()).unsqueeze(1);
  // out[t] = sum_j w[j] · x[t - (K-1) + j], rows before the sequence's start being zero.
  at::Tensor out;
  for (int64_t j = 0; j < kernel; ++j) {
    const int64_t shift = kernel - 1 - j;
    if (shift >= n) continue;  // reads only rows before every sequence's start
    at::Tensor shifted = x;
    if (shift > 0) {
      shifted = at::constant_pad_nd(x.narrow(0, 0, n - shift), {0, 0, shift, 0})
                    .masked_fill(pos < shift, 0);
    }
    const at::Tensor term = shifted * w.select(1, j);
    out = out.defined() ? out + term : term;
  }
  return TailFree(out, [](const at::Tensor& t) { return at::silu(t); });
}

at::Tensor ConvStates(const at::Tensor& x, int64_t kernel, const std::vector<int64_t>& seq_lens) {
  const int64_t keep = kernel - 1;
  std::vector<at::Tensor> states;
  states.reserve(seq_lens.size());
  int64_t start = 0;
  for (int64_t len : seq_lens) {
    const int64_t take = std::min(len, keep);
    const at::Tensor rows = x.narrow(0, start + len - take, take);  // [take, C]
    states.push_back(at::constant_pad_nd(rows, {0, 0, keep - take, 0}).t());
    start += len;
  }
  return at::stack(states, 0);
}

at::Tensor CausalConv1dStep(const at::Tensor& x, const at::Tensor& weight, at::Tensor& state) {
  const int64_t channels = x.size(1), kernel = weight.size(-1);
  const at::Tensor window = at::cat({state.to(x.scalar_type()), x.unsqueeze(-1)}, -1);  // [B, C, K]
  const at::Tensor w = weight.reshape({1, channels, kernel}).to(x.scalar_type());
  state = window.narrow(-1, 1, kernel - 1).contiguous();
  return TailFree((window * w).sum(-1), [](const at::Tensor& t) { return at::silu(t); });
}

at::Tensor ChunkGatedDeltaRule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& g, const at::Tensor& beta,
                               const std::vector<int64_t>& seq_lens,
                               const std::vector<int64_t>& seq_groups, at::Tensor* final_states) {
  const int64_t nv = v.size(1);
  at::Tensor query = L2Norm(RepeatHeads(q, nv).to(at::kFloat));
  const at::Tensor key = L2Norm(RepeatHeads(k, nv).to(at::kFloat));
  query = query * std::pow(static_cast<double>(q.size(2)), -0.5);
  const at::Tensor value = v.to(at::kFloat);
  const at::Tensor beta_f = beta.to(at::kFloat);
  const at::Tensor g_f = g.to(at::kFloat);

  std::vector<at::Tensor> outputs, finals;
  const size_t count = seq_lens.size();
  int64_t row = 0;
  for (size_t i = 0; i < count;) {
    // A run: consecutive sequences of one group with the same number of chunks.
    const int64_t chunks = (seq_lens[i] + kChunk - 1) / kChunk;
    size_t j = i;
    while (j < count && (seq_lens[j] + kChunk - 1) / kChunk == chunks &&
           (seq_groups.empty() || seq_groups[j] == seq_groups[i])) {
      ++j;
    }
    const int64_t padded = chunks * kChunk;
    std::vector<at::Tensor> qs, ks, vs, gs, bs;
    int64_t r = row;
    for (size_t s = i; s < j; ++s) {
      const int64_t len = seq_lens[s], pad = padded - len;
      auto rows3 = [&](const at::Tensor& t) {
        return at::constant_pad_nd(t.narrow(0, r, len), {0, 0, 0, 0, 0, pad});
      };
      auto rows2 = [&](const at::Tensor& t) {
        return at::constant_pad_nd(t.narrow(0, r, len), {0, 0, 0, pad});
      };
      qs.push_back(rows3(query));
      ks.push_back(rows3(key));
      vs.push_back(rows3(value));
      gs.push_back(rows2(g_f));
      bs.push_back(rows2(beta_f));
      r += len;
    }
    // [B, Lp, H, D] -> [B, H, Lp, D], as transformers lays them out.
    auto batch = [](const std::vector<at::Tensor>& parts) {
      return at::stack(parts, 0).transpose(1, 2).contiguous();
    };
    auto [out, state] = ChunkRule(batch(qs), batch(ks), batch(vs), batch(gs), batch(bs));
    const at::Tensor rows_first = out.transpose(1, 2);  // [B, Lp, H, dv]
    for (size_t s = i; s < j; ++s) {
      outputs.push_back(rows_first.select(0, static_cast<int64_t>(s - i)).narrow(0, 0, seq_lens[s]));
    }
    if (final_states != nullptr) finals.push_back(state);
    row = r;
    i = j;
  }
  if (final_states != nullptr) *final_states = at::cat(finals, 0);
  const at::Tensor joined = outputs.size() == 1 ? outputs[0] : at::cat(outputs, 0);
  return joined.to(q.scalar_type());
}

at::Tensor RecurrentGatedDeltaStep(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& g, const at::Tensor& beta, at::Tensor& state) {
  const int64_t nv = v.size(1);
  at::Tensor query = L2Norm(RepeatHeads(q, nv).to(at::kFloat));
  const at::Tensor key = L2Norm(RepeatHeads(k, nv).to(at::kFloat));
  // torch_recurrent_gated_delta_rule divides (the chunked form multiplies by dk^-1/2).
  query = query / std::pow(static_cast<double>(q.size(2)), 0.5);
  at::Tensor s = state * g.to(at::kFloat).exp().unsqueeze(-1).unsqueeze(-1);
  const at::Tensor kv_mem = (s * key.unsqueeze(-1)).sum(-2);
  const at::Tensor delta = (v.to(at::kFloat) - kv_mem) * beta.to(at::kFloat).unsqueeze(-1);
  s = s + key.unsqueeze(-1) * delta.unsqueeze(-2);
  state = s;
  return (s * query.unsqueeze(-1)).sum(-2).to(q.scalar_type());
}

at::Tensor GatedRmsNorm(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight,
                        double eps) {
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor variance = xf.pow(2).mean(-1, /*keepdim=*/true);
  const at::Tensor normed = weight * (xf * at::rsqrt(variance + eps)).to(x.scalar_type());
  const at::Tensor act = TailFree(gate.to(at::kFloat), [](const at::Tensor& t) { return at::silu(t); });
  return (normed * act).to(x.scalar_type());
}

}  // namespace twinkle::engine
