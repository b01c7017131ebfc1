#include "core/engine/model/decoder.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/paged_attention.h"

namespace twinkle::engine {
namespace {

at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// See TargetLogprobs. Saves the logits, the targets and the row log-sum-exps.
class TargetLogprobsFn : public torch::autograd::Function<TargetLogprobsFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& targets) {
    const at::Tensor lse = at::logsumexp(logits, {-1});
    const at::Tensor picked = logits.gather(1, targets.unsqueeze(1)).squeeze(1);
    ctx->save_for_backward({logits, targets, lse});
    return picked - lse;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const c10::NoGradGuard no_grad;
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor& logits = saved[0];
    const at::Tensor& targets = saved[1];
    const at::Tensor& lse = saved[2];
    const at::Tensor g = grads[0].unsqueeze(1);
    // d/dlogits of (logit[t] - lse) = onehot(t) - softmax; the softmax part is what autograd's
    // logsumexp backward computes, grad · exp(logits - lse), here in place in one buffer.
    at::Tensor out = at::sub(logits, lse.unsqueeze(1));
    out.exp_().mul_(-g);
    out.scatter_add_(1, targets.unsqueeze(1), g);
    return {out, at::Tensor()};
  }
};

// Causal attention within runs of rows, as one autograd node. Run r is count_r sequences of
// length len_r, rows_r = count_r · len_r rows in a row: its q/k/v rows, viewed as
// [count, heads, len, d], go to the CPU flash-attention kernel (the one
// at::scaled_dot_product_attention picks here, with the same arguments, GQA included), and
// backward calls that kernel's backward per run. As one node, a run costs its kernel calls
// and a few views, not ten autograd nodes (views, transposes, the SDPA node, a split and a
// cat around them).
class PackedAttentionFn : public torch::autograd::Function<PackedAttentionFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v,
                            const std::vector<int64_t>& run_rows,
                            const std::vector<int64_t>& run_lens) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    const int64_t heads = q.size(1), d = q.size(2);
    torch::autograd::variable_list saved{q, k, v};
    std::vector<at::Tensor> outputs;
    int64_t start = 0;
    for (size_t r = 0; r < run_rows.size(); ++r) {
      auto [o, lse] = at::_scaled_dot_product_flash_attention_for_cpu(
          Block(q, start, run_rows[r], run_lens[r]), Block(k, start, run_rows[r], run_lens[r]),
          Block(v, start, run_rows[r], run_lens[r]), 0.0, /*is_causal=*/true);
      outputs.push_back(o.transpose(1, 2).reshape({run_rows[r], heads * d}));
      saved.push_back(o);
      saved.push_back(lse);
      start += run_rows[r];
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["rows"] = run_rows;
    ctx->saved_data["lens"] = run_lens;
    return outputs.size() == 1 ? outputs[0] : at::cat(outputs, 0);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const c10::NoGradGuard no_grad;
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    const std::vector<int64_t> run_rows = ctx->saved_data["rows"].toIntVector();
    const std::vector<int64_t> run_lens = ctx->saved_data["lens"].toIntVector();
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2];
    const int64_t heads = q.size(1), d = q.size(2);
    const at::Tensor g = grads[0].contiguous();
    std::vector<at::Tensor> gq, gk, gv;
    int64_t start = 0;
    for (size_t r = 0; r < run_rows.size(); ++r) {
      const int64_t rows = run_rows[r], len = run_lens[r];
      const at::Tensor go = g.narrow(0, start, rows).view({rows / len, len, heads, d}).transpose(1, 2);
      auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
          go, Block(q, start, rows, len), Block(k, start, rows, len), Block(v, start, rows, len),
          saved[3 + 2 * r], saved[4 + 2 * r], 0.0, /*is_causal=*/true);
      gq.push_back(dq.transpose(1, 2).reshape({rows, q.size(1), d}));
      gk.push_back(dk.transpose(1, 2).reshape({rows, k.size(1), d}));
      gv.push_back(dv.transpose(1, 2).reshape({rows, v.size(1), d}));
      start += rows;
    }
    auto join = [](const std::vector<at::Tensor>& parts) {
      return parts.size() == 1 ? parts[0] : at::cat(parts, 0);
    };
    return {join(gq), join(gk), join(gv), at::Tensor(), at::Tensor()};
  }

 private:
  // Rows [start, start + rows) of t [N, heads, d] as [count, heads, len, d].
  static at::Tensor Block(const at::Tensor& t, int64_t start, int64_t rows, int64_t len) {
    return t.narrow(0, start, rows).view({rows / len, len, t.size(1), t.size(2)}).transpose(1, 2);
  }
};

}  // namespace

