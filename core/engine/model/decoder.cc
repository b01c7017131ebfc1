#include "core/engine/model/decoder.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "absl/strings/str_cat.h"
#include "core/engine/model/gated_deltanet.h"
#include "kernels/paged_attention.h"

namespace twinkle::engine {
namespace {

at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// The row chunks and lm_head LoRA segments of one ChunkedLogprobsFn call: everything that
// is not a tensor. Kept in the context as IValue lists for backward.
struct LogitPlan {
  std::vector<int64_t> chunk_begin, chunk_end;
  std::vector<int64_t> seg_begin, seg_end;
  std::vector<int64_t> seg_own;  // index into own_x of the segment's own input, or -1
  std::vector<double> seg_scale;
  // forward_backward (grad mode on at the call): the forward computes each chunk's LoRA term
  // through LoraDelta's autograd path, the one backward's recompute takes, so the recomputed
  // logits are bit for bit those of the forward (a no-grad `forward` takes the inference path,
  // as before).
  bool training = false;
};

// A segment's own input (LoRA dropout) restricted to a chunk: which own_x, and where.
struct OwnRows {
  int64_t own = 0, offset = 0;
  at::Tensor leaf;  // backward: the detached rows whose gradient is read back
};

// The lm_head LoRA segments over rows [c0, c1), in chunk-local rows. With `leaves`, each own
// input's rows become a fresh leaf that requires grad (recorded there), for backward.
std::vector<kernels::LoraSegment> ChunkSegments(const LogitPlan& plan, at::TensorList a,
                                                at::TensorList b, at::TensorList own_x,
                                                int64_t c0, int64_t c1,
                                                std::vector<OwnRows>* leaves) {
  std::vector<kernels::LoraSegment> segments;
  for (size_t s = 0; s < plan.seg_begin.size(); ++s) {
    const int64_t lo = std::max(plan.seg_begin[s], c0), hi = std::min(plan.seg_end[s], c1);
    if (lo >= hi) continue;
    kernels::LoraSegment seg{lo - c0, hi - c0, a[s], b[s], plan.seg_scale[s], {}};
    if (plan.seg_own[s] >= 0) {
      const int64_t own = plan.seg_own[s], offset = lo - plan.seg_begin[s];
      seg.x = own_x[own].narrow(0, offset, hi - lo);
      if (leaves != nullptr) {
        seg.x = seg.x.detach().requires_grad_(true);
        leaves->push_back(OwnRows{own, offset, seg.x});
      }
    }
    segments.push_back(std::move(seg));
  }
  return segments;
}

// float32 logits of the rows hc: lm_head, plus the LoRA segments' term (as Forward did).
at::Tensor ChunkLogits(const at::Tensor& hc, const at::Tensor& weight,
                       const std::vector<kernels::LoraSegment>& segments) {
  at::Tensor logits = at::linear(hc, weight);
  if (!segments.empty()) logits = logits + kernels::LoraDelta(hc, logits.size(-1), segments);
  return logits.to(at::kFloat);
}

// logits[i, t_i] - lse_i ([N]), or per column of [N, K] targets.
at::Tensor PickLogprobs(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse) {
  if (targets.dim() == 2) return logits.gather(1, targets) - lse.unsqueeze(1);  // [N, K]
  const at::Tensor picked = logits.gather(1, targets.unsqueeze(1)).squeeze(1);
  return picked - lse;
}

// d/dlogits of Σ g · (logit[t] - lse) = g · (onehot(t) - softmax): the softmax part is what
// autograd's logsumexp backward computes, g · exp(logits - lse), here in place in one buffer.
// [N, K] targets: the softmax part is weighted by each row's Σ_k g.
at::Tensor LogitsGrad(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                      const at::Tensor& g) {
  at::Tensor out = at::sub(logits, lse.unsqueeze(1));
  if (targets.dim() == 2) {
    out.exp_().mul_(-g.sum(1, /*keepdim=*/true));
    out.scatter_add_(1, targets, g);
    return out;
  }
  const at::Tensor g1 = g.unsqueeze(1);
  out.exp_().mul_(-g1);
  out.scatter_add_(1, targets.unsqueeze(1), g1);
  return out;
}

// See DecoderModel::TargetLogprobs. Saves the hidden states, the targets and the rows'
// log-sum-exps, never logits: backward recomputes each chunk's logits (lm_head GEMM and LoRA
// term), turns them into the chunk's logit gradient and backpropagates that through the
// recomputed chunk (a reentrant autograd call), so at most one chunk of [rows, vocab] exists
// at a time, forward or backward. The lm_head LoRA weights are inputs only so the output
// requires grad when they do; the recompute's LoRA node accumulates their gradients.
class ChunkedLogprobsFn : public torch::autograd::Function<ChunkedLogprobsFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& h,
                            const at::Tensor& weight, const at::Tensor& targets,
                            at::TensorList a, at::TensorList b, at::TensorList own_x,
                            const LogitPlan& plan, at::Tensor* logits_out) {
    at::Tensor lse;
    at::Tensor out = Run(h, weight, targets, a, b, own_x, plan, logits_out, &lse);
    torch::autograd::variable_list saved{h, weight, targets, lse};
    saved.insert(saved.end(), a.begin(), a.end());
    saved.insert(saved.end(), b.begin(), b.end());
    saved.insert(saved.end(), own_x.begin(), own_x.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["chunk_begin"] = plan.chunk_begin;
    ctx->saved_data["chunk_end"] = plan.chunk_end;
    ctx->saved_data["seg_begin"] = plan.seg_begin;
    ctx->saved_data["seg_end"] = plan.seg_end;
    ctx->saved_data["seg_own"] = plan.seg_own;
    ctx->saved_data["seg_scale"] = plan.seg_scale;
    return out;
  }

  // The forward pass over the chunks (also the no-grad path): log-probs, and the rows'
  // log-sum-exps in *lse; the full logits only when logits_out asks for them.
  static at::Tensor Run(const at::Tensor& h_in, const at::Tensor& weight, const at::Tensor& targets,
                        at::TensorList a, at::TensorList b, at::TensorList own_x,
                        const LogitPlan& plan, at::Tensor* logits_out, at::Tensor* lse) {
    const at::Tensor h = h_in.detach();
    const int64_t n = h.size(0), vocab = weight.size(0);
    const at::TensorOptions f32 = h.options().dtype(at::kFloat);
    at::Tensor out = targets.dim() == 2 ? at::empty({n, targets.size(1)}, f32) : at::empty({n}, f32);
    *lse = at::empty({n}, f32);
    if (logits_out != nullptr) *logits_out = at::empty({n, vocab}, f32);
    for (size_t c = 0; c < plan.chunk_begin.size(); ++c) {
      const int64_t c0 = plan.chunk_begin[c], rows = plan.chunk_end[c] - c0;
      at::Tensor logits;
      {
        std::optional<at::AutoGradMode> grad;
        if (plan.training) grad.emplace(true);
        logits = ChunkLogits(h.narrow(0, c0, rows), weight,
                             ChunkSegments(plan, a, b, own_x, c0, c0 + rows, nullptr))
                     .detach();
      }
      const at::Tensor chunk_lse = at::logsumexp(logits, {-1});
      lse->narrow(0, c0, rows).copy_(chunk_lse);
      out.narrow(0, c0, rows).copy_(PickLogprobs(logits, targets.narrow(0, c0, rows), chunk_lse));
      if (logits_out != nullptr) logits_out->narrow(0, c0, rows).copy_(logits);
    }
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    LogitPlan plan;
    plan.chunk_begin = ctx->saved_data["chunk_begin"].toIntVector();
    plan.chunk_end = ctx->saved_data["chunk_end"].toIntVector();
    plan.seg_begin = ctx->saved_data["seg_begin"].toIntVector();
    plan.seg_end = ctx->saved_data["seg_end"].toIntVector();
    plan.seg_own = ctx->saved_data["seg_own"].toIntVector();
    plan.seg_scale = ctx->saved_data["seg_scale"].toDoubleVector();
    plan.training = true;
    const size_t num_segments = plan.seg_begin.size();
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor &h = saved[0], &weight = saved[1], &targets = saved[2], &lse = saved[3];
    const at::TensorList a(saved.data() + 4, num_segments);
    const at::TensorList b(saved.data() + 4 + num_segments, num_segments);
    const size_t num_own = saved.size() - 4 - 2 * num_segments;
    const at::TensorList own_x(saved.data() + 4 + 2 * num_segments, num_own);
    const size_t own_in = 3 + 2 * num_segments;  // own_x's first index among the inputs

    const bool need_h = ctx->needs_input_grad(0);
    at::Tensor dh = need_h ? at::empty_like(h, at::MemoryFormat::Contiguous) : at::Tensor();
    std::vector<at::Tensor> d_own(num_own);
    for (size_t j = 0; j < num_own; ++j) {
      if (ctx->needs_input_grad(own_in + j)) d_own[j] = at::zeros_like(own_x[j]);
    }
    const at::Tensor& g = grads[0];
    const at::AutoGradMode grad_on(true);
    for (size_t c = 0; c < plan.chunk_begin.size(); ++c) {
      const int64_t c0 = plan.chunk_begin[c], rows = plan.chunk_end[c] - c0;
      at::Tensor hc = h.narrow(0, c0, rows).detach();
      if (need_h) hc.requires_grad_(true);
      std::vector<OwnRows> leaves;
      const at::Tensor logits =
          ChunkLogits(hc, weight, ChunkSegments(plan, a, b, own_x, c0, c0 + rows, &leaves));
      if (!logits.requires_grad()) continue;  // neither h nor a LoRA weight reaches these rows
      at::Tensor dl;
      {
        const c10::NoGradGuard no_grad;
        dl = LogitsGrad(logits.detach(), targets.narrow(0, c0, rows), lse.narrow(0, c0, rows),
                        g.narrow(0, c0, rows));
      }
      torch::autograd::backward({logits}, {dl});
      const c10::NoGradGuard no_grad;
      if (need_h) dh.narrow(0, c0, rows).copy_(hc.grad());
      for (const OwnRows& l : leaves) {
        if (d_own[l.own].defined() && l.leaf.grad().defined()) {
          d_own[l.own].narrow(0, l.offset, l.leaf.size(0)).copy_(l.leaf.grad());
        }
      }
    }
    torch::autograd::variable_list result{dh, at::Tensor(), at::Tensor()};
    result.resize(result.size() + 2 * num_segments);  // a, b: accumulated by the recompute
    result.insert(result.end(), d_own.begin(), d_own.end());
    result.emplace_back();  // the plan
    result.emplace_back();  // logits_out
    return result;
  }
};

// A decoder layer's forward as a closure over everything but its input (the batch layout,
// RoPE tables, the LoRA callback), for CheckpointedLayerFn's recompute. Held in the autograd
// context as a capsule.
struct LayerRun : torch::CustomClassHolder {
  std::function<at::Tensor(const at::Tensor&)> run;
};

// One scalar leaf per thread that requires grad: an input of every checkpointed layer, so a
// layer's output requires grad even when its input does not (the first layer's input is the
// frozen embedding's output) and only its LoRA weights train. It never gets a gradient.
const at::Tensor& CheckpointAnchor() {
  thread_local const at::Tensor anchor = at::zeros({}, at::kFloat).requires_grad_(true);
  return anchor;
}

// Activation checkpointing of one decoder layer: forward runs the layer on a detached input
// and keeps only that input (the layer's own activations are freed as soon as it returns);
// backward runs the layer again from it with autograd on and backpropagates the incoming
// gradient through the recomputed graph (a reentrant autograd call), which hands the input
// its gradient and accumulates the layer's LoRA gradients. The forward also runs with
// autograd on, so both runs take the same kernels (LoraDelta's training path) and the
// recomputed activations are bit for bit the forward's. LibTorch has no
// torch.utils.checkpoint; this is its reentrant variant.
class CheckpointedLayerFn : public torch::autograd::Function<CheckpointedLayerFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& anchor, const c10::intrusive_ptr<LayerRun>& layer) {
    at::Tensor y;
    {
      const at::AutoGradMode grad_on(true);
      y = layer->run(x.detach()).detach();
    }
    ctx->save_for_backward({x});
    ctx->saved_data["layer"] = c10::IValue::make_capsule(layer);
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const c10::intrusive_ptr<LayerRun> layer =
        c10::static_intrusive_pointer_cast<LayerRun>(ctx->saved_data["layer"].toCapsule());
    const bool need_x = ctx->needs_input_grad(0);
    at::Tensor x = ctx->get_saved_variables()[0].detach();
    if (need_x) x.requires_grad_(true);
    const at::AutoGradMode grad_on(true);
    const at::Tensor y = layer->run(x);
    if (!y.requires_grad()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    torch::autograd::backward({y}, {grads[0]});
    return {need_x ? x.grad() : at::Tensor(), at::Tensor(), at::Tensor()};
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
    case LinearKind::kInProjQkv: return "in_proj_qkv";
    case LinearKind::kInProjZ: return "in_proj_z";
    case LinearKind::kInProjB: return "in_proj_b";
    case LinearKind::kInProjA: return "in_proj_a";
    case LinearKind::kOutProj: return "out_proj";
    case LinearKind::kRouter: return "gate";
    case LinearKind::kExpertsGateUp: return "gate_up_proj";
    case LinearKind::kExpertsDown: return "down_proj";
    case LinearKind::kSharedExpertGate: return "shared_expert_gate";
  }
  return "?";
}

