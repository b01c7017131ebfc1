#pragma once
// The engine worker's main loop. One thread owns the DEALER socket to the coordinator: it
// sends the handshake and the heartbeats and hands requests to a compute thread, so a long
// device step never silences the heartbeat. The compute thread posts replies back through
// an inproc socket that wakes the I/O loop.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "core/engine/distributed.h"

namespace twinkle::engine {

struct WorkerOptions {
  int32_t rank = 0;
  std::string endpoint;   // the coordinator's ROUTER, e.g. ipc:///tmp/twinkle-x/engine.sock
  // A worker started by a node agent on another node: the node secret's file; the worker
  // connects to the coordinator's node endpoint (tcp://) as a CURVE client with it.
  std::string node_secret_file;
  std::string identity;   // routing id; the supervisor tells each spawn its own
  std::string device = "cpu";
  int heartbeat_interval_ms = 200;
  std::string pool;       // "" = a training worker, "sampler" = a dedicated one (log lines only)
  bool test_hooks = false;  // answer the debug methods (tests only; see ipc::kMethodDebugSleep)
  // Data parallelism (docs/device_pool.md): world_size > 1 joins the training ranks' c10d
  // process group when the model loads. rank is options.rank.
  DistributedOptions distributed;
};

// "engine rank R", or "<pool> engine rank R": the worker's name in its log lines, the same
// name the supervisor uses for it.
std::string WorkerLogName(const WorkerOptions& options);

// Runs until the coordinator says shutdown or goes away. Returns the reason it stopped.
absl::Status RunWorker(const WorkerOptions& options);

}  // namespace twinkle::engine
