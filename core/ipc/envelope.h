#pragma once
// The message schema between the coordinator (twinkle-server) and its engine workers
// (twinkle-engine). Both processes link this library; it depends on neither torch nor
// protobuf, which is what keeps the two runtimes in separate address spaces.
//
// A message is a list of frames (one ZeroMQ multipart message):
//   frame 0      msgpack map: the Envelope (version, type, request id, method, status, body)
//   frames 1..N  raw tensor buffers, referenced from the body by index (TensorDesc::frame)
// Tensor bytes never pass through msgpack, so large tensors are not copied into it.

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace twinkle::ipc {

// Bumped on any incompatible change to the envelope or a method body. The coordinator
// refuses a worker whose handshake reports another version.
inline constexpr uint32_t kProtocolVersion = 1;

enum class MessageType : uint8_t {
  kHello = 1,      // worker -> coordinator, first message after connecting
  kHelloAck = 2,   // coordinator -> worker, accepts the handshake
  kHeartbeat = 3,  // worker -> coordinator, every heartbeat interval
  kRequest = 4,    // coordinator -> worker, carries request_id + method + body
  kReply = 5,      // worker -> coordinator, same request_id, status code + body
  kShutdown = 6,   // coordinator -> worker, exit cleanly
  // Node agents (`twinkle-server worker --join`, docs/device_pool.md "Engines on other
  // nodes"): a process on another node that starts the engines the coordinator places there.
  kNodeHello = 7,     // agent -> coordinator, first message (NodeHelloBody); answered by kHelloAck
  kSpawnWorker = 8,   // coordinator -> agent: start an engine (SpawnWorkerBody)
  kKillWorker = 9,    // coordinator -> agent: SIGKILL one of its engines (KillWorkerBody)
  kWorkerExited = 10, // agent -> coordinator: an engine it started ended (WorkerExitedBody)
};

// Limits of one message, applied by both ends: a sender checks its encoded frames
// (CheckFrames) before sending, so a message the peer would refuse is never sent, and a
// receiver rejects a larger one before parsing it. They are sized so that every legitimate
// message fits: the adapter state of an 80-layer model with every target and its optimizer
// (about 3,400 tensors, a few hundred KiB of descriptors), a 1024-datum chunk with five
// tensors per datum, and a sampling reply of 16 prompts x 128 samples (two frames a row).
struct DecodeLimits {
  size_t max_envelope_bytes = size_t{64} << 20;  // the msgpack frame (64 MiB)
  size_t max_buffer_bytes = size_t{1} << 34;     // one tensor frame (16 GiB)
  size_t max_frames = size_t{1} << 20;
};

struct Envelope {
  uint32_t version = kProtocolVersion;
  MessageType type = MessageType::kRequest;
  uint64_t request_id = 0;
  std::string method;     // requests and replies: what to run
  int32_t code = 0;       // replies: an absl::StatusCode (0 = OK)
  std::string error;      // replies: the error message when code != 0
  std::string body;       // msgpack bytes of the method's own body struct (may be empty)
};

struct Message {
  Envelope envelope;
  std::vector<std::string> buffers;  // raw tensor bytes, frames 1..N
};

// Serializes a message into frames. Never fails for a well-formed Message.
std::vector<std::string> EncodeFrames(const Message& message);

// Checks encoded frames against `limits` (the checks DecodeFrames applies before parsing):
// ResourceExhausted naming the count or size and the limit.
absl::Status CheckFrames(const std::vector<std::string>& frames, const DecodeLimits& limits = {});

// Parses the envelope frame alone (frame 0), e.g. to answer a message whose other frames
// were refused. Same errors as DecodeFrames, less the frame checks.
absl::StatusOr<Envelope> DecodeEnvelope(absl::string_view head, const DecodeLimits& limits = {});

// Parses frames into a message. Rejects (InvalidArgument / ResourceExhausted) a missing
// envelope, an envelope that is not a msgpack map of the expected shape, an unknown type,
// a protocol version mismatch, and frames over `limits`.
absl::StatusOr<Message> DecodeFrames(std::vector<std::string> frames,
                                     const DecodeLimits& limits = {});

// A request for `method` (the link that sends it assigns the request id).
Message MakeRequest(std::string method, std::string body, std::vector<std::string> buffers = {});

// Builds a reply to `request` carrying `status` (and `body` when status is OK).
Message MakeReply(const Envelope& request, const absl::Status& status, std::string body = {});

// The status a reply carries.
absl::Status ReplyStatus(const Envelope& reply);

absl::string_view MessageTypeName(MessageType type);

}  // namespace twinkle::ipc