const char* LinearKindModule(LinearKind kind) {
  switch (kind) {
    case LinearKind::kQ:
    case LinearKind::kK:
    case LinearKind::kV:
    case LinearKind::kO: return "self_attn";
    case LinearKind::kGate:
    case LinearKind::kUp:
    case LinearKind::kDown: return "mlp";
    case LinearKind::kLmHead: return "";
    case LinearKind::kInProjQkv:
    case LinearKind::kInProjZ:
    case LinearKind::kInProjB:
    case LinearKind::kInProjA:
    case LinearKind::kOutProj: return "linear_attn";
    case LinearKind::kRouter:
    case LinearKind::kExpertsGateUp:
    case LinearKind::kExpertsDown:
    case LinearKind::kSharedExpertGate: return "mlp";
  }
  return "?";
}

std::string LinearModulePath(const ModelConfig& config, int64_t layer, LinearKind kind) {
  if (kind == LinearKind::kLmHead) return "lm_head";
  const std::string base = absl::StrCat(config.text_prefix, "layers.", layer, ".");
  if (IsExpertKind(kind)) return base + "mlp.experts";
  const bool shared_expert = config.is_moe_layer(layer) && config.shared_expert_intermediate_size > 0 &&
                             (kind == LinearKind::kGate || kind == LinearKind::kUp || kind == LinearKind::kDown);
  return absl::StrCat(base, LinearKindModule(kind), shared_expert ? ".shared_expert." : ".", LinearKindName(kind));
}

