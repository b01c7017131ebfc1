#pragma once
// What the transports hand to the training coordinator and get back: plain structs, no
// protobuf, no torch. The gRPC TrainingService and (later) the Tinker HTTP API both map
// their wire types onto these.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "core/tenancy/tenant.h"

namespace twinkle::training {

// The caller, already authenticated, with the limits that apply to it.
struct TenantContext {
  std::string id;
  int64_t key_id = 0;  // the calling API key (usage metering; 0 = unknown)
  int32_t max_adapters = 64;
  int32_t max_lora_rank = 64;
  int64_t max_tokens_per_request = 32768;
  int32_t max_pending_ops = 256;
  int32_t max_sessions = 256;
};

// The one mapping from an authenticated tenant to the coordinator's view of it (every
// transport calls this).
inline TenantContext ContextOf(const tenancy::Tenant& tenant) {
  TenantContext t;
  t.id = tenant.id;
  t.key_id = tenant.key_id;
  t.max_adapters = tenant.quotas.max_adapters;
  t.max_lora_rank = tenant.quotas.max_lora_rank;
  t.max_tokens_per_request = tenant.quotas.max_tokens_per_request;
  t.max_pending_ops = tenant.quotas.max_pending_ops;
  t.max_sessions = tenant.quotas.max_sessions;
  return t;
}

// The one LoRA alpha default of every API (Twinkle's AddAdapter with lora_alpha unset,
// Tinker's create_model, which has no alpha): PEFT-style scaling alpha / rank.
inline constexpr double kDefaultLoraAlpha = 32;

struct LoraArgs {
  int64_t rank = 8;
  double alpha = kDefaultLoraAlpha;
  double dropout = 0;
  std::vector<std::string> targets = {"all-linear"};
  bool use_rslora = false;
  uint64_t seed = 0;
};

struct AddAdapterArgs {
  std::string name;
  LoraArgs lora;
  int32_t gradient_accumulation_steps = 1;
  std::string session_id;  // empty: not tied to a session
};

struct AddAdapterResult {
  std::string name;
  int64_t num_parameters = 0;
  std::string run_id;
};

// One sequence. labels: HF convention (same length as input_ids, -100 = not trained,
// labels[i] is the token at position i); empty = train on every next token.
struct Feature {
  std::vector<int64_t> input_ids;
  std::vector<int64_t> labels;
};

// Tinker's datum: explicit per-position targets and loss inputs (no label shifting).
struct TokenDatum {
  std::vector<int64_t> input_tokens;   // [N]
  std::vector<int64_t> target_tokens;  // [N]: position i predicts target_tokens[i]
  // K > 0: soft targets, target_tokens (and any input of N·K values) are [N, K] row-major,
  // K tokens per position (Tinker's top-k distillation; cross_entropy). 0: [N].
  int64_t target_width = 0;
  // weights, logprobs, advantages, clip_low_threshold, clip_high_threshold: [N] each.
  std::map<std::string, std::vector<float>> inputs;
};

// A loss for one call, instead of the adapter's SetLoss (Tinker names a loss per call).
struct LossOverride {
  std::string name;  // an engine loss name: cross_entropy, importance_sampling, ppo, cispo, dro
  std::map<std::string, double> config;
  std::map<std::string, std::string> string_config;
};

struct ForwardArgs {
  // Either `inputs` (Twinkle, HF labels) or `datums` (Tinker), not both.
  std::vector<TokenDatum> datums;
  std::optional<LossOverride> loss;
  std::vector<Feature> inputs;
  std::vector<float> advantages;               // one per sequence, or empty
  std::vector<std::vector<float>> old_logps;   // per sequence, one per trained token, or empty
  std::vector<std::vector<float>> ref_logps;   // likewise
};

enum class ForwardMode {
  kForward,          // adapter's loss, no gradient; remembered for CalculateLoss / Backward
  kForwardOnly,      // log-probs only
  kForwardBackward,  // adapter's loss, gradients accumulated
};

// The gradient-accumulation-gated controls of Twinkle's model.
enum class Control { kClipGradNorm, kStep, kZeroGrad, kLrStep, kClipGradAndStep };

// Where and when a queued op runs.
struct SubmitOptions {
  absl::Time deadline = absl::InfiniteFuture();
  int64_t seq_id = -1;
  // Non-empty: a retry with the same key (same adapter, same op, same fingerprint) gets the
  // first submission's future; the same key on another op or body is refused.
  std::string idempotency_key;
  uint64_t fingerprint = 0;  // a hash of the request body, from the transport; 0 = unknown
};

struct SequenceResult {
  std::vector<float> logps;  // [L]: position i holds log p(token i+1 | tokens <= i); last 0
  std::vector<float> loss;   // [L] each position's contribution to the loss, or empty
};

// A training run: one adapter's life on this server (run_id = "{session}-{adapter_name}").
struct RunInfo {
  std::string run_id;
  std::string adapter_name;
  std::string tenant;
  int64_t lora_rank = 0;
  std::vector<std::string> target_modules;
  absl::Time created;
  absl::Time last_request;
};

struct FloatTensor {
  std::vector<int64_t> shape;
  std::vector<float> values;
};

// The result of any queued op; fields an op does not produce stay empty.
struct OpOutput {
  std::vector<SequenceResult> sequences;
  double loss = 0;
  std::map<std::string, double> metrics;
  double value = 0;      // clip_grad_norm: pre-clip norm; step: the learning rate used
  bool skipped = false;  // gated by gradient accumulation
  std::string text;      // get_train_configs
  std::map<std::string, std::string> metric_strings;  // calculate_metric
  std::map<std::string, FloatTensor> tensors;          // get_state_dict: PEFT key → weight
  // save: where the checkpoint went.
  std::string checkpoint_uri;  // twinkle://<run_id>/weights/<name>
  std::string checkpoint_dir;  // the server's directory
  // resume_from_checkpoint: where training stands now.
  int64_t cur_step = 0;
  int64_t consumed_train_samples = 0;
  int32_t gradient_accumulation_steps = 0;
};

struct SaveArgs {
  std::string name;  // empty: a timestamp, YYYYmmdd_HHMMSS (Twinkle)
  bool save_optimizer = true;
  bool is_sampler = false;
  bool is_external = false;  // save_weights_external: a PEFT directory for download (adapter files only)
  int64_t consumed_train_samples = 0;
  std::optional<int64_t> ttl_seconds;  // the checkpoint expires this long after it is saved
};

enum class LoadMode {
  kWeights,          // Twinkle load(name): weights only; the optimizer keeps its state, as in Twinkle
  kWeightsFreshOptimizer,  // Tinker load_state: weights, and a fresh optimizer (step 0, no moments)
  kWeightsAndOptimizer,  // load(name, load_optimizer=True) / Tinker load_state_with_optimizer
  kResume,           // resume_from_checkpoint: weights, optimizer, schedule, counters
  kResumeOnlyModel,  // resume_from_checkpoint(resume_only_model=True): weights only
};

}  // namespace twinkle::training
