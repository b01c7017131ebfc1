#include "core/engine_client/node_agent.h"

#include <signal.h>
#include <unistd.h>

#include <csignal>
#include <map>
#include <vector>

#include <zmq.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/common/log.h"
#include "core/engine_client/worker_process.h"
#include "core/ipc/messages.h"
#include "core/ipc/socket.h"

namespace twinkle {
namespace {

constexpr char kLog[] = "node-agent";
volatile std::sig_atomic_t stop_signal = 0;

void OnStopSignal(int signal) { stop_signal = signal; }

}  // namespace

absl::Status RunNodeAgent(const NodeAgentOptions& options) {
  absl::StatusOr<std::string> secret = ipc::ReadNodeSecret(options.secret_file);
  if (!secret.ok()) return secret.status();
  if (access(options.engine_binary.c_str(), X_OK) != 0) {
    return absl::NotFoundError(absl::StrCat("engine binary ", options.engine_binary, " is not executable"));
  }
  zmq::context_t context(1);
  zmq::socket_t dealer(context, zmq::socket_type::dealer);
  const std::string endpoint = absl::StrCat("tcp://", options.join);
  try {
    dealer.set(zmq::sockopt::routing_id, absl::StrCat("node:", options.node));
    dealer.set(zmq::sockopt::linger, 0);
    if (absl::Status s = ipc::SetCurveClient(dealer, *secret); !s.ok()) return s;
    dealer.connect(endpoint);
  } catch (const zmq::error_t& e) {
    return absl::UnavailableError(absl::StrCat("cannot connect to ", endpoint, ": ", e.what()));
  }
  std::signal(SIGTERM, OnStopSignal);
  std::signal(SIGINT, OnStopSignal);

  ipc::Message hello;
  hello.envelope.type = ipc::MessageType::kNodeHello;
  hello.envelope.body = ipc::Pack(ipc::NodeHelloBody{ipc::kProtocolVersion, options.node, getpid()});
  if (absl::Status s = ipc::SendMessage(dealer, hello); !s.ok()) return s;
  LogInfo(kLog, absl::StrCat("node '", options.node, "' joining ", options.join));

  std::map<std::string, WorkerProcess> engines;  // by routing id
  auto report_exit = [&](const std::string& identity, const std::string& how) {
    ipc::Message exited;
    exited.envelope.type = ipc::MessageType::kWorkerExited;
    exited.envelope.body = ipc::Pack(ipc::WorkerExitedBody{identity, how});
    (void)ipc::SendMessage(dealer, exited);
  };
  absl::Status result;
  bool joined = false;
  const absl::Time started = absl::Now();
  bool warned = false;
  absl::Time next_heartbeat = absl::Now();
  uint64_t heartbeat_seq = 0;
  zmq::pollitem_t items[] = {{dealer.handle(), 0, ZMQ_POLLIN, 0}};
  while (stop_signal == 0) {
    try {
      zmq::poll(items, 1, std::chrono::milliseconds(50));
    } catch (const zmq::error_t& e) {
      if (e.num() != EINTR) LogError(kLog, absl::StrCat("poll failed: ", e.what()));
    }
    bool shutdown = false;
    while (!shutdown) {
      absl::StatusOr<ipc::Received> received = ipc::ReceiveMessage(dealer, false);
      if (!received.ok()) break;  // NotFound: drained
      if (!received->message.ok()) {
        LogWarning(kLog, absl::StrCat("unreadable message from the coordinator: ", received->message.status().message()));
        continue;
      }
      const ipc::Message& m = *received->message;
      switch (m.envelope.type) {
        case ipc::MessageType::kHelloAck:
          // A (re)connection: the coordinator counts none of this node's engines as running
          // (a restarted coordinator never knew them; after a silence it took them down), so
          // any left from before would only hold the device.
          for (auto& [identity, process] : engines) {
            LogInfo(kLog, absl::StrCat("stopping engine ", identity, " from before the reconnection"));
            process.Kill(SIGKILL);
          }
          engines.clear();
          LogInfo(kLog, absl::StrCat("node '", options.node, "' joined ", options.join));
          joined = true;
          break;
        case ipc::MessageType::kSpawnWorker: {
          absl::StatusOr<ipc::SpawnWorkerBody> spawn = ipc::Unpack<ipc::SpawnWorkerBody>(m.envelope.body, "spawn");
          if (!spawn.ok()) break;
          std::vector<std::string> argv = {options.engine_binary, "--endpoint", endpoint, "--node-secret-file",
                                           options.secret_file};
          argv.insert(argv.end(), spawn->args.begin(), spawn->args.end());
          absl::StatusOr<WorkerProcess> process = WorkerProcess::Spawn(argv);
          if (!process.ok()) {
            report_exit(spawn->identity, absl::StrCat("could not start: ", process.status().message()));
            break;
          }
          LogInfo(kLog, absl::StrCat("started engine ", spawn->identity, " (pid ", process->pid(), ")"));
          engines[spawn->identity] = *process;
          break;
        }
        case ipc::MessageType::kKillWorker: {
          absl::StatusOr<ipc::KillWorkerBody> kill = ipc::Unpack<ipc::KillWorkerBody>(m.envelope.body, "kill");
          if (!kill.ok()) break;
          auto it = engines.find(kill->identity);
          if (it == engines.end()) break;
          it->second.Kill(SIGKILL);  // reaps it
          engines.erase(it);
          break;
        }
        case ipc::MessageType::kShutdown:
          result = absl::FailedPreconditionError(
              absl::StrCat("the coordinator at ", options.join, " has no devices on node '", options.node,
                           "' (engine.devices: DEVICE@", options.node, ") or speaks another protocol"));
          shutdown = true;
          break;
        default:
          break;
      }
    }
    if (shutdown) break;
    for (auto it = engines.begin(); it != engines.end();) {
      if (std::optional<std::string> how = it->second.PollExit()) {
        LogInfo(kLog, absl::StrCat("engine ", it->first, " exited (", *how, ")"));
        report_exit(it->first, *how);
        it = engines.erase(it);
      } else {
        ++it;
      }
    }
    const absl::Time now = absl::Now();
    if (!joined && !warned && now - started > absl::Seconds(10)) {
      LogWarning(kLog, absl::StrCat("no answer from the coordinator at ", options.join,
                                    " after 10s: is it up, listening there (nodes.listen), and is ", options.secret_file,
                                    " its node secret (nodes.secret_file)? Still trying."));
      warned = true;
    }
    if (now >= next_heartbeat) {
      ipc::Message beat;
      beat.envelope.type = ipc::MessageType::kHeartbeat;
      beat.envelope.body = ipc::Pack(ipc::HeartbeatBody{++heartbeat_seq, 0});
      (void)ipc::SendMessage(dealer, beat);
      next_heartbeat = now + options.heartbeat_interval;
    }
  }
  for (auto& [identity, process] : engines) process.Kill(SIGKILL);
  if (stop_signal != 0) LogInfo(kLog, absl::StrCat("node '", options.node, "' stopping (signal ", stop_signal, ")"));
  return result;
}

}  // namespace twinkle