at::Tensor RopeInverseFrequencies(const ModelConfig& c) {
  const int64_t dim = c.rotary_dim();
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
    layer.linear_attention = config_.is_linear_layer(i);
    layer.input_norm = w.at(p + "input_layernorm.weight");
    layer.post_norm = w.at(p + "post_attention_layernorm.weight");
    if (layer.linear_attention) {
      const std::string la = p + "linear_attn.";
      layer.conv_weight = w.at(la + "conv1d.weight");
      layer.dt_bias = w.at(la + "dt_bias");
      layer.a_log = w.at(la + "A_log");
      layer.gated_norm = w.at(la + "norm.weight");
    } else if (config_.qk_norm) {
      layer.q_norm = w.at(p + "self_attn.q_norm.weight");
      layer.k_norm = w.at(p + "self_attn.k_norm.weight");
    }
    layer.moe = config_.is_moe_layer(i);
    if (layer.moe) {
      layer.router = w.at(p + "mlp.gate.weight");
      layer.experts_gate_up = w.at(p + "mlp.experts.gate_up_proj");
      layer.experts_down = w.at(p + "mlp.experts.down_proj");
      if (config_.shared_expert_intermediate_size > 0) {
        layer.weight[LinearKind::kGate] = w.at(p + "mlp.shared_expert.gate_proj.weight");
        layer.weight[LinearKind::kUp] = w.at(p + "mlp.shared_expert.up_proj.weight");
        layer.weight[LinearKind::kDown] = w.at(p + "mlp.shared_expert.down_proj.weight");
        layer.weight[LinearKind::kSharedExpertGate] = w.at(p + "mlp.shared_expert_gate.weight");
      }
    }
    for (LinearKind kind : kAllLinearKinds) {
      const std::string module = LinearKindModule(kind);
      if (module == "mlp" && layer.moe) continue;
      if (module != "mlp" && (module == "linear_attn") != layer.linear_attention) continue;
      const std::string name = p + module + "." + LinearKindName(kind);
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
  for (const Layer& layer : layers_) {
    if (!layer.moe) continue;
    if (kind == LinearKind::kRouter) return {layer.router.size(1), layer.router.size(0)};
    if (kind == LinearKind::kExpertsGateUp) return {layer.experts_gate_up.size(2), layer.experts_gate_up.size(1)};
    if (kind == LinearKind::kExpertsDown) return {layer.experts_down.size(2), layer.experts_down.size(1)};
  }
  for (const Layer& layer : layers_) {
    auto it = layer.weight.find(kind);
    if (it != layer.weight.end()) return {it->second.size(1), it->second.size(0)};
  }
  return {0, 0};
}

bool DecoderModel::HasLinear(int64_t layer, LinearKind kind) const {
  if (kind == LinearKind::kLmHead) return layer == 0;
  if (layer < 0 || layer >= static_cast<int64_t>(layers_.size())) return false;
  const Layer& l = layers_[static_cast<size_t>(layer)];
  if (kind == LinearKind::kRouter || IsExpertKind(kind)) return l.moe;
  return l.weight.count(kind) > 0;
}

at::Tensor DecoderModel::RmsNorm(const at::Tensor& x, const at::Tensor& weight) const {
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor variance = xf.pow(2).mean(-1, /*keepdim=*/true);
  if (config_.zero_centered_norm) {
    // Qwen3_5RMSNorm: scale by (1 + w) in float32, then cast back.
    return (xf * at::rsqrt(variance + config_.rms_norm_eps) * (1.0 + weight.to(at::kFloat)))
        .to(x.scalar_type());
  }
  // As transformers: normalise in float32, cast back, then scale.
  return weight * (xf * at::rsqrt(variance + config_.rms_norm_eps)).to(x.scalar_type());
}

at::Tensor DecoderModel::Mlp(const Layer& layer, int64_t index, const at::Tensor& x,
                             const LoraSegmentsFn& lora) const {
  const at::Tensor gated = at::silu(Linear(layer, index, LinearKind::kGate, x, lora)) *
                           Linear(layer, index, LinearKind::kUp, x, lora);
  return Linear(layer, index, LinearKind::kDown, gated, lora);
}

namespace {

// `segments` (over N rows) restricted to rows [start, start + rows), made relative to start.
std::vector<kernels::LoraSegment> LocalSegments(const std::vector<kernels::LoraSegment>& segments,
                                                int64_t start, int64_t rows) {
  std::vector<kernels::LoraSegment> out;
  for (const kernels::LoraSegment& s : segments) {
    TORCH_CHECK(!s.x.defined(), "MoE LoRA segments with their own input (dropout)");
    const int64_t b = std::max(s.row_begin, start), e = std::min(s.row_end, start + rows);
    if (e <= b) continue;
    out.push_back(s);
    out.back().row_begin = b - start;
    out.back().row_end = e - start;
  }
  return out;
}

// One adapter's LoRA on a 3-D expert parameter, split per expert as PEFT's ParamWrapper
// reads it: A [E·r, in] is experts-major (expert e: rows e·r..), B [out, r·E] rank-major
// (expert e: columns e, e + E, ...). One unbind each, so autograd has one node that
// gathers every expert's gradient back (not one full-size scatter per expert).
struct ExpertPairs {
  std::vector<at::Tensor> a, b;  // per expert: [r, in], [out, r]
  double scale = 1;
};

ExpertPairs SplitExperts(const kernels::LoraSegment& s, int64_t experts) {
  const int64_t r = s.a.size(0) / experts;
  TORCH_CHECK(r * experts == s.a.size(0) && s.b.size(1) == s.a.size(0),
              "expert LoRA: A ", s.a.sizes(), " and B ", s.b.sizes(), " do not fit ", experts, " experts");
  return ExpertPairs{s.a.reshape({experts, r, s.a.size(1)}).unbind(0),
                     s.b.reshape({s.b.size(0), r, experts}).permute({2, 0, 1}).unbind(0), s.scale};
}

}  // namespace

at::Tensor DecoderModel::Moe(const Layer& layer, int64_t index, const at::Tensor& x,
                             const std::vector<int64_t>& group_rows, const LoraSegmentsFn& lora) const {
  MoeLora all;
  if (lora) {
    all.router = lora(index, LinearKind::kRouter, x);
    all.gate_up = lora(index, LinearKind::kExpertsGateUp, x);
    all.down = lora(index, LinearKind::kExpertsDown, x);
  }
  const bool shared = layer.weight.count(LinearKind::kSharedExpertGate) > 0;
  // Every group through its own view of x, also when there is one: the gradient x gets is
  // then summed the same way whether the group ran fused or alone.
  std::vector<at::Tensor> routed, gate, up, shared_gate;
  int64_t start = 0;
  for (int64_t rows : group_rows) {
    const at::Tensor xg = x.narrow(0, start, rows);
    routed.push_back(MoeRows(layer, xg,
                             MoeLora{LocalSegments(all.router, start, rows), LocalSegments(all.gate_up, start, rows),
                                     LocalSegments(all.down, start, rows)}));
    if (shared) {
      gate.push_back(at::linear(xg, layer.weight.at(LinearKind::kGate)));
      up.push_back(at::linear(xg, layer.weight.at(LinearKind::kUp)));
      shared_gate.push_back(at::linear(xg, layer.weight.at(LinearKind::kSharedExpertGate)));
    }
    start += rows;
  }
  const auto join = [](const std::vector<at::Tensor>& parts) {
    return parts.size() == 1 ? parts[0] : at::cat(parts, 0);
  };
  at::Tensor out = join(routed);
  if (!shared) return out;
  // Qwen3_5MoeSparseMoeBlock: experts + sigmoid(shared_expert_gate(x)) * shared_expert(x).
  // The shared expert's linears are ordinary LoRA targets (PEFT target_modules): their base
  // products per group like the experts' (over [N, H] x [H, 1] BLAS rounds a row differently
  // with N), their LoRA per segment over all rows like any linear's.
  const auto add_lora = [&](LinearKind kind, const at::Tensor& in, at::Tensor y) {
    if (lora) {
      std::vector<kernels::LoraSegment> segments = lora(index, kind, in);
      if (!segments.empty()) y = y + kernels::LoraDelta(in, y.size(-1), segments);
    }
    return y;
  };
  auto silu = [](const at::Tensor& t) { return at::silu(t); };
  auto sigmoid = [](const at::Tensor& t) { return at::sigmoid(t); };
  const at::Tensor hidden = TailFree(add_lora(LinearKind::kGate, x, join(gate)), silu) *
                            add_lora(LinearKind::kUp, x, join(up));
  std::vector<at::Tensor> down;
  start = 0;
  for (int64_t rows : group_rows) {
    down.push_back(at::linear(hidden.narrow(0, start, rows), layer.weight.at(LinearKind::kDown)));
    start += rows;
  }
  const at::Tensor shared_out = add_lora(LinearKind::kDown, hidden, join(down));
  return out + TailFree(add_lora(LinearKind::kSharedExpertGate, x, join(shared_gate)), sigmoid) * shared_out;
}

at::Tensor DecoderModel::MoeRows(const Layer& layer, const at::Tensor& x, const MoeLora& lora) const {
  const int64_t k = config_.experts_per_token, width = config_.moe_intermediate_size;
  const int64_t experts = config_.num_experts, n = x.size(0);
  // Qwen3MoeTopKRouter: softmax in float32, top-k, optionally renormalised, cast back. The
  // routing weights stay differentiable (gradients reach x through them, as in
  // transformers); the router's own weight is frozen like every base weight, its LoRA (PEFT
  // target parameter gate.weight) is added per segment like any linear's.
  at::Tensor logits = at::linear(x, layer.router);
  if (!lora.router.empty()) logits = logits + kernels::LoraDelta(x, logits.size(-1), lora.router);
  const at::Tensor probs = at::softmax(logits, -1, at::kFloat);
  auto [top_w, top_i] = probs.topk(k, -1);
  if (config_.norm_topk_prob) top_w = top_w / top_w.sum(-1, /*keepdim=*/true);
  top_w = top_w.to(logits.scalar_type());

  // Expert LoRA: the rows' adapters as slots (0 = none; one slot per distinct pair of
  // gate_up / down LoRA, so rows of one adapter share a slot wherever they are). The (row, k)
  // pairs are then grouped by expert and, within an expert, by slot: each expert is one
  // matrix product over its rows, each (expert, slot) one LoRA product pair. Without expert
  // LoRA there is one slot and this is the plain grouping by expert.
  struct Slot {
    const kernels::LoraSegment* gate_up = nullptr;
    const kernels::LoraSegment* down = nullptr;
  };
  std::vector<Slot> slots(1);
  at::Tensor key = top_i.reshape({-1});
  if (!lora.gate_up.empty() || !lora.down.empty()) {
    std::vector<const kernels::LoraSegment*> row_gate_up(static_cast<size_t>(n), nullptr);
    std::vector<const kernels::LoraSegment*> row_down(static_cast<size_t>(n), nullptr);
    for (const kernels::LoraSegment& s : lora.gate_up) {
      std::fill(row_gate_up.begin() + s.row_begin, row_gate_up.begin() + s.row_end, &s);
    }
    for (const kernels::LoraSegment& s : lora.down) {
      std::fill(row_down.begin() + s.row_begin, row_down.begin() + s.row_end, &s);
    }
    const auto same = [](const kernels::LoraSegment* p, const kernels::LoraSegment* q) {
      if (p == nullptr || q == nullptr) return p == q;
      // By memory, not by tensor object: the sampler hands each row a view of its own.
      return p->a.const_data_ptr() == q->a.const_data_ptr() && p->b.const_data_ptr() == q->b.const_data_ptr() &&
             p->a.sizes().equals(q->a.sizes()) && p->scale == q->scale;
    };
    std::vector<int64_t> row_slot(static_cast<size_t>(n), 0);
    for (int64_t r = 0; r < n; ++r) {
      const kernels::LoraSegment* gu = row_gate_up[static_cast<size_t>(r)];
      const kernels::LoraSegment* dn = row_down[static_cast<size_t>(r)];
      if (gu == nullptr && dn == nullptr) continue;
      size_t slot = 1;
      while (slot < slots.size() && !(same(slots[slot].gate_up, gu) && same(slots[slot].down, dn))) ++slot;
      if (slot == slots.size()) slots.push_back({gu, dn});
      row_slot[static_cast<size_t>(r)] = static_cast<int64_t>(slot);
    }
    const at::Tensor slot_of_row =
        at::from_blob(row_slot.data(), {n}, at::kLong).to(x.device(), /*non_blocking=*/false, /*copy=*/true);
    key = key * static_cast<int64_t>(slots.size()) + slot_of_row.repeat_interleave(k);
  }
  const int64_t num_slots = static_cast<int64_t>(slots.size());
  std::vector<ExpertPairs> gate_up_pairs(slots.size()), down_pairs(slots.size());
  for (size_t s = 1; s < slots.size(); ++s) {
    if (slots[s].gate_up != nullptr) gate_up_pairs[s] = SplitExperts(*slots[s].gate_up, experts);
    if (slots[s].down != nullptr) down_pairs[s] = SplitExperts(*slots[s].down, experts);
  }

  // The (row, k) pairs grouped by key (stable: row order within a group), so each expert is
  // one matrix product over its rows: no per-token loop.
  const at::Tensor order = at::argsort(key, /*stable=*/true);
  const at::Tensor counts = at::bincount(key, {}, experts * num_slots).to(at::kCPU);
  const at::Tensor rows = at::div(order, k, "trunc");
  const at::Tensor xs = x.index_select(0, rows);
  const at::Tensor ws = top_w.reshape({-1}).index_select(0, order);
  at::Tensor out = at::zeros_like(x);
  const int64_t* count = counts.const_data_ptr<int64_t>();
  // The LoRA term of expert e over its rows `in` (laid out slot by slot, `slot_rows` each):
  // per slot with a pair, scale · (in_s · A_eᵀ) · B_eᵀ in the weights' dtype; undefined when
  // no slot has one.
  const auto expert_delta = [&](const std::vector<ExpertPairs>& pairs, int64_t e, const at::Tensor& in,
                                const std::vector<int64_t>& slot_rows, int64_t out_features) {
    std::vector<at::Tensor> pieces;
    bool any = false;
    int64_t at_row = 0;
    for (int64_t s = 0; s < num_slots; ++s) {
      const int64_t c = slot_rows[static_cast<size_t>(s)];
      if (c == 0) continue;
      const ExpertPairs& p = pairs[static_cast<size_t>(s)];
      if (p.a.empty()) {
        pieces.push_back(at::zeros({c, out_features}, in.options()));
      } else {
        const at::Tensor& a = p.a[static_cast<size_t>(e)];
        const at::Tensor part = in.narrow(0, at_row, c).to(a.scalar_type());
        pieces.push_back((at::linear(at::linear(part, a), p.b[static_cast<size_t>(e)]) * p.scale)
                             .to(in.scalar_type()));
        any = true;
      }
      at_row += c;
    }
    if (!any) return at::Tensor();
    return pieces.size() == 1 ? pieces[0] : at::cat(pieces, 0);
  };
  int64_t offset = 0;
  std::vector<int64_t> slot_rows(slots.size());
  // Ascending expert order: each row sums its experts' outputs in the order transformers does.
  for (int64_t e = 0; e < experts; ++e) {
    int64_t c = 0;
    for (int64_t s = 0; s < num_slots; ++s) {
      slot_rows[static_cast<size_t>(s)] = count[e * num_slots + s];
      c += slot_rows[static_cast<size_t>(s)];
    }
    if (c == 0) continue;
    const at::Tensor xe = xs.narrow(0, offset, c);
    at::Tensor gate_up = at::linear(xe, layer.experts_gate_up[e]);
    if (num_slots > 1) {
      const at::Tensor delta = expert_delta(gate_up_pairs, e, xe, slot_rows, 2 * width);
      if (delta.defined()) gate_up = gate_up + delta;
    }
    const at::Tensor hidden =
        TailFree(gate_up.narrow(1, 0, width), [](const at::Tensor& t) { return at::silu(t); }) *
        gate_up.narrow(1, width, width);
    at::Tensor y = at::linear(hidden, layer.experts_down[e]);
    if (num_slots > 1) {
      const at::Tensor delta = expert_delta(down_pairs, e, hidden, slot_rows, y.size(1));
      if (delta.defined()) y = y + delta;
    }
    y = y * ws.narrow(0, offset, c).unsqueeze(1);
    out.index_add_(0, rows.narrow(0, offset, c), y.to(out.scalar_type()));
    offset += c;
  }
  return out;
}

namespace {

// The DeltaNet block's projections, split: q, k [N, nk, dk] and v [N, nv, dv] after the
// convolution, z [N, nv, dv], beta and g [N, nv].
struct DeltaInputs {
  at::Tensor q, k, v, z, beta, g;
};

DeltaInputs SplitDelta(const ModelConfig& c, const at::Tensor& mixed, const at::Tensor& z,
                       const at::Tensor& b, const at::Tensor& a, const at::Tensor& a_log,
                       const at::Tensor& dt_bias) {
  const int64_t n = mixed.size(0), kd = c.linear_key_dim(), vd = c.linear_value_dim();
  const int64_t nk = c.linear_num_key_heads, nv = c.linear_num_value_heads;
  DeltaInputs d;
  d.q = mixed.narrow(1, 0, kd).reshape({n, nk, c.linear_key_head_dim});
  d.k = mixed.narrow(1, kd, kd).reshape({n, nk, c.linear_key_head_dim});
  d.v = mixed.narrow(1, 2 * kd, vd).reshape({n, nv, c.linear_value_head_dim});
  d.z = z.reshape({n, nv, c.linear_value_head_dim});
  d.beta = TailFree(b, [](const at::Tensor& t) { return at::sigmoid(t); });
  // g = -exp(A_log) · softplus(a + dt_bias), in float32 as transformers computes it.
  d.g = -a_log.to(at::kFloat).exp() *
        TailFree(a.to(at::kFloat) + dt_bias, [](const at::Tensor& t) { return at::softplus(t); });
  return d;
}

}  // namespace

at::Tensor DecoderModel::LinearAttention(const Layer& layer, int64_t index, const at::Tensor& h,
                                         const std::vector<int64_t>& seq_lens,
                                         const std::vector<int64_t>& seq_groups,
                                         const LoraSegmentsFn& lora,
                                         const LinearStates& states) const {
  const int64_t n = h.size(0);
  const at::Tensor qkv = Linear(layer, index, LinearKind::kInProjQkv, h, lora);
  const at::Tensor z = Linear(layer, index, LinearKind::kInProjZ, h, lora);
  const at::Tensor b = Linear(layer, index, LinearKind::kInProjB, h, lora);
  const at::Tensor a = Linear(layer, index, LinearKind::kInProjA, h, lora);
  if (states.conv != nullptr) {
    *states.conv = ConvStates(qkv, config_.linear_conv_kernel, seq_lens);
  }
  const at::Tensor mixed = PackedCausalConv1d(qkv, layer.conv_weight, seq_lens);
  const DeltaInputs d = SplitDelta(config_, mixed, z, b, a, layer.a_log, layer.dt_bias);
  const at::Tensor o =
      ChunkGatedDeltaRule(d.q, d.k, d.v, d.g, d.beta, seq_lens, seq_groups, states.recurrent);
  const at::Tensor normed = GatedRmsNorm(o, d.z, layer.gated_norm, config_.rms_norm_eps);
  return Linear(layer, index, LinearKind::kOutProj, normed.reshape({n, config_.linear_value_dim()}),
                lora);
}

at::Tensor DecoderModel::PagedLinearAttention(const Layer& layer, int64_t index,
                                              const at::Tensor& h,
                                              const std::vector<PagedSequence>& seqs, PagedKv& kv,
                                              const LoraSegmentsFn& lora) const {
  const int64_t n = h.size(0);
  const at::Tensor& conv_cache = kv.conv.at(index);
  const at::Tensor& rec_cache = kv.recurrent.at(index);
  TORCH_CHECK(conv_cache.defined() && rec_cache.defined(),
              "ForwardPaged: no recurrent state for DeltaNet layer ", index);
  const at::Tensor qkv = Linear(layer, index, LinearKind::kInProjQkv, h, lora);
  const at::Tensor z = Linear(layer, index, LinearKind::kInProjZ, h, lora);
  const at::Tensor b = Linear(layer, index, LinearKind::kInProjB, h, lora);
  const at::Tensor a = Linear(layer, index, LinearKind::kInProjA, h, lora);
  const c10::Device device = h.device();

  // Prefills (from a zero state) and decode steps (from the slot's state) go separately,
  // each kind batched; their rows are put back in order at the end.
  std::vector<int64_t> prefill_rows, prefill_lens, prefill_slots, decode_rows, decode_slots;
  int64_t row = 0;
  for (const PagedSequence& s : seqs) {
    TORCH_CHECK(s.state_slot >= 0 && s.state_slot < conv_cache.size(0),
                "ForwardPaged: a sequence without a valid state slot");
    TORCH_CHECK(s.past == 0 || s.count == 1,
                "ForwardPaged: new tokens after cached ones come one at a time (no chunked prefill)");
    if (s.past == 0) {
      for (int64_t t = 0; t < s.count; ++t) prefill_rows.push_back(row + t);
      prefill_lens.push_back(s.count);
      prefill_slots.push_back(s.state_slot);
    } else {
      decode_rows.push_back(row);
      decode_slots.push_back(s.state_slot);
    }
    row += s.count;
  }
  auto index_tensor = [&](const std::vector<int64_t>& v) {
    return at::from_blob(const_cast<int64_t*>(v.data()), {static_cast<int64_t>(v.size())},
                         at::kLong)
        .to(device, /*non_blocking=*/false, /*copy=*/true);
  };
  const bool all_prefill = decode_rows.empty(), all_decode = prefill_rows.empty();
  auto pick = [&](const at::Tensor& t, const at::Tensor& rows, bool all) {
    return all ? t : t.index_select(0, rows);
  };
  at::Tensor out = all_prefill || all_decode
                       ? at::Tensor()
                       : at::empty({n, config_.linear_value_dim()}, h.options());
  at::Tensor result;
  if (!prefill_rows.empty()) {
    const at::Tensor rows = index_tensor(prefill_rows);
    const at::Tensor x = pick(qkv, rows, all_prefill);
    at::Tensor conv_state, rec_state;
    const at::Tensor mixed = PackedCausalConv1d(x, layer.conv_weight, prefill_lens);
    conv_state = ConvStates(x, config_.linear_conv_kernel, prefill_lens);
    const DeltaInputs d = SplitDelta(config_, mixed, pick(z, rows, all_prefill),
                                     pick(b, rows, all_prefill), pick(a, rows, all_prefill),
                                     layer.a_log, layer.dt_bias);
    const at::Tensor o =
        ChunkGatedDeltaRule(d.q, d.k, d.v, d.g, d.beta, prefill_lens, {}, &rec_state);
    const at::Tensor slots = index_tensor(prefill_slots);
    conv_cache.index_copy_(0, slots, conv_state.to(conv_cache.scalar_type()));
    rec_cache.index_copy_(0, slots, rec_state.to(rec_cache.scalar_type()));
    result = GatedRmsNorm(o, d.z, layer.gated_norm, config_.rms_norm_eps)
                 .reshape({x.size(0), config_.linear_value_dim()});
    if (out.defined()) out.index_copy_(0, rows, result);
  }
  if (!decode_rows.empty()) {
    const at::Tensor rows = index_tensor(decode_rows);
    const at::Tensor slots = index_tensor(decode_slots);
    const at::Tensor x = pick(qkv, rows, all_decode);
    at::Tensor conv_state = conv_cache.index_select(0, slots);
    const at::Tensor mixed = CausalConv1dStep(x, layer.conv_weight, conv_state);
    const DeltaInputs d = SplitDelta(config_, mixed, pick(z, rows, all_decode),
                                     pick(b, rows, all_decode), pick(a, rows, all_decode),
                                     layer.a_log, layer.dt_bias);
    at::Tensor rec_state = rec_cache.index_select(0, slots).to(at::kFloat);
    const at::Tensor o = RecurrentGatedDeltaStep(d.q, d.k, d.v, d.g, d.beta, rec_state);
    conv_cache.index_copy_(0, slots, conv_state.to(conv_cache.scalar_type()));
    rec_cache.index_copy_(0, slots, rec_state.to(rec_cache.scalar_type()));
    result = GatedRmsNorm(o, d.z, layer.gated_norm, config_.rms_norm_eps)
                 .reshape({x.size(0), config_.linear_value_dim()});
    if (out.defined()) out.index_copy_(0, rows, result);
  }
  return Linear(layer, index, LinearKind::kOutProj, out.defined() ? out : result, lora);
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
  at::Tensor q, gate;
  if (config_.attn_output_gate) {
    // q_proj emits [query | gate] per head.
    const at::Tensor qg = Linear(layer, index, LinearKind::kQ, h, lora).view({n, heads, 2 * d});
    q = qg.narrow(-1, 0, d);
    gate = qg.narrow(-1, d, d).reshape({n, heads * d});
  } else {
    q = Linear(layer, index, LinearKind::kQ, h, lora).view({n, heads, d});
  }
  at::Tensor k = Linear(layer, index, LinearKind::kK, h, lora).view({n, kv_heads, d});
  at::Tensor v = Linear(layer, index, LinearKind::kV, h, lora).view({n, kv_heads, d});
  if (config_.qk_norm) {
    q = RmsNorm(q, layer.q_norm);
    k = RmsNorm(k, layer.k_norm);
  }
  // cos/sin: [N, rotary_dim] -> broadcast over heads; dims past rotary_dim pass unrotated.
  const at::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);
  const int64_t rotary = config_.rotary_dim();
  auto rotate = [&](const at::Tensor& t) {
    if (rotary == d) return t * c + RotateHalf(t) * s;
    const at::Tensor r = t.narrow(-1, 0, rotary);
    return at::cat({r * c + RotateHalf(r) * s, t.narrow(-1, rotary, d - rotary)}, -1);
  };
  q = rotate(q);
  k = rotate(k);
  return {q, k, v, gate};
}

