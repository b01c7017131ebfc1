#pragma once
// Engine IPC method "optim_probe": runs an Optimizer (and optionally an LrScheduler) over
// caller-supplied parameters and per-step gradients, so tests drive exactly the engine's
// optimizer code from Python and compare it with torch.optim. It touches no model or adapter.
//
// Request body (msgpack map; tensors as ipc::TensorDesc):
//   optimizer  "adamw" | "adam" | "sgd"
//   params     [TensorDesc]                     initial parameter values
//   grads      [[TensorDesc | nil per param] per step]   an empty list or nil = no gradient
//   hyper      [{OptimizerHyper fields} per step]        missing fields take their defaults
//   scheduler  optional {"name", "config": {key: number}}
//   base_lr    number; with a scheduler, step i uses scheduler.LearningRate(base_lr, i)
// Reply: {"params": [TensorDesc], "state": {name: TensorDesc},
//         "results": [{"grad_norm", "learning_rate", "step"} per step]}

#include "absl/status/statusor.h"
#include "core/ipc/envelope.h"

namespace twinkle::engine {

absl::StatusOr<ipc::Message> RunOptimProbe(const ipc::Message& request);

}  // namespace twinkle::engine