at::Tensor TargetLogprobs(const at::Tensor& logits, const at::Tensor& targets) {
  return TargetLogprobsFn::apply(logits, targets);
}

const char* LinearKindName(LinearKind kind) {
  switch (kind) {
    case LinearKind::kQ: return "q_proj";
    case LinearKind::kK: return "k_proj";
    case LinearKind::kV: return "v_proj";
    case LinearKind::kO: return "o_proj";
    case LinearKind::kGate: return "gate_proj";
    case LinearKind::kUp: return "up_proj";
    case LinearKind::kDown: return "down_proj";
    case LinearKind::kLmHead: return "lm_head";
  }
  return "?";
}

at::Tensor RopeInverseFrequencies(const ModelConfig& c) {
  const int64_t dim = c.head_dim;
  // transformers: 1 / base ** (arange(0, dim, 2, int64).float() / dim), in float32.
  at::Tensor exponents = at::arange(0, dim, 2, at::kLong).to(at::kFloat) / static_cast<float>(dim);
  at::Tensor inv_freq = 1.0 / at::pow(static_cast<float>(c.rope_theta), exponents);
  const RopeScaling& s = c.rope_scaling;
  if (s.type == RopeScalingType::kLinear) {
    inv_freq = inv_freq / static_cast<float>(s.factor);
  } else if (s.type == RopeScalingType::kLlama3) {
    // transformers' _compute_llama3_parameters, step by step.
    const double low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
    const double high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
    at::Tensor wavelen = 2 * M_PI / inv_freq;
    at::Tensor scaled = at::where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq);
    at::Tensor smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) /
                        (s.high_freq_factor - s.low_freq_factor);
    at::Tensor smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
    at::Tensor is_medium = (wavelen >= high_freq_wavelen).logical_and(wavelen <= low_freq_wavelen);
    inv_freq = at::where(is_medium, smoothed, scaled);
  }
  return inv_freq.to(at::kFloat);
}

DecoderModel::DecoderModel(ModelConfig config, std::map<std::string, at::Tensor> w)
    : config_(std::move(config)) {
  embed_ = w.at("model.embed_tokens.weight");
  final_norm_ = w.at("model.norm.weight");
  lm_head_ = config_.tie_word_embeddings ? embed_ : w.at("lm_head.weight");
  for (int64_t i = 0; i < config_.num_hidden_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    Layer layer;
    layer.input_norm = w.at(p + "input_layernorm.weight");
    layer.post_norm = w.at(p + "post_attention_layernorm.weight");
    if (config_.qk_norm) {
      layer.q_norm = w.at(p + "self_attn.q_norm.weight");
      layer.k_norm = w.at(p + "self_attn.k_norm.weight");
    }
    for (LinearKind kind : kAllLinearKinds) {
      const bool attn = kind == LinearKind::kQ || kind == LinearKind::kK ||
                        kind == LinearKind::kV || kind == LinearKind::kO;
      const std::string name = p + (attn ? "self_attn." : "mlp.") + LinearKindName(kind);
      layer.weight[kind] = w.at(name + ".weight");
      auto bias = w.find(name + ".bias");
      if (bias != w.end()) layer.bias[kind] = bias->second;
    }
    layers_.push_back(std::move(layer));
  }
  inv_freq_ = RopeInverseFrequencies(config_).to(embed_.device());
}

std::pair<int64_t, int64_t> DecoderModel::LinearShape(LinearKind kind) const {
  if (kind == LinearKind::kLmHead) return {lm_head_.size(1), lm_head_.size(0)};
  const at::Tensor& w = layers_.front().weight.at(kind);
  return {w.size(1), w.size(0)};
}

at::Tensor DecoderModel::RmsNorm(const at::Tensor& x, const at::Tensor& weight) const {
  // As transformers: normalise in float32, cast back, then scale.
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor variance = xf.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (xf * at::rsqrt(variance + config_.rms_norm_eps)).to(x.scalar_type());
}

at::Tensor DecoderModel::Linear(const Layer& layer, int64_t index, LinearKind kind,
                                const at::Tensor& x, const LoraSegmentsFn& lora) const {
  auto bias = layer.bias.find(kind);
  at::Tensor y = at::linear(x, layer.weight.at(kind),
                            bias == layer.bias.end() ? at::Tensor() : bias->second);
  if (lora) {
    std::vector<kernels::LoraSegment> segments = lora(index, kind, x);
    if (!segments.empty()) y = y + kernels::LoraDelta(x, y.size(-1), segments);
  }
  return y;
}