std::pair<at::Tensor, at::Tensor> DecoderModel::Rope(const at::Tensor& pos) const {
  const at::Tensor freqs = pos.unsqueeze(1) * inv_freq_.unsqueeze(0);
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  // Row-count independent (TailFree): a partial rotary dim leaves [N, 8]-sized angle tensors.
  const at::Tensor cos = TailFree(emb, [](const at::Tensor& t) { return t.cos(); });
  const at::Tensor sin = TailFree(emb, [](const at::Tensor& t) { return t.sin(); });
  return {cos.to(embed_.scalar_type()), sin.to(embed_.scalar_type())};
}

at::Tensor DecoderModel::Attention(const Layer& layer, int64_t index, const at::Tensor& h,
                                   const std::vector<int64_t>& seq_lens,
                                   const std::vector<int64_t>& seq_groups, const at::Tensor& cos,
                                   const at::Tensor& sin, const LoraSegmentsFn& lora) const {
  const int64_t heads = config_.num_attention_heads, kv_heads = config_.num_key_value_heads;
  const int64_t d = config_.head_dim;
  auto [q, k, v, gate] = ProjectQkv(layer, index, h, cos, sin, lora);
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
  if (gate.defined()) attn = attn * TailFree(gate, [](const at::Tensor& t) { return at::sigmoid(t); });
  return Linear(layer, index, LinearKind::kO, attn, lora);
}

