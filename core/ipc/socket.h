#pragma once
// Sending and receiving envelopes over ZeroMQ sockets. The coordinator binds one ROUTER
// socket and each worker connects a DEALER whose routing id names it; so a ROUTER-side
// message carries the routing id as an extra first frame.

#include <optional>
#include <string>
#include "absl/strings/string_view.h"

#include <zmq.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/ipc/envelope.h"

namespace twinkle::ipc {

// Sends `message`; on a ROUTER socket pass the peer's routing id. Never throws. A message
// over `limits` is not sent: ResourceExhausted naming the limit (the peer would refuse it);
// a socket failure is Unavailable.
absl::Status SendMessage(zmq::socket_t& socket, const Message& message,
                         absl::string_view routing_id = {}, const DecodeLimits& limits = {});

struct Received {
  std::string routing_id;                // set on ROUTER sockets
  absl::StatusOr<Message> message;       // a decode error keeps the routing id for a reply
  // When `message` is an error but its envelope frame could still be read (the frames
  // after it broke a limit, say): who sent it and for which request, so that the receiver
  // can answer that request with the error instead of leaving its caller waiting.
  std::optional<Envelope> header;
};

// Receives one whole multipart message without blocking: returns NotFound when none is
// waiting, Unavailable when the socket failed. Frames that do not decode come back as an
// error in Received::message (with Received::header where the envelope was readable).
absl::StatusOr<Received> ReceiveMessage(zmq::socket_t& socket, bool with_routing_id,
                                        const DecodeLimits& limits = {});

// The node secret (docs/device_pool.md "Engines on other nodes"): one CURVE secret key, Z85
// (40 characters), shared by the coordinator and its node agents. The coordinator's node
// socket is a CURVE server with it, and every agent and remote engine a CURVE client with the
// same key pair, so the coordinator accepts exactly the peers that hold the secret (its ZAP
// handler compares their public key with its own), and the link is encrypted.
//
// A fresh secret (`twinkle-server node-secret`).
absl::StatusOr<std::string> NewNodeSecret();
// Reads a secret file: its first line, which must be a Z85 CURVE secret key. Refuses a file
// that any user may read (owner and group only).
absl::StatusOr<std::string> ReadNodeSecret(const std::string& path);
// The public key of a secret (Z85, 40 characters).
absl::StatusOr<std::string> NodePublicKey(const std::string& secret);
// Makes `socket` (before bind) a CURVE server with the secret.
absl::Status SetCurveServer(zmq::socket_t& socket, const std::string& secret);
// Makes `socket` (before connect) a CURVE client of the server holding the same secret.
absl::Status SetCurveClient(zmq::socket_t& socket, const std::string& secret);

}  // namespace twinkle::ipc
