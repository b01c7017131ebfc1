#pragma once
// Typed bodies of the coordinator <-> engine messages, serialized with msgpack as maps
// (field names on the wire, so adding a field stays compatible). Method names are the
// constants below; each request body has a matching reply body.

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include <msgpack.hpp>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace twinkle::ipc {

// Sent by a worker as its first message (MessageType::kHello).
struct HelloBody {
  uint32_t protocol_version = 0;
  std::string engine_version;
  int32_t rank = 0;
  int64_t pid = 0;
  std::string device;
  MSGPACK_DEFINE_MAP(protocol_version, engine_version, rank, pid, device);
};

// Sent by a worker every heartbeat interval (MessageType::kHeartbeat).
struct HeartbeatBody {
  uint64_t sequence = 0;
  uint64_t busy_request_id = 0;  // the request being executed, 0 when idle
  MSGPACK_DEFINE_MAP(sequence, busy_request_id);
};

// Node agents (MessageType::kNodeHello etc., docs/device_pool.md "Engines on other nodes").
struct NodeHelloBody {
  uint32_t protocol_version = 0;
  std::string node;  // the name the coordinator's engine.devices use ("cpu@NODE")
  int64_t pid = 0;
  MSGPACK_DEFINE_MAP(protocol_version, node, pid);
};
struct SpawnWorkerBody {
  std::string identity;           // the engine's routing id
  std::vector<std::string> args;  // twinkle-engine's arguments; the agent adds its endpoint and key
  MSGPACK_DEFINE_MAP(identity, args);
};
struct KillWorkerBody {
  std::string identity;
  MSGPACK_DEFINE_MAP(identity);
};
struct WorkerExitedBody {
  std::string identity;
  std::string how;  // "exit code 1", "signal 9", or why it could not start
  MSGPACK_DEFINE_MAP(identity, how);
};

// method "load_model": load an HF model directory onto the worker's device.
inline constexpr char kMethodLoadModel[] = "load_model";
struct LoadModelRequest {
  std::string model_dir;
  std::string dtype;   // float32 | bfloat16 | float16
  std::string device;  // cpu | cuda:N
  int64_t max_lora_rank = 0;  // create_adapter refuses larger ranks; 0 = no limit
  int64_t kv_cache_blocks = 0;  // sampler KV cache blocks per worker; 0 = 2048
  int64_t kv_block_size = 0;    // tokens per KV block; 0 = 16
  int64_t state_slots = 0;      // recurrent state slots (hybrid models only); 0 = 64
  // Training memory: recompute each decoder layer in backward (activation checkpointing),
  // and rows per lm_head/log-softmax chunk (0 = engine default, LogitChunkRows).
  bool activation_checkpointing = false;
  int64_t logit_chunk_rows = 0;
  MSGPACK_DEFINE_MAP(model_dir, dtype, device, max_lora_rank, kv_cache_blocks, kv_block_size,
                     state_slots, activation_checkpointing, logit_chunk_rows);
};
struct LoadModelReply {
  std::string architecture;
  std::string model_type;
  int64_t parameter_count = 0;
  std::string dtype;
  std::string device;
  int32_t num_layers = 0;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  std::vector<std::string> supported_losses;
  double load_seconds = 0;
  int64_t kv_cache_blocks = 0;  // the sampler's KV cache, as allocated
  int64_t kv_block_size = 0;
  int64_t max_position_embeddings = 0;
  int32_t world_size = 1;  // the data-parallel process group this rank joined (1 = none)
  int64_t state_slots = 0;  // the sampler's recurrent state slots, as allocated (0: dense model)
  // A forward_backward's activation memory: fixed + chunk_row · min(chunk_rows, Σ L) +
  // token · Σ L + seq_sq · Σ L² bytes over its sequences (core/common/activation_memory.h);
  // all 0 from an engine that does not say.
  int64_t activation_fixed_bytes = 0;
  int64_t activation_token_bytes = 0;
  int64_t activation_seq_sq_bytes = 0;
  int64_t activation_chunk_rows = 0;
  int64_t activation_chunk_row_bytes = 0;
  MSGPACK_DEFINE_MAP(architecture, model_type, parameter_count, dtype, device, num_layers,
                     vocab_size, hidden_size, supported_losses, load_seconds, kv_cache_blocks,
                     kv_block_size, max_position_embeddings, world_size, state_slots,
                     activation_fixed_bytes, activation_token_bytes, activation_seq_sq_bytes,
                     activation_chunk_rows, activation_chunk_row_bytes);
};

// Describes a tensor travelling as a raw frame: frame index into Message::buffers.
struct TensorDesc {
  std::string dtype;  // float32 | bfloat16 | float16 | int64 | int32 | uint8 | bool
  std::vector<int64_t> shape;
  uint32_t frame = 0;
  MSGPACK_DEFINE_MAP(dtype, shape, frame);
};

// Bytes per element of a TensorDesc dtype name, or an error naming the dtype.
absl::StatusOr<size_t> DtypeItemSize(absl::string_view dtype);

// Checks that `desc` names an existing frame whose size is exactly numel * itemsize.
absl::Status ValidateTensor(const TensorDesc& desc, const std::vector<std::string>& buffers);

// The dtype name of an element type that travels in 1-D frames.
template <typename T>
constexpr const char* VectorDtype() {
  if constexpr (std::is_same_v<T, float>) return "float32";
  else if constexpr (std::is_same_v<T, int64_t>) return "int64";
  else static_assert(sizeof(T) == 0, "no frame dtype for this element type");
}

// Appends `values` to `buffers` as a 1-D frame and describes it.
template <typename T>
TensorDesc AppendVectorFrame(const std::vector<T>& values, std::vector<std::string>& buffers) {
  TensorDesc desc;
  desc.dtype = VectorDtype<T>();
  desc.shape = {static_cast<int64_t>(values.size())};
  desc.frame = static_cast<uint32_t>(buffers.size());
  buffers.emplace_back(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
  return desc;
}

// A frame's elements, flattened; InternalError naming `what` (e.g. "sample_step reply") when
// the frame is not of T's dtype or does not match its description.
template <typename T>
absl::StatusOr<std::vector<T>> ReadVectorFrame(const TensorDesc& desc, const std::vector<std::string>& buffers,
                                               absl::string_view what) {
  if (desc.dtype != VectorDtype<T>()) {
    return absl::InternalError(absl::StrCat(what, ": expected ", VectorDtype<T>(), ", got ", desc.dtype));
  }
  if (absl::Status s = ValidateTensor(desc, buffers); !s.ok()) return s;
  const std::string& frame = buffers[desc.frame];
  std::vector<T> out(frame.size() / sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), frame.data(), frame.size());
  return out;
}

// Debug methods, answered only by a worker started with --test-hooks (the server passes
// it when the config sets testing.hooks): they stand in for a hung device step and for a
// result too large for the link, so tests can check what the coordinator does about each.
inline constexpr char kMethodDebugSleep[] = "debug_sleep";          // sleeps, then replies
inline constexpr char kMethodDebugReplyFrames[] = "debug_reply_frames";  // replies with N frames
struct DebugRequest {
  int64_t milliseconds = 0;  // debug_sleep
  int64_t frames = 0;        // debug_reply_frames: empty tensor frames in the reply
  MSGPACK_DEFINE_MAP(milliseconds, frames);
};

// Limits for msgpack::unpack of `bytes` input bytes. msgpack-c allocates an array's or a map's
// elements as soon as it reads the count in its header, so the 5 bytes dd ff ff ff ff would
// ask for 96 GiB before a single element is read. Every element takes at least one byte (a
// map entry two), so no count in a well-formed input exceeds its size; nesting is bounded
// too (the deepest body, a sample_step reply, nests about 8 levels).
inline constexpr size_t kMaxUnpackDepth = 32;
inline msgpack::unpack_limit UnpackLimitFor(size_t bytes) {
  return msgpack::unpack_limit(/*array=*/bytes, /*map=*/bytes / 2, /*str=*/bytes, /*bin=*/bytes, /*ext=*/bytes,
                               /*depth=*/kMaxUnpackDepth);
}

template <typename T>
std::string Pack(const T& value) {
  msgpack::sbuffer buffer;
  msgpack::pack(buffer, value);
  return std::string(buffer.data(), buffer.size());
}

// Decodes a body; a malformed or mistyped body is InvalidArgument naming `what`.
template <typename T>
absl::StatusOr<T> Unpack(const std::string& bytes, absl::string_view what) {
  try {
    msgpack::object_handle handle =
        msgpack::unpack(bytes.data(), bytes.size(), nullptr, nullptr, UnpackLimitFor(bytes.size()));
    return handle.get().as<T>();
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("ipc: malformed ", what, " body: ", e.what()));
  }
}

}  // namespace twinkle::ipc