namespace {

// Rows of each group (op): consecutive sequences of one group.
std::vector<int64_t> GroupRows(const std::vector<int64_t>& seq_lens,
                               const std::vector<int64_t>& seq_groups) {
  std::vector<int64_t> group_rows;
  for (size_t s = 0; s < seq_lens.size(); ++s) {
    const bool same = s > 0 && (seq_groups.empty() || seq_groups[s] == seq_groups[s - 1]);
    if (!same) group_rows.push_back(0);
    group_rows.back() += seq_lens[s];
  }
  return group_rows;
}

}  // namespace

int64_t LogitChunkRows(int64_t vocab, int64_t configured) {
  if (configured > 0) return configured;
  return std::max<int64_t>(1, kLogitChunkElements / std::max<int64_t>(vocab, 1));
}

at::Tensor DecoderModel::Hidden(const at::Tensor& tokens, const std::vector<int64_t>& seq_lens,
                                const std::vector<int64_t>& seq_groups,
                                const LoraSegmentsFn& lora) const {
  // Positions restart at 0 in every sequence; angles in float32 as transformers computes them.
  std::vector<at::Tensor> positions;
  for (int64_t len : seq_lens) positions.push_back(at::arange(len, at::kLong));
  const at::Tensor pos = at::cat(positions).to(inv_freq_.device()).to(at::kFloat);
  const auto [cos, sin] = Rope(pos);

  // Rows of each group (op): consecutive sequences of one group, for the MoE blocks.
  const std::vector<int64_t> group_rows = GroupRows(seq_lens, seq_groups);

  at::Tensor x = at::embedding(embed_, tokens.to(embed_.device()));
  const bool checkpoint = activation_checkpointing_ && c10::GradMode::is_enabled();
  for (size_t i = 0; i < layers_.size(); ++i) {
    const int64_t index = static_cast<int64_t>(i);
    if (!checkpoint) {
      x = RunLayer(index, x, seq_lens, seq_groups, group_rows, cos, sin, lora);
      continue;
    }
    // The closure copies the layout and RoPE tables; `lora` is the caller's, alive until
    // its backward has run (Trainer::Forward backpropagates before it returns).
    auto layer = c10::make_intrusive<LayerRun>();
    layer->run = [this, index, seq_lens, seq_groups, group_rows, cos, sin,
                  lora](const at::Tensor& input) {
      return RunLayer(index, input, seq_lens, seq_groups, group_rows, cos, sin, lora);
    };
    x = CheckpointedLayerFn::apply(x, CheckpointAnchor(), layer);
  }
  return RmsNorm(x, final_norm_);
}

