#pragma once
// Tensors across the IPC boundary: a tensor travels as a raw frame (Message::buffers) plus an
// ipc::TensorDesc (dtype name, shape, frame index) inside the msgpack body.

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/ipc/envelope.h"
#include "core/ipc/messages.h"

namespace twinkle::engine {

// Copies `tensor` (any device, made contiguous on CPU) into a new frame of `message` and
// returns its descriptor. Supported dtypes: float32/64, bfloat16, float16, int64/32, uint8, bool.
absl::StatusOr<ipc::TensorDesc> AppendTensor(const at::Tensor& tensor, ipc::Message& message);

// A CPU tensor that owns a copy of the frame `desc` names (validated first).
absl::StatusOr<at::Tensor> ReadTensor(const ipc::TensorDesc& desc, const ipc::Message& message);

}  // namespace twinkle::engine
