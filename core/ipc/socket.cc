#include "core/ipc/socket.h"

#include <vector>

#include <zmq_addon.hpp>

#include "absl/strings/str_cat.h"

namespace twinkle::ipc {

absl::Status SendMessage(zmq::socket_t& socket, const Message& message,
                         absl::string_view routing_id, const DecodeLimits& limits) {
  std::vector<std::string> frames = EncodeFrames(message);
  if (absl::Status s = CheckFrames(frames, limits); !s.ok()) return s;
  try {
    if (!routing_id.empty()) {
      socket.send(zmq::buffer(routing_id.data(), routing_id.size()), zmq::send_flags::sndmore);
    }
    for (size_t i = 0; i < frames.size(); ++i) {
      const auto flags = i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none;
      socket.send(zmq::buffer(frames[i]), flags);
    }
  } catch (const zmq::error_t& e) {
    return absl::UnavailableError(absl::StrCat("ipc: send failed: ", e.what()));
  }
  return absl::OkStatus();
}

absl::StatusOr<Received> ReceiveMessage(zmq::socket_t& socket, bool with_routing_id,
                                        const DecodeLimits& limits) {
  std::vector<zmq::message_t> parts;
  try {
    const auto n = zmq::recv_multipart(socket, std::back_inserter(parts), zmq::recv_flags::dontwait);
    if (!n) return absl::NotFoundError("ipc: no message waiting");
  } catch (const zmq::error_t& e) {
    return absl::UnavailableError(absl::StrCat("ipc: receive failed: ", e.what()));
  }
  Received received;
  size_t first = 0;
  if (with_routing_id) {
    if (parts.empty()) {
      received.message = absl::InvalidArgumentError("ipc: empty message");
      return received;
    }
    received.routing_id = parts[0].to_string();
    first = 1;
  }
  std::vector<std::string> frames;
  frames.reserve(parts.size() - first);
  for (size_t i = first; i < parts.size(); ++i) frames.push_back(parts[i].to_string());
  if (frames.empty()) {
    received.message = absl::InvalidArgumentError("ipc: message has no envelope frame");
    return received;
  }
  const absl::Status within_limits = CheckFrames(frames, limits);
  absl::StatusOr<Envelope> envelope = DecodeEnvelope(frames[0], limits);
  if (!envelope.ok()) {
    received.message = envelope.status();
  } else if (!within_limits.ok()) {
    received.message = within_limits;
    received.header = *std::move(envelope);
  } else {
    Message message;
    message.envelope = *std::move(envelope);
    message.buffers.assign(std::make_move_iterator(frames.begin() + 1),
                           std::make_move_iterator(frames.end()));
    received.message = std::move(message);
  }
  return received;
}

}  // namespace twinkle::ipc