DecoderModel::Qkv DecoderModel::ProjectQkv(const Layer& layer, int64_t index, const at::Tensor& h,
                                           const at::Tensor& cos, const at::Tensor& sin,
                                           const LoraSegmentsFn& lora) const {
  const int64_t n = h.size(0);
  const int64_t heads = config_.num_attention_heads, kv_heads = config_.num_key_value_heads;
  const int64_t d = config_.head_dim;
  at::Tensor q = Linear(layer, index, LinearKind::kQ, h, lora).view({n, heads, d});
  at::Tensor k = Linear(layer, index, LinearKind::kK, h, lora).view({n, kv_heads, d});
  at::Tensor v = Linear(layer, index, LinearKind::kV, h, lora).view({n, kv_heads, d});
  if (config_.qk_norm) {
    q = RmsNorm(q, layer.q_norm);
    k = RmsNorm(k, layer.k_norm);
  }
  // cos/sin: [N, d] -> broadcast over heads.
  const at::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);
  q = q * c + RotateHalf(q) * s;
  k = k * c + RotateHalf(k) * s;
  return {q, k, v};
}

std::pair<at::Tensor, at::Tensor> DecoderModel::Rope(const at::Tensor& pos) const {
  const at::Tensor freqs = pos.unsqueeze(1) * inv_freq_.unsqueeze(0);
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos().to(embed_.scalar_type()), emb.sin().to(embed_.scalar_type())};
}

at::Tensor DecoderModel::Attention(const Layer& layer, int64_t index, const at::Tensor& h,
                                   const std::vector<int64_t>& seq_lens,
                                   const std::vector<int64_t>& seq_groups, const at::Tensor& cos,
                                   const at::Tensor& sin, const LoraSegmentsFn& lora) const {
  const int64_t heads = config_.num_attention_heads, kv_heads = config_.num_key_value_heads;
  const int64_t d = config_.head_dim;
  auto [q, k, v] = ProjectQkv(layer, index, h, cos, sin, lora);
  // Attention within each sequence, causal. Runs of consecutive sequences of equal length in
  // the same group share one kernel call as a [B, heads, L, d] batch (a padded batch would not
  // be exact). Runs never cross groups (ops): the kernel's blocking may depend on the batch,
  // and a tenant's numbers must not depend on who else is in the fused pass.
  // GQA is handled by the kernel itself, without copying k/v per head group. On CPU the runs
  // form one autograd node (PackedAttentionFn).
  std::vector<int64_t> run_rows, run_lens;
  for (size_t i = 0; i < seq_lens.size();) {
    const int64_t len = seq_lens[i];
    size_t j = i;
    while (j < seq_lens.size() && seq_lens[j] == len &&
           (seq_groups.empty() || seq_groups[j] == seq_groups[i])) {
      ++j;
    }
    run_rows.push_back(static_cast<int64_t>(j - i) * len);
    run_lens.push_back(len);
    i = j;
  }
  at::Tensor attn;
  if (q.is_cpu()) {
    attn = PackedAttentionFn::apply(q.contiguous(), k.contiguous(), v.contiguous(), run_rows,
                                    run_lens);
  } else {
    // Elsewhere SDPA picks the device's kernel. One split per tensor rather than a narrow per
    // run: autograd then has one node that concatenates the runs' gradients, instead of a
    // full-size zero-filled gradient per run summed up (quadratic in the number of runs).
    const bool single = run_rows.size() == 1;
    const std::vector<at::Tensor> qs = single ? std::vector<at::Tensor>{q} : q.split_with_sizes(run_rows);
    const std::vector<at::Tensor> ks = single ? std::vector<at::Tensor>{k} : k.split_with_sizes(run_rows);
    const std::vector<at::Tensor> vs = single ? std::vector<at::Tensor>{v} : v.split_with_sizes(run_rows);
    std::vector<at::Tensor> outputs;
    outputs.reserve(run_rows.size());
    for (size_t r = 0; r < run_rows.size(); ++r) {
      const int64_t len = run_lens[r], count = run_rows[r] / len;
      auto block = [&](const at::Tensor& t) { return t.view({count, len, t.size(1), d}).transpose(1, 2); };
      at::Tensor o = at::scaled_dot_product_attention(block(qs[r]), block(ks[r]), block(vs[r]), {}, 0.0,
                                                      /*is_causal=*/true, /*scale=*/std::nullopt,
                                                      /*enable_gqa=*/kv_heads != heads);
      outputs.push_back(o.transpose(1, 2).reshape({run_rows[r], heads * d}));
    }
    attn = single ? outputs[0] : at::cat(outputs, 0);
  }
  return Linear(layer, index, LinearKind::kO, attn, lora);
}

