#pragma once
// The supervisor's private parts, shared by supervisor.cc (local workers, the loop, restarts)
// and supervisor_nodes.cc (workers on other nodes through their node agents). Not an API.

#include <string>
#include <vector>

#include <zmq.hpp>

#include "absl/time/time.h"
#include "core/engine_client/supervisor.h"
#include "core/engine_client/worker_process.h"

namespace twinkle {
namespace supervisor_internal {

inline constexpr char kLog[] = "supervisor";
// Node agents' routing ids on the node socket: "node:" + the node's name.
inline constexpr char kNodePrefix[] = "node:";

enum class State { kStarting, kLoading, kReady, kBackoff, kStopped };

// One waiting multipart message of a plain (non-envelope) socket; empty when none.
std::vector<zmq::message_t> ReceiveParts(zmq::socket_t& socket);

}  // namespace supervisor_internal

using supervisor_internal::State;

struct Supervisor::Worker {
  int32_t rank = 0;
  std::string device;          // as configured: "cuda:0", or "cuda:0@NODE" on another node
  std::string engine_device;   // the device the engine opens ("cuda:0")
  std::string node;            // "" = this node; else the node agent that runs it
  std::vector<std::string> spawn_args;  // a remote spawn's engine arguments
  bool spawn_pending = false;  // remote: waiting for its node agent to connect
  int64_t remote_pid = 0;      // remote: the pid its hello reported (on its node)
  State state = State::kStopped;
  WorkerProcess process;
  std::string identity;        // routing id of the current spawn; older ones are ignored
  uint64_t generation = 0;
  uint64_t loaded_generation = 0;  // engine_generation_ when this rank last loaded the model
  absl::Time spawned_at;
  absl::Time last_seen;        // last message of any kind from this spawn
  absl::Time restart_at;
  absl::Duration backoff;
  uint64_t load_request_id = 0;
  int64_t restarts = 0;
  bool acknowledged = false;   // the hello was accepted: it can be sent a shutdown
  int64_t pid() const { return node.empty() ? static_cast<int64_t>(process.pid()) : remote_pid; }
};

struct Supervisor::NodeAgent {
  std::string identity;  // its routing id on the node socket: "node:NAME"
  bool connected = false;
  absl::Time last_seen;
};

struct Supervisor::ZmqState {
  zmq::context_t context{1};
  zmq::socket_t router{context, zmq::socket_type::router};
  // Engines on other nodes: their agents' and engines' TCP socket, and the ZAP handler that
  // authenticates its peers (ZeroMQ asks it on inproc://zeromq.zap.01 for every handshake).
  zmq::socket_t nodes{context, zmq::socket_type::router};
  zmq::socket_t zap{context, zmq::socket_type::rep};
  // The node socket's failed handshakes (a peer with another secret fails CURVE before ZAP).
  zmq::socket_t monitor{context, zmq::socket_type::pair};
  bool nodes_bound = false;
  absl::Time last_refusal_log = absl::InfinitePast();
  int64_t refusals_unlogged = 0;
};

}  // namespace twinkle
