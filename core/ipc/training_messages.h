#pragma once
// Bodies of the training methods between the coordinator and an engine worker (msgpack
// maps; a key a sender omits keeps the default below). Tensors travel as frames referenced
// by ipc::TensorDesc; an absent optional tensor has an empty dtype.

#include <cstdint>
#include <map>
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

struct CreateAdapterRequest {
  std::string adapter_id;
  int64_t rank = 8;
  double alpha = 16;
  double dropout = 0;
  bool use_rslora = false;
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
  MSGPACK_DEFINE_MAP(ops, return_logits);
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
  MSGPACK_DEFINE_MAP(adapter_id, hyper);
};
struct OptimStepReply {
  double grad_norm = 0;
  double learning_rate = 0;
  int64_t step = 0;
  MSGPACK_DEFINE_MAP(grad_norm, learning_rate, step);
};

struct AdapterStateReply {
  std::map<std::string, TensorDesc> weights;    // PEFT keys
  std::map<std::string, TensorDesc> grads;      // accumulated, where any
  std::map<std::string, TensorDesc> optimizer;  // optimizer state tensors
  int64_t step = 0;
  MSGPACK_DEFINE_MAP(weights, grads, optimizer, step);
};
// Restores what get_adapter_state returned. Weights may be a subset (by PEFT key); the
// optimizer state, when given, is replaced whole (validated first: nothing changes on error).
struct SetAdapterStateRequest {
  std::string adapter_id;
  std::map<std::string, TensorDesc> weights;
  std::map<std::string, TensorDesc> optimizer;
  MSGPACK_DEFINE_MAP(adapter_id, weights, optimizer);
};

}  // namespace twinkle::ipc
