#pragma once
// Bodies of the training methods between the coordinator and an engine worker (msgpack
// maps; a key a sender omits keeps the default below). Tensors travel as frames referenced
// by ipc::TensorDesc; an absent optional tensor has an empty dtype.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <msgpack.hpp>

#include "core/ipc/messages.h"

namespace twinkle::ipc {

inline constexpr char kMethodCreateAdapter[] = "create_adapter";
inline constexpr char kMethodRemoveAdapter[] = "remove_adapter";
inline constexpr char kMethodForward[] = "forward";                    // no graph, no gradient
inline constexpr char kMethodForwardBackward[] = "forward_backward";  // accumulates gradients
inline constexpr char kMethodOptimStep[] = "optim_step";              // applies, then zeroes grads
inline constexpr char kMethodZeroGrad[] = "zero_grad";
inline constexpr char kMethodGetAdapterState[] = "get_adapter_state";
inline constexpr char kMethodSetAdapterState[] = "set_adapter_state";
// Twinkle-native optimizer control (Twinkle's set_optimizer / clip_grad_norm / step).
inline constexpr char kMethodSetOptimizer[] = "set_optimizer";    // fresh optimizer, grads kept
inline constexpr char kMethodClipGradNorm[] = "clip_grad_norm";   // scales grads in place
// Data parallelism: a rank of the group was replaced; the next collective forms the group
// anew under `epoch` (core/engine/distributed.h).
inline constexpr char kMethodRejoinGroup[] = "rejoin_group";
struct RejoinGroupRequest {
  int64_t epoch = 0;
  MSGPACK_DEFINE_MAP(epoch);
};

struct CreateAdapterRequest {
  std::string adapter_id;
  int64_t rank = 8;
  double alpha = 32;  // training::kDefaultLoraAlpha; the coordinator always sets it
  double dropout = 0;
  bool use_rslora = false;
  // PEFT target_modules: "all-linear" (every decoder linear, not lm_head, as in PEFT),
  // q_proj ... down_proj, lm_head.
  std::vector<std::string> targets = {"all-linear"};
  uint64_t seed = 0;
  std::string optimizer = "adamw";
  MSGPACK_DEFINE_MAP(adapter_id, rank, alpha, dropout, use_rslora, targets, seed, optimizer);
};
struct CreateAdapterReply {
  int64_t num_parameters = 0;
  double scale = 0;
  MSGPACK_DEFINE_MAP(num_parameters, scale);
};

struct AdapterRequest {  // remove_adapter, zero_grad, get_adapter_state
  std::string adapter_id;
  MSGPACK_DEFINE_MAP(adapter_id);
};

struct LossSpecMsg {
  std::string name;  // empty: no loss, logprobs only (forward)
  std::map<std::string, double> config;
  std::map<std::string, std::string> string_config;
  MSGPACK_DEFINE_MAP(name, config, string_config);
};

struct DatumMsg {
  TensorDesc input_tokens;                   // int64 [L]
  TensorDesc target_tokens;                  // int64 [L]; logprobs are of these tokens
  std::map<std::string, TensorDesc> inputs;  // loss_fn_inputs other than target_tokens
  MSGPACK_DEFINE_MAP(input_tokens, target_tokens, inputs);
};

// One adapter's share of a fused pass. adapter_id "" = base model only (forward only).
struct TrainOpMsg {
  std::string adapter_id;
  bool disable_adapter = false;  // reference logprobs: run this op's rows on the base model
  LossSpecMsg loss;
  std::vector<DatumMsg> datums;
  int64_t window_tokens = 0;     // Twinkle mean losses: tokens over the accumulation window
  int64_t window_sequences = 0;
  MSGPACK_DEFINE_MAP(adapter_id, disable_adapter, loss, datums, window_tokens, window_sequences);
};

struct ForwardRequest {  // forward and forward_backward
  std::vector<TrainOpMsg> ops;
  bool return_logits = false;  // tests: the full logits per datum
  // Data parallelism (forward_backward on a rank of a process group): every adapter the
  // whole fused step trains, in the same order on every rank, whether or not this rank got
  // rows of it. After its backward the rank sums these adapters' new gradients over the
  // ranks, so each holds the gradient of the whole batch. Empty: no collective; ops may
  // then not be empty.
  std::vector<std::string> allreduce_adapters;
  // The activation-memory budget of one pass (engine.activation_memory_mib, in bytes; 0 =
  // none): a request the engine estimates above it runs as several passes, each within it,
  // its gradients accumulating across them (core/ipc/forward_split.h).
  int64_t max_pass_bytes = 0;
  MSGPACK_DEFINE_MAP(ops, return_logits, allreduce_adapters, max_pass_bytes);
};

struct OpResultMsg {
  std::vector<TensorDesc> logprobs;     // per datum, float32 [L]
  std::vector<TensorDesc> elementwise;  // per datum, float32 [L] (when a loss ran)
  std::vector<TensorDesc> logits;       // per datum [L, vocab] when asked
  std::map<std::string, double> metrics;
  MSGPACK_DEFINE_MAP(logprobs, elementwise, logits, metrics);
};
struct ForwardReply {
  std::vector<OpResultMsg> ops;
  MSGPACK_DEFINE_MAP(ops);
};

struct OptimStepRequest {
  std::string adapter_id;
  // learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm (Tinker's AdamParams),
  // momentum, dampening, nesterov (SGD). Omitted keys keep the optimizer's defaults.
  std::map<std::string, double> hyper;
  // true: Tinker's optim_step (apply, then clear the gradients). false: Twinkle's step(),
  // which leaves them for an explicit zero_grad (without one, the next backward adds to them).
  bool zero_grad = true;
  // Multiplies the accumulated gradients by this first (1 = no change): the coordinator's
  // division of a Twinkle accumulation window's gradients by the window's token count.
  double grad_scale = 1.0;
  MSGPACK_DEFINE_MAP(adapter_id, hyper, zero_grad, grad_scale);
};
struct OptimStepReply {
  double grad_norm = 0;
  double learning_rate = 0;
  int64_t step = 0;
  MSGPACK_DEFINE_MAP(grad_norm, learning_rate, step);
};

// Replaces the adapter's optimizer with a fresh one: state reset, step 0; gradients kept.
struct SetOptimizerRequest {
  std::string adapter_id;
  std::string optimizer;  // "adamw" | "adam" | "sgd", case-insensitive (Twinkle: AdamW, Adam, SGD)
  MSGPACK_DEFINE_MAP(adapter_id, optimizer);
};

// torch.nn.utils.clip_grad_norm_ on the accumulated gradients, in place.
struct ClipGradNormRequest {
  std::string adapter_id;
  double max_norm = 1.0;
  double norm_type = 2;  // 2 or inf
  double grad_scale = 1.0;  // as OptimStepRequest::grad_scale, applied before the norm
  MSGPACK_DEFINE_MAP(adapter_id, max_norm, norm_type, grad_scale);
};
struct ClipGradNormReply {
  double total_norm = 0;  // before clipping (what torch returns)
  MSGPACK_DEFINE_MAP(total_norm);
};

// Everything that makes an adapter what it is, so that offloading (get_adapter_state +
// remove_adapter, later create_adapter(config) + set_adapter_state with these fields) lets
// training continue bit for bit: same weights, gradients, optimizer and dropout masks.
// The targets as PEFT writes them in adapter_config.json for this adapter on this model
// (the engine knows the model): Qwen3-MoE's experts and router are target_parameters with
// gate_up_proj's rank and alpha doubled by rank_pattern / alpha_pattern, as PEFT 0.21's
// conversion writes them; otherwise target_modules names every linear "all-linear" resolved to.
struct PeftTargets {
  std::vector<std::string> target_modules;
  std::vector<std::string> target_parameters;
  std::map<std::string, int64_t> rank_pattern;
  std::map<std::string, double> alpha_pattern;
  MSGPACK_DEFINE_MAP(target_modules, target_parameters, rank_pattern, alpha_pattern);
};
struct AdapterStateReply {
  std::map<std::string, TensorDesc> weights;    // PEFT keys
  std::map<std::string, TensorDesc> grads;      // accumulated, where any
  std::map<std::string, TensorDesc> optimizer;  // optimizer state tensors
  int64_t step = 0;                             // the optimizer's step count
  std::string optimizer_kind;                   // "adamw" | "adam" | "sgd"
  int64_t micro_batches_since_step = 0;         // seeds the next dropout masks
  CreateAdapterRequest config;                  // the create_adapter body that rebuilds it
  PeftTargets peft;                             // for adapter_config.json
  MSGPACK_DEFINE_MAP(weights, grads, optimizer, step, optimizer_kind, micro_batches_since_step,
                     config, peft);
};
// Restores what get_adapter_state returned; a field left out keeps the adapter's current
// value. Weights may be a subset (by PEFT key). `grads`, when present (even empty), become
// the adapter's gradients exactly. `optimizer_kind`, when it names another kind, replaces the
// optimizer; the optimizer state, when given, is replaced whole. Everything is validated
// first: nothing changes on error.
struct SetAdapterStateRequest {
  std::string adapter_id;
  std::map<std::string, TensorDesc> weights;
  std::optional<std::map<std::string, TensorDesc>> grads;
  std::map<std::string, TensorDesc> optimizer;
  std::string optimizer_kind;
  std::optional<int64_t> micro_batches_since_step;
  // true: a fresh optimizer (step 0, no moments) of optimizer_kind or the current kind, as
  // Tinker's load_state (weights only) leaves it; excludes `optimizer`.
  bool reset_optimizer = false;
  MSGPACK_DEFINE_MAP(adapter_id, weights, grads, optimizer, optimizer_kind,
                     micro_batches_since_step, reset_optimizer);
};
// The set_adapter_state that puts back exactly what get_adapter_state returned (its frames
// travel with it): an offloaded adapter's reload, an adapter moved to another rank.
inline SetAdapterStateRequest RestoreRequestOf(const AdapterStateReply& state, std::string adapter_id) {
  SetAdapterStateRequest req;
  req.adapter_id = std::move(adapter_id);
  req.weights = state.weights;
  req.optimizer = state.optimizer;
  req.grads = state.grads;
  req.micro_batches_since_step = state.micro_batches_since_step;
  req.optimizer_kind = state.optimizer_kind;
  return req;
}


// sample: generation with a KV cache. Rows may name different adapters ("" = base model);
// they decode together, each with its own LoRA terms and its own seeded generator, so a row's
// tokens do not depend on the other rows of the request.
inline constexpr char kMethodSample[] = "sample";

// The largest top-k width a row may ask for (top_logprobs, prompt_top_logprobs): 64, what
// the Tinker protocol issue asks for (the SDK sets no maximum; vLLM's default max_logprobs is
// 20). Each asked position costs k ids and logprobs in the reply.
inline constexpr int64_t kMaxTopLogprobs = 64;
// The largest K of target_prompt_tokens and prompt_alt_tokens_k (each asked prompt position
// costs K ids and logprobs in the reply).
inline constexpr int64_t kMaxPromptTargets = 64;
// The largest |presence_penalty| and |frequency_penalty|: OpenAI's documented range [-2, 2].
inline constexpr double kMaxPenalty = 2.0;

struct SampleRowMsg {
  std::string adapter_id;          // "" = base model only
  TensorDesc prompt_tokens;        // int64 [P], P >= 1
  int64_t max_tokens = 16;
  double temperature = 1.0;        // 0 = greedy (argmax)
  double top_p = 1.0;              // 1 = off
  int64_t top_k = 0;               // 0 (or < 0) = off
  std::vector<int64_t> stop_token_ids;
  uint64_t seed = 0;               // sample s of this row draws from a generator seeded by (seed, s)
  int64_t num_samples = 1;
  bool want_prompt_logprobs = false;
  // k > 0: the k most likely tokens and their logprobs (the unwarped model's, like
  // `logprobs`) at every generated position / every prompt position after the first.
  // 0 = off and costs nothing; at most min(vocab, kMaxTopLogprobs).
  int64_t top_logprobs = 0;
  int64_t prompt_top_logprobs = 0;
  // sample_step only: every reply lists the tokens each running sample of this row made since
  // the last reply (SampleStepReply.progress), so the coordinator can match stop strings
  // while the row decodes and end a sample early (SampleStepRequest.stop).
  bool report_tokens = false;
  // Tinker's target_prompt_logprobs: int64 [P - 1, K] token ids, row i scored at prompt
  // position i + 1 (from prompt[..i]); -1 = no request for that cell. Nil when not asked.
  std::optional<TensorDesc> target_prompt_tokens;
  // Tinker's prompt_alt_tokens_k: k > 0 draws (with replacement, at `temperature`, 0 =
  // argmax; no top-k/top-p) from the distribution at every prompt position after the first,
  // from a generator of their own seeded by `seed`. At most kMaxPromptTargets.
  int64_t prompt_alt_tokens_k = 0;
  // Penalties and min-p (sampler.h has the order; docs/openai.md the sources). Each sample
  // counts its own tokens. Off at their defaults, and then they cost nothing.
  //   repetition_penalty  > 0, 1 = off: transformers' RepetitionPenaltyLogitsProcessor over
  //                       the prompt and the tokens generated so far (logit > 0: / p, else × p)
  //   presence_penalty,   in [-kMaxPenalty, kMaxPenalty], 0 = off: OpenAI's formula over the
  //   frequency_penalty   tokens generated so far, logit − count × frequency − (count > 0) × presence
  //   min_p               in [0, 1], 0 = off: transformers' MinPLogitsWarper (sampling only)
  double repetition_penalty = 1.0;
  double presence_penalty = 0.0;
  double frequency_penalty = 0.0;
  double min_p = 0.0;
  MSGPACK_DEFINE_MAP(adapter_id, prompt_tokens, max_tokens, temperature, top_p, top_k,
                     stop_token_ids, seed, num_samples, want_prompt_logprobs, top_logprobs,
                     prompt_top_logprobs, report_tokens, target_prompt_tokens, prompt_alt_tokens_k,
                     repetition_penalty, presence_penalty, frequency_penalty, min_p);
};
struct SampleRequest {
  std::vector<SampleRowMsg> rows;
  MSGPACK_DEFINE_MAP(rows);
};

// Top-k rows (top_token_ids int64 [N, k], top_logprobs float32 [N, k]) are sorted by
// descending logprob; equal logprobs go by ascending token id, also where a tie straddles
// the k-th place (the lower ids make the cut). Nil when not asked.
struct SampledSequenceMsg {
  TensorDesc tokens;        // int64 [T]; a stop token, when one ended it, is the last one
  TensorDesc logprobs;      // float32 [T]: log p(token) under the model (before any warping)
  std::string stop_reason;  // "stop" | "length"
  std::optional<TensorDesc> top_token_ids;  // int64 [T, top_logprobs]
  std::optional<TensorDesc> top_logprobs;   // float32 [T, top_logprobs]
  MSGPACK_DEFINE_MAP(tokens, logprobs, stop_reason, top_token_ids, top_logprobs);
};
struct SampleRowResultMsg {
  std::vector<SampledSequenceMsg> samples;  // num_samples of them
  // float32 [P - 1] when asked: log p(prompt[i + 1] | prompt[..i]); the first prompt token
  // has none. Nil otherwise.
  std::optional<TensorDesc> prompt_logprobs;
  // [P - 1, prompt_top_logprobs] when asked: row i is the distribution that predicts
  // prompt[i + 1] from prompt[..i]. Nil otherwise.
  std::optional<TensorDesc> prompt_top_token_ids;  // int64
  std::optional<TensorDesc> prompt_top_logprobs;   // float32
  // float32 [P - 1, K] when target_prompt_tokens was given: log p(id) at each asked cell, 0
  // where the id was -1. Nil otherwise.
  std::optional<TensorDesc> target_prompt_logprobs;
  // [P - 1, prompt_alt_tokens_k] when asked: the draws (int64) and the model's log-prob of
  // each (float32, unwarped like every other logprob). Nil otherwise.
  std::optional<TensorDesc> prompt_alt_token_ids;
  std::optional<TensorDesc> prompt_alt_logprobs;
  MSGPACK_DEFINE_MAP(samples, prompt_logprobs, prompt_top_token_ids, prompt_top_logprobs,
                     target_prompt_logprobs, prompt_alt_token_ids, prompt_alt_logprobs);
};
struct SampleReply {
  std::vector<SampleRowResultMsg> rows;
  MSGPACK_DEFINE_MAP(rows);
};

// sample_step: continuous batching over the worker's paged KV cache. One call drops `cancel`
// (blocks freed; unknown ids ignored), admits and prefills `admit` in order while KV blocks
// last (FIFO: once one is deferred, every later one in the call is deferred too), then runs
// up to max_decode_steps decode steps over everything running. A finished request's result is
// exactly what one-shot `sample` returns for that row. A call with no admits and
// max_decode_steps 0 does no work and reports the cache occupancy (stats).
inline constexpr char kMethodSampleStep[] = "sample_step";

struct SampleAdmitMsg {
  uint64_t request_id = 0;
  SampleRowMsg row;
  MSGPACK_DEFINE_MAP(request_id, row);
};
// One sample of a running request, by its index in the request (0 .. num_samples - 1).
struct SampleRefMsg {
  uint64_t request_id = 0;
  int64_t sample = 0;
  MSGPACK_DEFINE_MAP(request_id, sample);
};
struct SampleStepRequest {
  std::vector<SampleAdmitMsg> admit;  // prefilled in this call, in order, while blocks last
  std::vector<uint64_t> cancel;       // dropped (blocks freed) before anything else
  // Ended now, after the cancels, with stop_reason "stop" and the tokens they have (a stop
  // string matched); their blocks go back. Unknown or finished samples are ignored.
  std::vector<SampleRefMsg> stop;
  int64_t max_decode_steps = 8;       // decode steps after admission; 0 = admit/prefill only
  bool reset = false;                 // drop every running request first (coordinator lost track)
  MSGPACK_DEFINE_MAP(admit, cancel, stop, max_decode_steps, reset);
};
// The tokens a running sample of a report_tokens row made since the previous reply, with
// their log-probs and (row top_logprobs k > 0) the k most likely tokens at each position,
// [len(tokens), k] row-major, as the finished result has them.
struct SampleProgressMsg {
  uint64_t request_id = 0;
  int64_t sample = 0;
  std::vector<int64_t> tokens;
  std::vector<float> logprobs;
  std::vector<int64_t> top_token_ids;
  std::vector<float> top_logprobs;
  // A request's first report only (one of its samples'), when its row asked for them: the
  // prompt's log-probs as its result will carry them ([P - 1], and [P - 1, k] row-major), so
  // a stream can send them before the row finishes (the OpenAI routes' echo).
  std::vector<float> prompt_logprobs;
  std::vector<int64_t> prompt_top_token_ids;
  std::vector<float> prompt_top_logprobs;
  MSGPACK_DEFINE_MAP(request_id, sample, tokens, logprobs, top_token_ids, top_logprobs, prompt_logprobs,
                     prompt_top_token_ids, prompt_top_logprobs);
};
struct SampleFinishedMsg {
  uint64_t request_id = 0;
  SampleRowResultMsg result;
  MSGPACK_DEFINE_MAP(request_id, result);
};
struct SampleRejectedMsg {
  uint64_t request_id = 0;
  std::string error;
  MSGPACK_DEFINE_MAP(request_id, error);
};
struct SampleStepReply {
  std::vector<SampleFinishedMsg> finished;  // done this call (stop or length); blocks freed
  std::vector<SampleRejectedMsg> rejected;  // can never run (or its adapter was removed)
  std::vector<uint64_t> deferred;           // valid, no free blocks now: resubmit later, in order
  std::vector<SampleProgressMsg> progress;  // report_tokens rows still running: their new tokens
  int64_t running = 0;                      // requests still decoding after this call
  int64_t blocks_in_use = 0;
  int64_t blocks_total = 0;
  int64_t block_size = 0;
  int64_t states_in_use = 0;  // recurrent state slots (hybrid models; 0 and 0 for a dense one)
  int64_t states_total = 0;
  MSGPACK_DEFINE_MAP(finished, rejected, deferred, progress, running, blocks_in_use,
                     blocks_total, block_size, states_in_use, states_total);
};

}  // namespace twinkle::ipc
