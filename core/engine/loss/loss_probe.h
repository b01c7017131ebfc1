#pragma once
// Engine IPC method "loss_probe": runs ComputeLoss on tensors sent by a test and returns the
// loss, its per-token terms and d total / d logprobs, so Python tests can check exactly the
// C++ loss code against reference formulas without a model.
//
// Request body (msgpack map):
//   {"loss": {"name": str, "config": {str: number | bool | str}},
//    "datums": [{"logprobs": TensorDesc, "inputs": {name: TensorDesc}}],
//    "context": {"window_tokens": int, "window_sequences": int}}
// Reply body:
//   {"total": float, "elementwise": [TensorDesc], "grad_logprobs": [TensorDesc],
//    "metrics": {str: float}}

#include "absl/status/statusor.h"
#include "core/ipc/envelope.h"

namespace twinkle::engine {

inline constexpr char kMethodLossProbe[] = "loss_probe";

// Never throws: bad bodies and bad inputs are InvalidArgument, LibTorch errors Internal.
absl::StatusOr<ipc::Message> RunLossProbe(const ipc::Message& request);

}  // namespace twinkle::engine