at::Tensor DecoderModel::RunLayer(int64_t index, const at::Tensor& x,
                                  const std::vector<int64_t>& seq_lens,
                                  const std::vector<int64_t>& seq_groups,
                                  const std::vector<int64_t>& group_rows, const at::Tensor& cos,
                                  const at::Tensor& sin, const LoraSegmentsFn& lora) const {
  const Layer& layer = layers_[static_cast<size_t>(index)];
  const at::Tensor normed = RmsNorm(x, layer.input_norm);
  const at::Tensor mid =
      x + (layer.linear_attention
               ? LinearAttention(layer, index, normed, seq_lens, seq_groups, lora, {})
               : Attention(layer, index, normed, seq_lens, seq_groups, cos, sin, lora));
  const at::Tensor h = RmsNorm(mid, layer.post_norm);
  return mid + (layer.moe ? Moe(layer, index, h, group_rows, lora) : Mlp(layer, index, h, lora));
}

at::Tensor DecoderModel::TargetLogprobs(const at::Tensor& hidden, const at::Tensor& targets,
                                        const std::vector<int64_t>& seq_lens,
                                        const std::vector<int64_t>& seq_groups,
                                        const LoraSegmentsFn& lora, at::Tensor* logits) const {
  TORCH_CHECK(hidden.dim() == 2 && targets.size(0) == hidden.size(0),
              "TargetLogprobs: hidden ", hidden.sizes(), " and targets ", targets.sizes());
  // Chunks never straddle a group (op): a tenant's chunks, and so its numbers, are the same
  // fused or alone.
  LogitPlan plan;
  plan.training = c10::GradMode::is_enabled();
  const int64_t rows = LogitChunkRows(config_.vocab_size, logit_chunk_rows_);
  int64_t start = 0;
  for (int64_t group : GroupRows(seq_lens, seq_groups)) {
    for (int64_t c = 0; c < group; c += rows) {
      plan.chunk_begin.push_back(start + c);
      plan.chunk_end.push_back(start + std::min(group, c + rows));
    }
    start += group;
  }
  TORCH_CHECK(start == hidden.size(0), "TargetLogprobs: sequences cover ", start, " of ",
              hidden.size(0), " rows");
  // lm_head LoRA as PEFT applies it, also with tied embeddings: the delta is added to the
  // logits only; the (shared) embedding lookup never sees it.
  std::vector<at::Tensor> a, b, own_x;
  if (lora) {
    for (kernels::LoraSegment& s : lora(0, LinearKind::kLmHead, hidden)) {
      plan.seg_begin.push_back(s.row_begin);
      plan.seg_end.push_back(s.row_end);
      plan.seg_scale.push_back(s.scale);
      plan.seg_own.push_back(s.x.defined() ? static_cast<int64_t>(own_x.size()) : -1);
      a.push_back(s.a);
      b.push_back(s.b);
      if (s.x.defined()) own_x.push_back(s.x);
    }
  }
  if (!plan.training) {
    at::Tensor lse;
    return ChunkedLogprobsFn::Run(hidden, lm_head_, targets, a, b, own_x, plan, logits, &lse);
  }
  return ChunkedLogprobsFn::apply(hidden, lm_head_, targets, at::TensorList(a), at::TensorList(b),
                                  at::TensorList(own_x), plan, logits);
}

