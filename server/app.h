#pragma once
// The coordinator's lifecycle: bring up HTTP, gRPC and the engine workers, serve until
// SIGTERM/SIGINT, then drain and stop everything in order.

#include <string>

#include "server/config/config.h"

namespace twinkle {

struct LaunchOptions {
  std::string port_file;  // when set, {"grpc_port":..,"http_port":..,"pid":..} is written here
};

// twinkle-engine next to this binary.
std::string DefaultEngineBinary();

// Blocks SIGTERM and SIGINT in the calling thread; call before any thread starts so that
// only the signal thread of RunServer receives them.
void BlockShutdownSignals();

// Runs the server until a shutdown signal. Returns the process exit code: 0 after a clean
// drain, 1 on a startup error (printed as one line naming what and where).
int RunServer(const Config& config, const LaunchOptions& options);

}  // namespace twinkle
