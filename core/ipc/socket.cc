#include "core/ipc/socket.h"

#include <sys/stat.h>

#include <fstream>
#include <vector>

#include <zmq_addon.hpp>

#include "absl/strings/ascii.h"
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

namespace {

constexpr size_t kZ85KeyChars = 40;

absl::Status CurveAvailable() {
  if (zmq_has("curve") == 0) {
    return absl::FailedPreconditionError("this libzmq was built without CURVE security; engines on other nodes need it");
  }
  return absl::OkStatus();
}

absl::Status SetKey(zmq::socket_t& socket, int option, const std::string& z85) {
  if (zmq_setsockopt(socket.handle(), option, z85.c_str(), z85.size()) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("node secret: ", zmq_strerror(zmq_errno())));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> NewNodeSecret() {
  if (absl::Status s = CurveAvailable(); !s.ok()) return s;
  char public_key[kZ85KeyChars + 1], secret_key[kZ85KeyChars + 1];
  if (zmq_curve_keypair(public_key, secret_key) != 0) {
    return absl::InternalError(absl::StrCat("cannot make a CURVE key pair: ", zmq_strerror(zmq_errno())));
  }
  return std::string(secret_key, kZ85KeyChars);
}

absl::StatusOr<std::string> NodePublicKey(const std::string& secret) {
  if (absl::Status s = CurveAvailable(); !s.ok()) return s;
  char public_key[kZ85KeyChars + 1];
  if (secret.size() != kZ85KeyChars || zmq_curve_public(public_key, secret.c_str()) != 0) {
    return absl::InvalidArgumentError("node secret: not a Z85 CURVE secret key (40 characters; make one with "
                                      "`twinkle-server node-secret`)");
  }
  return std::string(public_key, kZ85KeyChars);
}

absl::StatusOr<std::string> ReadNodeSecret(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) return absl::NotFoundError(absl::StrCat("node secret file ", path, " not found"));
  // Group access is allowed: Kubernetes gives a Secret volume's files to the pod's fsGroup.
  if ((st.st_mode & S_IRWXO) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("node secret file ", path, " may be read by any user; chmod 600 it"));
  }
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  const std::string secret(absl::StripAsciiWhitespace(line));
  if (absl::StatusOr<std::string> pub = NodePublicKey(secret); !pub.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", pub.status().message()));
  }
  return secret;
}

absl::Status SetCurveServer(zmq::socket_t& socket, const std::string& secret) {
  if (absl::Status s = CurveAvailable(); !s.ok()) return s;
  const int on = 1;
  if (zmq_setsockopt(socket.handle(), ZMQ_CURVE_SERVER, &on, sizeof(on)) != 0) {
    return absl::InternalError(absl::StrCat("CURVE server: ", zmq_strerror(zmq_errno())));
  }
  return SetKey(socket, ZMQ_CURVE_SECRETKEY, secret);
}

absl::Status SetCurveClient(zmq::socket_t& socket, const std::string& secret) {
  absl::StatusOr<std::string> pub = NodePublicKey(secret);
  if (!pub.ok()) return pub.status();
  if (absl::Status s = SetKey(socket, ZMQ_CURVE_SERVERKEY, *pub); !s.ok()) return s;
  if (absl::Status s = SetKey(socket, ZMQ_CURVE_PUBLICKEY, *pub); !s.ok()) return s;
  return SetKey(socket, ZMQ_CURVE_SECRETKEY, secret);
}

}  // namespace twinkle::ipc
