#pragma once
// Serialises tensors into the safetensors format (an 8-byte little-endian header length, a
// JSON header {"__metadata__": {...}, name: {dtype, shape, data_offsets}, ...}, then the raw
// bytes), byte-compatible with the Python `safetensors` package (checked against 0.8.0):
//   - tensors are laid out (and listed in the header) by dtype, descending in the crate's
//     Dtype enum order (I64, F64, F32, I32, BF16, F16, I16, I8, U8, BOOL), then by name
//     (byte order);
//   - compact JSON (no spaces), keys in each tensor as dtype, shape, data_offsets; strings
//     escaped as serde_json does (\" \\ \b \f \n \r \t, other control bytes as
//     backslash-u00xx in lower-case hex,
//     everything else raw UTF-8);
//   - "__metadata__" first, and only when `metadata` is non-empty; its keys in sorted order
//     (Python's order there depends on a per-process hash seed, so only a sorted order can
//     be reproduced);
//   - the header padded with spaces to a multiple of 8 bytes; no padding between tensors.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace twinkle::storage {

struct TensorBytes {
  std::string dtype;            // safetensors names: F32, F16, BF16, F64, I64, I32, I16, I8, U8, BOOL
  std::vector<int64_t> shape;
  std::string bytes;            // row-major, little-endian; size must match dtype × shape
};

struct TensorSpec {
  std::string dtype;
  std::vector<int64_t> shape;
};

// Where each tensor goes in a file of the format above, for writers that stream the tensor
// bytes instead of holding them: write `prefix` (length + header), then each tensor of
// `order` with exactly `nbytes` bytes, in that order.
struct SafetensorsLayout {
  struct Slot {
    std::string name;
    uint64_t nbytes = 0;
  };
  std::string prefix;
  std::vector<Slot> order;
  uint64_t file_size = 0;
};

// InvalidArgument as SerializeSafetensors (byte sizes aside).
absl::StatusOr<SafetensorsLayout> PlanSafetensors(const std::map<std::string, TensorSpec>& tensors,
                                                  const std::map<std::string, std::string>& metadata = {});

// InvalidArgument naming the tensor when its byte size does not match dtype and shape, its
// dtype is unknown, a dimension is negative, or a name is "__metadata__" or not valid UTF-8.
absl::StatusOr<std::string> SerializeSafetensors(
    const std::map<std::string, TensorBytes>& tensors,
    const std::map<std::string, std::string>& metadata = {});

// The safetensors dtype name for an IPC dtype name ("float32" → "F32", ...): float64,
// float32, float16, bfloat16, int64, int32, int16, int8, uint8, bool. InvalidArgument else.
absl::StatusOr<std::string> SafetensorsDtype(const std::string& ipc_dtype);

}  // namespace twinkle::storage
