#pragma once
// The node agent (`twinkle-server worker --join HOST:PORT --node NAME`): runs on a node other
// than the coordinator's and starts there the engines the coordinator places on it (devices
// "DEVICE@NAME" in engine.devices; docs/device_pool.md "Engines on other nodes"). It connects
// to the coordinator's node socket as a CURVE client holding the node secret, says hello,
// sends heartbeats, starts and kills engines when told, and reports their exits. Its engines
// connect to the same socket with the same secret, and die with the agent (PR_SET_PDEATHSIG),
// so an agent that goes away takes its engines with it and the coordinator sees both go
// silent. The agent outlives a coordinator restart: it keeps reconnecting, and on each
// (re)connection stops the engines it still has from before (the coordinator starts anew).

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace twinkle {

struct NodeAgentOptions {
  std::string join;         // the coordinator's nodes.listen, HOST:PORT
  std::string node;         // this node's name, as engine.devices names it
  std::string secret_file;  // the node secret (nodes.secret_file on the coordinator)
  std::string engine_binary;
  absl::Duration heartbeat_interval = absl::Milliseconds(200);
};

// Runs until SIGTERM/SIGINT or the coordinator says shutdown (this node is not in its
// config). Kills its engines on the way out.
absl::Status RunNodeAgent(const NodeAgentOptions& options);

}  // namespace twinkle