at::Tensor DecoderModel::PagedAttention(const Layer& layer, int64_t index, const at::Tensor& h,
                                        const std::vector<PagedSequence>& seqs, PagedKv& kv,
                                        const at::Tensor& slots, const at::Tensor& cos,
                                        const at::Tensor& sin, const LoraSegmentsFn& lora) const {
  const int64_t n = h.size(0);
  const int64_t heads = config_.num_attention_heads, kv_heads = config_.num_key_value_heads;
  const int64_t d = config_.head_dim;
  auto [q, k, v, gate] = ProjectQkv(layer, index, h, cos, sin, lora);
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
  if (gate.defined()) attn = attn * TailFree(gate, [](const at::Tensor& t) { return at::sigmoid(t); });
  return Linear(layer, index, LinearKind::kO, attn, lora);
}

at::Tensor DecoderModel::ForwardPaged(const at::Tensor& tokens,
                                      const std::vector<PagedSequence>& seqs, PagedKv& kv,
                                      const std::vector<int64_t>* logit_rows,
                                      const LoraSegmentsFn& lora) const {
  TORCH_CHECK(kv.block_size > 0 && kv.k.size() == layers_.size() && kv.v.size() == layers_.size(),
              "ForwardPaged: the KV cache does not fit the model");
  TORCH_CHECK(!config_.hybrid() ||
                  (kv.conv.size() == layers_.size() && kv.recurrent.size() == layers_.size()),
              "ForwardPaged: the recurrent state cache does not fit the model");
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
    const at::Tensor normed = RmsNorm(x, layer.input_norm);
    x = x + (layer.linear_attention
                 ? PagedLinearAttention(layer, index, normed, seqs, kv, lora)
                 : PagedAttention(layer, index, normed, seqs, kv, slot, cos, sin, lora));
    const at::Tensor h = RmsNorm(x, layer.post_norm);
    // Generation routes all rows together (last-bit BLAS differences only, sampler.h).
    x = x + (layer.moe ? Moe(layer, index, h, {h.size(0)}, lora) : Mlp(layer, index, h, lora));
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
