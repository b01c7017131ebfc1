// Workers on other nodes (docs/device_pool.md "Engines on other nodes"): the node socket, its
// authentication, and the node agents that start, kill and report the remote engines.

#include <array>

#include <zmq_addon.hpp>

#include "absl/strings/str_cat.h"
#include "core/common/log.h"
#include "core/engine_client/supervisor.h"
#include "core/engine_client/supervisor_internal.h"
#include "core/ipc/messages.h"
#include "core/ipc/socket.h"

namespace twinkle {
namespace supervisor_internal {

std::vector<zmq::message_t> ReceiveParts(zmq::socket_t& socket) {
  std::vector<zmq::message_t> parts;
  try {
    if (!zmq::recv_multipart(socket, std::back_inserter(parts), zmq::recv_flags::dontwait)) parts.clear();
  } catch (const zmq::error_t&) {
    parts.clear();
  }
  return parts;
}

}  // namespace supervisor_internal

using supervisor_internal::kLog;
using supervisor_internal::kNodePrefix;
using supervisor_internal::ReceiveParts;

void Supervisor::SpawnRemoteLocked(Worker& w) {
  NodeAgent& agent = *nodes_.at(w.node);
  w.spawn_pending = true;
  if (!agent.connected) {
    LogInfo(kLog, absl::StrCat(WorkerName(w.rank), " on ", w.device, " waits for node agent '", w.node,
                               "' to connect (twinkle-server worker --join ", options_.node_listen, " --node ",
                               w.node, ")"));
    return;
  }
  ipc::Message spawn;
  spawn.envelope.type = ipc::MessageType::kSpawnWorker;
  spawn.envelope.body = ipc::Pack(ipc::SpawnWorkerBody{w.identity, w.spawn_args});
  if (absl::Status s = ipc::SendMessage(zmq_->nodes, spawn, agent.identity); !s.ok()) {
    LogWarning(kLog, absl::StrCat("cannot reach node agent '", w.node, "': ", s.message()));
    return;
  }
  w.spawn_pending = false;
  LogInfo(kLog, absl::StrCat("asked node agent '", w.node, "' to start ", WorkerName(w.rank), " on ",
                             w.engine_device));
}

absl::Status Supervisor::BindNodeSocket() {
  if (options_.node_listen.empty() || options_.node_secret.empty()) {
    return absl::FailedPreconditionError(
        "devices on other nodes (DEVICE@NODE in engine.devices) need nodes.listen and nodes.secret_file");
  }
  absl::StatusOr<std::string> public_key = ipc::NodePublicKey(options_.node_secret);
  if (!public_key.ok()) return public_key.status();
  node_public_key_.assign(32, '\0');
  zmq_z85_decode(reinterpret_cast<uint8_t*>(node_public_key_.data()), public_key->c_str());
  try {
    zmq_->zap.set(zmq::sockopt::linger, 0);
    zmq_->zap.bind("inproc://zeromq.zap.01");
    zmq_->nodes.set(zmq::sockopt::linger, 0);
    zmq_->nodes.set(zmq::sockopt::router_mandatory, 1);
    zmq_->nodes.set(zmq::sockopt::router_handover, 1);  // a restarted agent takes its name back
    if (absl::Status s = ipc::SetCurveServer(zmq_->nodes, options_.node_secret); !s.ok()) return s;
    constexpr char kMonitor[] = "inproc://twinkle-node-monitor";
    if (zmq_socket_monitor(zmq_->nodes.handle(), kMonitor,
                           ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                               ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) != 0) {
      return absl::InternalError(absl::StrCat("cannot monitor the node socket: ", zmq_strerror(zmq_errno())));
    }
    zmq_->monitor.connect(kMonitor);
    zmq_->nodes.bind(absl::StrCat("tcp://", options_.node_listen));
  } catch (const zmq::error_t& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen for node agents on ", options_.node_listen, " (nodes.listen): ", e.what()));
  }
  zmq_->nodes_bound = true;
  LogInfo(kLog, absl::StrCat("listening for node agents on ", options_.node_listen));
  return absl::OkStatus();
}

void Supervisor::HandleZapRequest() {
  // ZAP 1.0 (rfc.zeromq.org/spec/27): version, request id, domain, address, routing id,
  // mechanism, credentials. CURVE peers must hold the node secret: their public key is its.
  const std::vector<zmq::message_t> parts = ReceiveParts(zmq_->zap);
  if (parts.empty()) return;
  const auto part = [&](size_t i) { return i < parts.size() ? parts[i].to_string() : std::string(); };
  const std::string mechanism = part(5);
  const bool ok = mechanism == "NULL" || (mechanism == "CURVE" && part(6) == node_public_key_);
  if (!ok) {
    LogWarning(kLog, absl::StrCat("refused a node connection from ", part(3), " (", mechanism,
                                  "): it does not hold the node secret (nodes.secret_file)"));
  }
  const std::array<std::string, 6> reply = {"1.0", part(1), ok ? "200" : "400",
                                            ok ? "OK" : "not a holder of the node secret", "", ""};
  try {
    for (size_t i = 0; i < reply.size(); ++i) {
      zmq_->zap.send(zmq::buffer(reply[i]), i + 1 < reply.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
    }
  } catch (const zmq::error_t& e) {
    LogError(kLog, absl::StrCat("ZAP reply failed: ", e.what()));
  }
}

void Supervisor::HandleNodeMonitorEvent() {
  // Two frames: the event (uint16 id, uint32 value) and the endpoint.
  if (ReceiveParts(zmq_->monitor).empty()) return;
  // A peer with another secret retries every few hundred ms: one line per 10 s at most.
  const absl::Time now = absl::Now();
  ++zmq_->refusals_unlogged;
  if (now - zmq_->last_refusal_log < absl::Seconds(10)) return;
  LogWarning(kLog, absl::StrCat("refused ", zmq_->refusals_unlogged, " node connection(s) on ", options_.node_listen,
                                ": the CURVE handshake failed (the peer does not hold this node secret, "
                                "nodes.secret_file)"));
  zmq_->last_refusal_log = now;
  zmq_->refusals_unlogged = 0;
}

void Supervisor::NodeConnectedLocked(const std::string& node, absl::Time now) {
  NodeAgent& agent = *nodes_.at(node);
  agent.identity = absl::StrCat(kNodePrefix, node);
  agent.last_seen = now;
  ipc::Message ack;
  ack.envelope.type = ipc::MessageType::kHelloAck;
  if (absl::Status s = ipc::SendMessage(zmq_->nodes, ack, agent.identity); !s.ok()) return;
  agent.connected = true;
  LogInfo(kLog, absl::StrCat("node agent '", node, "' connected"));
  for (auto& w : workers_) {
    if (w->node == node && w->spawn_pending && w->state == State::kStarting) SpawnRemoteLocked(*w);
  }
}

void Supervisor::HandleNodeMessageLocked(const std::string& node, const ipc::Message& m, absl::Time now) {
  auto it = nodes_.find(node);
  if (it == nodes_.end()) {
    LogWarning(kLog, absl::StrCat("node agent '", node, "' has no device in engine.devices; told to stop"));
    ipc::Message bye;
    bye.envelope.type = ipc::MessageType::kShutdown;
    (void)ipc::SendMessage(zmq_->nodes, bye, absl::StrCat(kNodePrefix, node));
    return;
  }
  NodeAgent& agent = *it->second;
  agent.last_seen = now;
  switch (m.envelope.type) {
    case ipc::MessageType::kNodeHello: {
      absl::StatusOr<ipc::NodeHelloBody> hello = ipc::Unpack<ipc::NodeHelloBody>(m.envelope.body, "node hello");
      if (!hello.ok() || hello->protocol_version != ipc::kProtocolVersion) {
        LogError(kLog, absl::StrCat("node agent '", node, "' refused: ",
                                    hello.ok() ? absl::StrCat("it speaks protocol ", hello->protocol_version,
                                                              ", we speak ", ipc::kProtocolVersion)
                                               : std::string(hello.status().message())));
        ipc::Message bye;
        bye.envelope.type = ipc::MessageType::kShutdown;
        (void)ipc::SendMessage(zmq_->nodes, bye, absl::StrCat(kNodePrefix, node));
        return;
      }
      if (agent.connected) {
        // A new agent process under this name: the engines the old one started died with it.
        for (auto& w : workers_) {
          if (w->node == node && !w->spawn_pending &&
              (w->state == State::kStarting || w->state == State::kLoading || w->state == State::kReady)) {
            WorkerDownLocked(*w, now, absl::StrCat("its node agent '", node, "' restarted"));
          }
        }
      }
      agent.connected = false;
      NodeConnectedLocked(node, now);
      break;
    }
    case ipc::MessageType::kHeartbeat:
      // An agent that outlived a silence or a coordinator restart: take it back.
      if (!agent.connected) NodeConnectedLocked(node, now);
      break;
    case ipc::MessageType::kWorkerExited: {
      absl::StatusOr<ipc::WorkerExitedBody> exited =
          ipc::Unpack<ipc::WorkerExitedBody>(m.envelope.body, "worker exited");
      if (!exited.ok()) break;
      for (auto& w : workers_) {
        if (w->identity != exited->identity || w->node != node) continue;
        if (w->state == State::kStarting || w->state == State::kLoading || w->state == State::kReady) {
          w->remote_pid = 0;
          w->spawn_pending = false;  // nothing left to kill
          WorkerDownLocked(*w, now, absl::StrCat("process exited (", exited->how, ") on node ", node));
        }
      }
      break;
    }
    default:
      LogWarning(kLog, absl::StrCat("node agent '", node, "' sent an unexpected ",
                                    ipc::MessageTypeName(m.envelope.type), " message"));
  }
}

void Supervisor::CheckNodesLocked(absl::Time now) {
  for (auto& [name, agent] : nodes_) {
    if (!agent->connected || now - agent->last_seen <= options_.heartbeat_timeout) continue;
    agent->connected = false;
    const std::string why = absl::StrCat("its node agent '", name, "' went silent for ",
                                         absl::FormatDuration(absl::Trunc(now - agent->last_seen, absl::Milliseconds(1))));
    LogError(kLog, absl::StrCat("node agent '", name, "' is gone (silent for ",
                                absl::FormatDuration(absl::Trunc(now - agent->last_seen, absl::Milliseconds(1))), ")"));
    for (auto& w : workers_) {
      if (w->node == name && (w->state == State::kStarting || w->state == State::kLoading || w->state == State::kReady)) {
        w->spawn_pending = false;  // its engines are gone with it: nothing to kill
        WorkerDownLocked(*w, now, why);
      }
    }
  }
}

}  // namespace twinkle