at::Tensor DecoderModel::Forward(const at::Tensor& tokens, const std::vector<int64_t>& seq_lens,
                                 const std::vector<int64_t>& seq_groups,
                                 const LoraSegmentsFn& lora) const {
  // Positions restart at 0 in every sequence; angles in float32 as transformers computes them.
  std::vector<at::Tensor> positions;
  for (int64_t len : seq_lens) positions.push_back(at::arange(len, at::kLong));
  const at::Tensor pos = at::cat(positions).to(inv_freq_.device()).to(at::kFloat);
  const auto [cos, sin] = Rope(pos);

  at::Tensor x = at::embedding(embed_, tokens.to(embed_.device()));
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& layer = layers_[i];
    const int64_t index = static_cast<int64_t>(i);
    x = x + Attention(layer, index, RmsNorm(x, layer.input_norm), seq_lens, seq_groups, cos, sin,
                      lora);
    const at::Tensor h = RmsNorm(x, layer.post_norm);
    const at::Tensor gated = at::silu(Linear(layer, index, LinearKind::kGate, h, lora)) *
                             Linear(layer, index, LinearKind::kUp, h, lora);
    x = x + Linear(layer, index, LinearKind::kDown, gated, lora);
  }
  // lm_head LoRA as PEFT applies it, also with tied embeddings: the delta is added to the
  // logits only; the (shared) embedding lookup above never sees it.
  const at::Tensor h = RmsNorm(x, final_norm_);
  at::Tensor logits = at::linear(h, lm_head_);
  if (lora) {
    std::vector<kernels::LoraSegment> segments = lora(0, LinearKind::kLmHead, h);
    if (!segments.empty()) logits = logits + kernels::LoraDelta(h, logits.size(-1), segments);
  }
  return logits.to(at::kFloat);
}

at::Tensor DecoderModel::PagedAttention(const Layer& layer, int64_t index, const at::Tensor& h,
                                        const std::vector<PagedSequence>& seqs, PagedKv& kv,
                                        const at::Tensor& slots, const at::Tensor& cos,
                                        const at::Tensor& sin, const LoraSegmentsFn& lora) const {
  const int64_t n = h.size(0);
  const int64_t heads = config_.num_attention_heads, kv_heads = config_.num_key_value_heads;
  const int64_t d = config_.head_dim;
  auto [q, k, v] = ProjectQkv(layer, index, h, cos, sin, lora);
  // The new keys and values go to their slots first: a decode step attends to itself too.
  const at::Tensor& kc = kv.k[index];
  const at::Tensor& vc = kv.v[index];
  kc.view({-1, kv_heads, d}).index_copy_(0, slots, k.to(kc.scalar_type()));
  vc.view({-1, kv_heads, d}).index_copy_(0, slots, v.to(vc.scalar_type()));

  auto decode_view = [](const PagedSequence& s) {
    return kernels::PagedSequenceView{s.blocks->data(), s.past + 1};
  };
  bool all_decode = true;
  for (const PagedSequence& s : seqs) all_decode = all_decode && s.past > 0 && s.count == 1;
  at::Tensor attn;
  if (all_decode) {
    std::vector<kernels::PagedSequenceView> views;
    views.reserve(seqs.size());
    for (const PagedSequence& s : seqs) views.push_back(decode_view(s));
    attn = kernels::PagedDecodeAttention(q, kc, vc, views).view({n, heads * d});
  } else {
    // Per sequence: a prefill attends causally within its own fresh rows (the training
    // forward's SDPA call, per sequence), a decode row reads its cache.
    std::vector<at::Tensor> outputs;
    outputs.reserve(seqs.size());
    int64_t row = 0;
    for (const PagedSequence& s : seqs) {
      TORCH_CHECK(s.past == 0 || s.count == 1,
                  "ForwardPaged: new tokens after cached ones come one at a time (no chunked prefill)");
      const at::Tensor qs = q.narrow(0, row, s.count);
      if (s.past == 0) {
        auto block = [](const at::Tensor& t) { return t.unsqueeze(0).transpose(1, 2); };
        const at::Tensor o = at::scaled_dot_product_attention(
            block(qs), block(k.narrow(0, row, s.count)), block(v.narrow(0, row, s.count)), {},
            0.0, /*is_causal=*/s.count > 1, /*scale=*/std::nullopt,
            /*enable_gqa=*/kv_heads != heads);
        outputs.push_back(o.transpose(1, 2).reshape({s.count, heads * d}));
      } else {
        outputs.push_back(
            kernels::PagedDecodeAttention(qs, kc, vc, {decode_view(s)}).view({1, heads * d}));
      }
      row += s.count;
    }
    attn = outputs.size() == 1 ? outputs[0] : at::cat(outputs, 0);
  }
  return Linear(layer, index, LinearKind::kO, attn, lora);
}

