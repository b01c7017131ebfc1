#include "core/ipc/envelope.h"

#include <string_view>

#include <msgpack.hpp>

#include "absl/strings/str_cat.h"
#include "core/ipc/messages.h"

namespace twinkle::ipc {
namespace {

// The envelope travels as a msgpack map with short fixed keys, so both sides can add
// fields later without breaking older readers (unknown keys are ignored).
constexpr std::string_view kVersion = "v";
constexpr std::string_view kType = "t";
constexpr std::string_view kRequestId = "id";
constexpr std::string_view kMethod = "m";
constexpr std::string_view kCode = "c";
constexpr std::string_view kError = "e";
constexpr std::string_view kBody = "b";

bool KnownType(uint64_t t) {
  return t >= static_cast<uint64_t>(MessageType::kHello) &&
         t <= static_cast<uint64_t>(MessageType::kWorkerExited);
}

}  // namespace

std::vector<std::string> EncodeFrames(const Message& message) {
  const Envelope& e = message.envelope;
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> pk(buffer);
  pk.pack_map(7);
  pk.pack(kVersion), pk.pack(e.version);
  pk.pack(kType), pk.pack(static_cast<uint8_t>(e.type));
  pk.pack(kRequestId), pk.pack(e.request_id);
  pk.pack(kMethod), pk.pack(e.method);
  pk.pack(kCode), pk.pack(e.code);
  pk.pack(kError), pk.pack(e.error);
  pk.pack(kBody);
  pk.pack_bin(static_cast<uint32_t>(e.body.size()));
  pk.pack_bin_body(e.body.data(), static_cast<uint32_t>(e.body.size()));

  std::vector<std::string> frames;
  frames.reserve(1 + message.buffers.size());
  frames.emplace_back(buffer.data(), buffer.size());
  for (const std::string& b : message.buffers) frames.push_back(b);
  return frames;
}

absl::Status CheckFrames(const std::vector<std::string>& frames, const DecodeLimits& limits) {
  if (frames.empty()) return absl::InvalidArgumentError("ipc: message has no envelope frame");
  if (frames.size() > limits.max_frames) {
    return absl::ResourceExhaustedError(
        absl::StrCat("ipc: message has ", frames.size(), " frames; limit is ", limits.max_frames));
  }
  if (frames[0].size() > limits.max_envelope_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("ipc: envelope of ", frames[0].size(),
                                                     " bytes exceeds the limit of ",
                                                     limits.max_envelope_bytes));
  }
  for (size_t i = 1; i < frames.size(); ++i) {
    if (frames[i].size() > limits.max_buffer_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat("ipc: tensor frame ", i, " of ",
                                                       frames[i].size(),
                                                       " bytes exceeds the limit of ",
                                                       limits.max_buffer_bytes));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Envelope> DecodeEnvelope(absl::string_view head, const DecodeLimits& limits) {
  if (head.size() > limits.max_envelope_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("ipc: envelope of ", head.size(),
                                                     " bytes exceeds the limit of ",
                                                     limits.max_envelope_bytes));
  }
  Envelope e;
  bool has_version = false, has_type = false;
  try {
    msgpack::object_handle handle =
        msgpack::unpack(head.data(), head.size(), nullptr, nullptr, UnpackLimitFor(head.size()));
    const msgpack::object& root = handle.get();
    if (root.type != msgpack::type::MAP) {
      return absl::InvalidArgumentError("ipc: envelope is not a msgpack map");
    }
    for (uint32_t i = 0; i < root.via.map.size; ++i) {
      const msgpack::object_kv& kv = root.via.map.ptr[i];
      if (kv.key.type != msgpack::type::STR) {
        return absl::InvalidArgumentError("ipc: envelope key is not a string");
      }
      const std::string_view key(kv.key.via.str.ptr, kv.key.via.str.size);
      if (key == kVersion) {
        e.version = kv.val.as<uint32_t>();
        has_version = true;
      } else if (key == kType) {
        const auto t = kv.val.as<uint64_t>();
        if (!KnownType(t)) {
          return absl::InvalidArgumentError(absl::StrCat("ipc: unknown message type ", t));
        }
        e.type = static_cast<MessageType>(t);
        has_type = true;
      } else if (key == kRequestId) {
        e.request_id = kv.val.as<uint64_t>();
      } else if (key == kMethod) {
        e.method = kv.val.as<std::string>();
      } else if (key == kCode) {
        e.code = kv.val.as<int32_t>();
      } else if (key == kError) {
        e.error = kv.val.as<std::string>();
      } else if (key == kBody) {
        if (kv.val.type != msgpack::type::BIN) {
          return absl::InvalidArgumentError("ipc: envelope body is not a binary field");
        }
        e.body.assign(kv.val.via.bin.ptr, kv.val.via.bin.size);
      }
    }
  } catch (const std::exception& ex) {  // msgpack reports malformed input by throwing
    return absl::InvalidArgumentError(absl::StrCat("ipc: malformed envelope: ", ex.what()));
  }
  if (!has_version || !has_type) {
    return absl::InvalidArgumentError("ipc: envelope lacks its version or type field");
  }
  if (e.version != kProtocolVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "ipc: protocol version ", e.version, " does not match ours (", kProtocolVersion, ")"));
  }
  return e;
}

absl::StatusOr<Message> DecodeFrames(std::vector<std::string> frames, const DecodeLimits& limits) {
  if (absl::Status s = CheckFrames(frames, limits); !s.ok()) return s;
  absl::StatusOr<Envelope> envelope = DecodeEnvelope(frames[0], limits);
  if (!envelope.ok()) return envelope.status();
  Message message;
  message.envelope = *std::move(envelope);
  message.buffers.assign(std::make_move_iterator(frames.begin() + 1),
                         std::make_move_iterator(frames.end()));
  return message;
}

Message MakeRequest(std::string method, std::string body, std::vector<std::string> buffers) {
  Message request;
  request.envelope.type = MessageType::kRequest;
  request.envelope.method = std::move(method);
  request.envelope.body = std::move(body);
  request.buffers = std::move(buffers);
  return request;
}

Message MakeReply(const Envelope& request, const absl::Status& status, std::string body) {
  Message reply;
  reply.envelope.type = MessageType::kReply;
  reply.envelope.request_id = request.request_id;
  reply.envelope.method = request.method;
  reply.envelope.code = static_cast<int32_t>(status.code());
  if (!status.ok()) {
    reply.envelope.error = std::string(status.message());
  } else {
    reply.envelope.body = std::move(body);
  }
  return reply;
}

absl::Status ReplyStatus(const Envelope& reply) {
  if (reply.code == 0) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(reply.code), reply.error);
}

absl::string_view MessageTypeName(MessageType type) {
  switch (type) {
    case MessageType::kHello: return "hello";
    case MessageType::kHelloAck: return "hello_ack";
    case MessageType::kHeartbeat: return "heartbeat";
    case MessageType::kRequest: return "request";
    case MessageType::kReply: return "reply";
    case MessageType::kShutdown: return "shutdown";
    case MessageType::kNodeHello: return "node_hello";
    case MessageType::kSpawnWorker: return "spawn_worker";
    case MessageType::kKillWorker: return "kill_worker";
    case MessageType::kWorkerExited: return "worker_exited";
  }
  return "unknown";
}

}  // namespace twinkle::ipc