at::Tensor DecoderModel::ForwardPaged(const at::Tensor& tokens,
                                      const std::vector<PagedSequence>& seqs, PagedKv& kv,
                                      const std::vector<int64_t>* logit_rows,
                                      const LoraSegmentsFn& lora) const {
  TORCH_CHECK(kv.block_size > 0 && kv.k.size() == layers_.size() && kv.v.size() == layers_.size(),
              "ForwardPaged: the KV cache does not fit the model");
  // Positions continue each sequence; each new token's slot in the cache.
  const int64_t block_size = kv.block_size;
  std::vector<float> positions;
  std::vector<int64_t> slots;
  for (const PagedSequence& s : seqs) {
    TORCH_CHECK(s.blocks != nullptr && s.count >= 1 &&
                    (s.past + s.count + block_size - 1) / block_size <=
                        static_cast<int64_t>(s.blocks->size()),
                "ForwardPaged: a sequence's blocks do not cover its tokens");
    for (int64_t t = s.past; t < s.past + s.count; ++t) {
      positions.push_back(static_cast<float>(t));
      slots.push_back((*s.blocks)[t / block_size] * block_size + t % block_size);
    }
  }
  const int64_t n = static_cast<int64_t>(slots.size());
  TORCH_CHECK(tokens.dim() == 1 && tokens.size(0) == n, "ForwardPaged: ", tokens.sizes(),
              " tokens for ", n, " new positions");
  const c10::Device device = embed_.device();
  const at::Tensor pos = at::from_blob(positions.data(), {n}, at::kFloat).to(device, /*non_blocking=*/false, /*copy=*/true);
  const at::Tensor slot = at::from_blob(slots.data(), {n}, at::kLong).to(device, false, true);
  const auto [cos, sin] = Rope(pos);

  at::Tensor x = at::embedding(embed_, tokens.to(device));
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& layer = layers_[i];
    const int64_t index = static_cast<int64_t>(i);
    x = x + PagedAttention(layer, index, RmsNorm(x, layer.input_norm), seqs, kv, slot, cos, sin,
                           lora);
    const at::Tensor h = RmsNorm(x, layer.post_norm);
    const at::Tensor gated = at::silu(Linear(layer, index, LinearKind::kGate, h, lora)) *
                             Linear(layer, index, LinearKind::kUp, h, lora);
    x = x + Linear(layer, index, LinearKind::kDown, gated, lora);
  }
  // Only the rows whose logits are wanted go through the final norm and lm_head; the
  // lm_head LoRA segments (over the N packed rows) are mapped onto the kept rows.
  std::function<int64_t(int64_t)> kept = [](int64_t row) { return row; };
  if (logit_rows != nullptr) {
    TORCH_CHECK(std::is_sorted(logit_rows->begin(), logit_rows->end()) &&
                    (logit_rows->empty() || (logit_rows->front() >= 0 && logit_rows->back() < n)),
                "ForwardPaged: logit_rows must be sorted and inside [0, ", n, ")");
    const at::Tensor index = at::from_blob(const_cast<int64_t*>(logit_rows->data()),
                                           {static_cast<int64_t>(logit_rows->size())}, at::kLong)
                                 .to(device, false, true);
    x = x.index_select(0, index);
    kept = [logit_rows](int64_t row) {
      return static_cast<int64_t>(
          std::lower_bound(logit_rows->begin(), logit_rows->end(), row) - logit_rows->begin());
    };
  }
  const at::Tensor h = RmsNorm(x, final_norm_);
  at::Tensor logits = at::linear(h, lm_head_);
  if (lora) {
    std::vector<kernels::LoraSegment> segments = lora(0, LinearKind::kLmHead, h);
    std::vector<kernels::LoraSegment> mapped;
    for (kernels::LoraSegment& s : segments) {
      TORCH_CHECK(!s.x.defined(), "ForwardPaged: LoRA segments with their own input (dropout)");
      s.row_begin = kept(s.row_begin);
      s.row_end = kept(s.row_end);
      if (s.row_end > s.row_begin) mapped.push_back(std::move(s));
    }
    if (!mapped.empty()) logits = logits + kernels::LoraDelta(h, logits.size(-1), mapped);
  }
  return logits.to(at::kFloat);
}

}  // namespace twinkle::engine
