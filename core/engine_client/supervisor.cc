#include "core/engine_client/supervisor.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>

#include <zmq.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "core/common/log.h"
#include "core/engine_client/supervisor_internal.h"
#include "core/engine_client/worker_process.h"
#include "core/ipc/messages.h"
#include "core/ipc/socket.h"
#include "core/ipc/training_messages.h"

namespace twinkle {

using supervisor_internal::kLog;
using supervisor_internal::kNodePrefix;

namespace {

// A TCP port free on the loopback interface now: the kernel picks one for a socket bound to
// port 0, which is closed again for rank 0's TCPStore to bind (the store retries a port
// that was taken meanwhile as an error, and the group then restarts on another).
absl::StatusOr<int32_t> FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::UnavailableError("cannot open a socket for a rendezvous port");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  close(fd);
  if (!ok) return absl::UnavailableError("cannot find a free loopback port for the rendezvous");
  return static_cast<int32_t>(ntohs(addr.sin_port));
}
// How often the loop wakes when nothing arrives, to check exits and heartbeat deadlines.
constexpr auto kPollInterval = std::chrono::milliseconds(20);

}  // namespace

zmq::socket_t& Supervisor::SocketOf(const Worker& w) { return w.node.empty() ? zmq_->router : zmq_->nodes; }

Supervisor::Supervisor(SupervisorOptions options, const Clock& clock)
    : options_(std::move(options)), clock_(clock) {
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
}

Supervisor::~Supervisor() {
  Stop(absl::Seconds(5));
  if (wake_fd_ >= 0) close(wake_fd_);
}

void Supervisor::Wake() {
  const uint64_t one = 1;
  if (wake_fd_ >= 0) (void)!write(wake_fd_, &one, sizeof(one));
}

void Supervisor::Call(int32_t rank, ipc::Message request, ReplyCallback done, uint64_t* served_generation) {
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_ && thread_.joinable()) {
      outgoing_.push_back({rank, std::move(request), std::move(done), served_generation});
      Wake();
      return;
    }
  }
  done(absl::UnavailableError("the engine is stopping"));
}

absl::StatusOr<ipc::Message> Supervisor::CallAndWait(int32_t rank, ipc::Message request,
                                                     uint64_t* served_generation) {
  absl::Notification replied;
  absl::StatusOr<ipc::Message> result;
  Call(
      rank, std::move(request),
      [&](absl::StatusOr<ipc::Message> reply) {
        result = std::move(reply);
        replied.Notify();
      },
      served_generation);
  replied.WaitForNotification();
  return result;
}

std::string Supervisor::WorkerName(int32_t rank) const {
  return options_.pool.empty() ? absl::StrCat("engine rank ", rank)
                               : absl::StrCat(options_.pool, " engine rank ", rank);
}

uint64_t Supervisor::engine_generation() const {
  absl::MutexLock lock(&mu_);
  return engine_generation_;
}

uint64_t Supervisor::engine_generation(int32_t rank) const {
  absl::MutexLock lock(&mu_);
  if (rank < 0 || rank >= static_cast<int32_t>(workers_.size())) return 0;
  return workers_[rank]->loaded_generation;
}

void Supervisor::SendQueuedCalls(absl::Time now) {
  absl::MutexLock lock(&mu_);
  std::vector<OutgoingCall> calls;
  calls.swap(outgoing_);
  for (OutgoingCall& call : calls) {
    const bool known = call.rank >= 0 && call.rank < static_cast<int32_t>(workers_.size());
    Worker* w = known ? workers_[call.rank].get() : nullptr;
    if (w == nullptr || w->state != State::kReady) {
      completions_.push_back([done = std::move(call.done), name = WorkerName(call.rank)] {
        done(absl::UnavailableError(absl::StrCat(name, " is not ready")));
      });
      continue;
    }
    call.request.envelope.type = ipc::MessageType::kRequest;
    const uint64_t id = call.request.envelope.request_id = next_request_id_++;
    if (absl::Status s = ipc::SendMessage(SocketOf(*w), call.request, w->identity); !s.ok()) {
      if (absl::IsResourceExhausted(s)) {  // over the link's limits: nothing was sent
        completions_.push_back([done = std::move(call.done), s, method = call.request.envelope.method] {
          done(absl::InvalidArgumentError(absl::StrCat(
              "the ", method, " request is too large for the engine link (", s.message(),
              "); split it into smaller requests")));
        });
        continue;
      }
      completions_.push_back([done = std::move(call.done), s] {
        done(absl::UnavailableError(absl::StrCat("cannot reach the engine: ", s.message())));
      });
      WorkerDownLocked(*w, now, std::string(s.message()));
      continue;
    }
    in_flight_[id] = {call.rank, std::move(call.done), call.request.envelope.method,
                      CallBudget(call.request), std::nullopt, call.served_generation};
  }
}

absl::Duration Supervisor::CallBudget(const ipc::Message& request) const {
  size_t bytes = request.envelope.body.size();
  for (const std::string& b : request.buffers) bytes += b.size();
  return options_.call_timeout +
         options_.call_timeout_per_mib * (static_cast<double>(bytes) / (1 << 20));
}

void Supervisor::NoteBusyLocked(uint64_t request_id, absl::Time now) {
  if (request_id == 0) return;
  auto it = in_flight_.find(request_id);
  if (it != in_flight_.end() && !it->second.started_at) it->second.started_at = now;
}

void Supervisor::CheckDeadlinesLocked(absl::Time now) {
  for (const auto& [id, call] : in_flight_) {
    if (!call.started_at || now - *call.started_at <= call.budget) continue;
    Worker& w = *workers_[call.rank];
    if (w.state != State::kReady) continue;
    // Copies: WorkerDownLocked erases this call from in_flight_.
    const std::string why = absl::StrCat(
        "request ", id, " (", call.method, ") ran for ",
        absl::FormatDuration(absl::Trunc(now - *call.started_at, absl::Milliseconds(1))),
        ", past its deadline of ", absl::FormatDuration(absl::Trunc(call.budget, absl::Milliseconds(1))),
        " (pid ", w.pid(), w.node.empty() ? "" : absl::StrCat(" on node ", w.node), " killed)");
    WorkerDownLocked(w, now, why);
    return;  // the map changed; the next tick checks the rest
  }
}

void Supervisor::FailCallsLocked(int32_t rank, const std::string& why) {
  for (auto it = in_flight_.begin(); it != in_flight_.end();) {
    if (it->second.rank != rank) {
      ++it;
      continue;
    }
    completions_.push_back([done = std::move(it->second.done), name = WorkerName(rank), why] {
      done(absl::UnavailableError(absl::StrCat(name, " went down before replying (", why, ")")));
    });
    it = in_flight_.erase(it);
  }
}

absl::Status Supervisor::Start(Listener listener) {
  if (absl::Status s = Launch(std::move(listener)); !s.ok()) return s;
  return WaitReady();
}

absl::Status Supervisor::Launch(Listener listener) {
  // A private directory: only this user can reach the socket.
  std::string tmpl = (std::filesystem::temp_directory_path() / "twinkle-XXXXXX").string();
  if (mkdtemp(tmpl.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("cannot create a run directory in ",
                                            std::filesystem::temp_directory_path().string()));
  }
  run_dir_ = tmpl;
  endpoint_ = absl::StrCat("ipc://", run_dir_, "/engine.sock");
  zmq_ = std::make_unique<ZmqState>();
  try {
    zmq_->router.set(zmq::sockopt::linger, 0);
    zmq_->router.set(zmq::sockopt::router_mandatory, 1);  // sends to a gone peer fail loudly
    zmq_->router.bind(endpoint_);
  } catch (const zmq::error_t& e) {
    return absl::UnavailableError(absl::StrCat("cannot bind ", endpoint_, ": ", e.what()));
  }
  const bool remote = std::any_of(options_.devices.begin(), options_.devices.end(),
                                  [](const std::string& d) { return d.find('@') != std::string::npos; });
  if (remote) {
    if (data_parallel() && options_.devices[0].find('@') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "engine.devices[0] '", options_.devices[0],
          "' is on another node; rank 0 serves the ranks' rendezvous and must run on this node"));
    }
    if (absl::Status s = BindNodeSocket(); !s.ok()) return s;
  }

  {
    absl::MutexLock lock(&mu_);
    listener_ = std::move(listener);
    if (data_parallel()) {
      absl::StatusOr<int32_t> port =
          options_.rendezvous_port > 0 ? absl::StatusOr<int32_t>(options_.rendezvous_port) : FreeLoopbackPort();
      if (!port.ok()) return port.status();
      dist_port_ = *port;
    }
    const absl::Time now = clock_.Now();
    for (size_t i = 0; i < options_.devices.size(); ++i) {
      auto w = std::make_unique<Worker>();
      w->rank = static_cast<int32_t>(i);
      w->device = options_.devices[i];
      const size_t at = w->device.find('@');
      w->engine_device = w->device.substr(0, at);
      if (at != std::string::npos) {
        w->node = w->device.substr(at + 1);
        if (!nodes_.count(w->node)) nodes_[w->node] = std::make_unique<NodeAgent>();
      }
      w->backoff = options_.backoff_initial;
      SpawnLocked(*w, now);
      workers_.push_back(std::move(w));
    }
  }
  thread_ = std::thread([this] { Loop(); });
  return absl::OkStatus();
}

absl::Status Supervisor::WaitReady() {
  absl::MutexLock lock(&mu_);
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!startup_error_.ok() || stopping_) return true;
    return std::all_of(workers_.begin(), workers_.end(),
                       [](const auto& w) { return w->state == State::kReady; });
  };
  mu_.Await(absl::Condition(&done));
  if (!startup_error_.ok()) return startup_error_;
  if (stopping_) return absl::CancelledError("stopped before every engine worker was ready");
  started_ = true;
  return absl::OkStatus();
}

void Supervisor::SpawnLocked(Worker& w, absl::Time now) {
  ++w.generation;
  w.identity = absl::StrCat(options_.pool.empty() ? "" : options_.pool + "-", "rank-", w.rank, "-gen-",
                            w.generation);
  w.acknowledged = false;
  std::vector<std::string> args = {
      "--rank", absl::StrCat(w.rank), "--identity", w.identity, "--device", w.engine_device, "--heartbeat-ms",
      absl::StrCat(absl::ToInt64Milliseconds(options_.heartbeat_interval)), "--log-level",
      options_.log_level, "--log-format", options_.log_format};
  if (!options_.pool.empty()) {
    args.push_back("--pool");
    args.push_back(options_.pool);
  }
  if (options_.test_hooks) args.push_back("--test-hooks");
  if (data_parallel()) {
    for (std::string arg : {std::string("--world-size"), absl::StrCat(options_.devices.size()),
                            std::string("--dist-port"), absl::StrCat(dist_port_),
                            std::string("--group-epoch"), absl::StrCat(group_epoch_),
                            std::string("--dist-timeout-s"),
                            absl::StrCat(std::max<int64_t>(1, absl::ToInt64Seconds(options_.collective_timeout)))}) {
      args.push_back(std::move(arg));
    }
    if (zmq_->nodes_bound && !options_.rendezvous_host.empty()) {  // ranks on other nodes
      args.push_back("--dist-host");
      args.push_back(options_.rendezvous_host);
    }
  }
  w.spawned_at = now;
  w.last_seen = now;
  if (!w.node.empty()) {
    w.spawn_args = std::move(args);
    w.remote_pid = 0;
    w.state = State::kStarting;
    SpawnRemoteLocked(w);
    return;
  }
  std::vector<std::string> argv = {options_.engine_binary, "--endpoint", endpoint_};
  argv.insert(argv.end(), args.begin(), args.end());
  absl::StatusOr<WorkerProcess> process = WorkerProcess::Spawn(argv);
  if (!process.ok()) {
    WorkerDownLocked(w, now, std::string(process.status().message()));
    return;
  }
  w.process = *process;
  w.state = State::kStarting;
  LogInfo(kLog, absl::StrCat("started ", WorkerName(w.rank), " on ", w.device, " (pid ",
                             w.process.pid(), ")"));
}

void Supervisor::KillLocked(Worker& w) {
  if (w.node.empty()) {
    if (w.process.running()) w.process.Kill(SIGKILL);
    return;
  }
  NodeAgent& agent = *nodes_.at(w.node);
  if (!w.spawn_pending && agent.connected) {
    ipc::Message kill;
    kill.envelope.type = ipc::MessageType::kKillWorker;
    kill.envelope.body = ipc::Pack(ipc::KillWorkerBody{w.identity});
    (void)ipc::SendMessage(zmq_->nodes, kill, agent.identity);
  }
  w.spawn_pending = false;
  w.remote_pid = 0;
}

void Supervisor::WorkerDownLocked(Worker& w, absl::Time now, const std::string& why) {
  const bool was_ready = w.state == State::kReady;
  KillLocked(w);
  FailCallsLocked(w.rank, why);
  if (!started_) {
    if (startup_error_.ok()) {
      startup_error_ = absl::UnavailableError(
          absl::StrCat(WorkerName(w.rank), " on ", w.device, " failed to start: ", why));
    }
    w.state = State::kStopped;
    return;
  }
  w.state = State::kBackoff;
  w.restart_at = now + w.backoff;
  LogError(kLog, absl::StrCat(WorkerName(w.rank), " is down: ", why, "; restarting in ",
                              absl::FormatDuration(w.backoff)));
  w.backoff = std::min(w.backoff * 2, options_.backoff_max);
  if (was_ready) NotifyLocked();
  if (data_parallel() && !stopping_ && !group_going_down_ && CanRestartAloneLocked(w)) {
    // The survivors keep their processes and adapters: they drop the broken group now and
    // form the next epoch's with the restarted rank at their next collective.
    ++group_epoch_;
    LogInfo(kLog, absl::StrCat(WorkerName(w.rank), " restarts alone; the other ranks rejoin it at group epoch ",
                               group_epoch_));
    for (auto& other : workers_) {
      if (other.get() == &w || other->state != State::kReady) continue;
      outgoing_.push_back({other->rank,
                           ipc::MakeRequest(ipc::kMethodRejoinGroup, ipc::Pack(ipc::RejoinGroupRequest{group_epoch_})),
                           [name = WorkerName(other->rank)](absl::StatusOr<ipc::Message> reply) {
                             if (!reply.ok()) {
                               LogWarning(kLog, absl::StrCat(name, ": rejoin_group: ", reply.status().message()));
                             }
                           }});
    }
    Wake();
  } else if (data_parallel() && !stopping_ && !group_going_down_) {
    // The other ranks' process group lost a member that cannot rejoin it alone: take them
    // all down and let the group restart together, on a fresh rendezvous port.
    group_going_down_ = true;
    for (auto& other : workers_) {
      if (other.get() == &w || other->state == State::kBackoff || other->state == State::kStopped) continue;
      WorkerDownLocked(*other, now, absl::StrCat("its data-parallel group lost ", WorkerName(w.rank)));
    }
    group_going_down_ = false;
    if (options_.rendezvous_port > 0) {
      // A fixed port (a Service may expose it): the old rank 0 that served it is gone.
    } else if (absl::StatusOr<int32_t> port = FreeLoopbackPort(); port.ok()) {
      dist_port_ = *port;
    } else {
      LogError(kLog, absl::StrCat("no new rendezvous port: ", port.status().message(), "; keeping ", dist_port_));
    }
  }
}

bool Supervisor::CanRestartAloneLocked(const Worker& w) const {
  // Rank 0 serves the rendezvous store; NCCL communicators cannot be re-formed around a dead
  // peer without an abort this engine does not do.
  if (w.rank == 0 || w.engine_device.rfind("cpu", 0) != 0) return false;
  // A rank still starting was given the current epoch: it would miss the next one.
  for (const auto& other : workers_) {
    if (other.get() == &w) continue;
    if (other->state == State::kStarting || other->state == State::kLoading) return false;
  }
  return true;
}

void Supervisor::NotifyLocked() {
  if (!listener_) return;
  std::vector<WorkerSnapshot> snapshot;
  for (const auto& w : workers_) {
    snapshot.push_back({w->rank, w->device, w->state == State::kReady, w->restarts, w->pid()});
  }
  // The listener only flips health flags and gauges; calling it under the lock keeps the
  // order of notifications the order of events.
  listener_(snapshot);
}

void Supervisor::Loop() {
  zmq::pollitem_t items[] = {{zmq_->router.handle(), 0, ZMQ_POLLIN, 0},
                             {nullptr, wake_fd_, ZMQ_POLLIN, 0},
                             {zmq_->nodes.handle(), 0, ZMQ_POLLIN, 0},
                             {zmq_->zap.handle(), 0, ZMQ_POLLIN, 0},
                             {zmq_->monitor.handle(), 0, ZMQ_POLLIN, 0}};
  const int polled = zmq_->nodes_bound ? 5 : 2;
  auto run_completions = [this] {
    std::vector<std::function<void()>> ready;
    {
      absl::MutexLock lock(&mu_);
      ready.swap(completions_);
    }
    for (auto& f : ready) f();
  };
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_ || !startup_error_.ok()) break;
    }
    try {
      zmq::poll(items, polled, kPollInterval);
    } catch (const zmq::error_t& e) {
      if (e.num() != EINTR) LogError(kLog, absl::StrCat("poll failed: ", e.what()));
    }
    if (items[1].revents & ZMQ_POLLIN) {
      uint64_t count;
      (void)!read(wake_fd_, &count, sizeof(count));
    }
    const absl::Time now = clock_.Now();
    if (polled > 3 && (items[3].revents & ZMQ_POLLIN)) HandleZapRequest();
    if (polled > 4 && (items[4].revents & ZMQ_POLLIN)) HandleNodeMonitorEvent();
    SendQueuedCalls(now);
    if (items[0].revents & ZMQ_POLLIN) HandleMessages(now, zmq_->router);
    if (polled > 2 && (items[2].revents & ZMQ_POLLIN)) HandleMessages(now, zmq_->nodes);
    Housekeep(now);
    run_completions();
  }
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, call] : in_flight_) {
      completions_.push_back([done = std::move(call.done)] {
        done(absl::UnavailableError("the server is stopping"));
      });
    }
    in_flight_.clear();
    for (OutgoingCall& call : outgoing_) {
      completions_.push_back([done = std::move(call.done)] {
        done(absl::UnavailableError("the server is stopping"));
      });
    }
    outgoing_.clear();
  }
  run_completions();
  ShutdownWorkers();
}

void Supervisor::HandleMessages(absl::Time now, zmq::socket_t& socket) {
  absl::MutexLock lock(&mu_);
  while (true) {
    absl::StatusOr<ipc::Received> received = ipc::ReceiveMessage(socket, true);
    if (!received.ok()) return;  // NotFound: drained
    if (&socket == &zmq_->nodes && absl::StartsWith(received->routing_id, kNodePrefix)) {
      if (received->message.ok()) {
        HandleNodeMessageLocked(received->routing_id.substr(sizeof(kNodePrefix) - 1), *received->message, now);
      }
      continue;
    }
    auto it = std::find_if(workers_.begin(), workers_.end(),
                           [&](const auto& w) { return w->identity == received->routing_id; });
    if (it == workers_.end()) continue;  // a previous spawn's last words
    Worker& w = **it;
    if (!received->message.ok()) {
      // A reply we can match to its call fails that call alone (the worker answered; only
      // this message was unreadable); anything else means the worker is broken.
      const absl::Status& error = received->message.status();
      if (received->header && received->header->type == ipc::MessageType::kReply) {
        auto call = in_flight_.find(received->header->request_id);
        if (call != in_flight_.end()) {
          w.last_seen = now;
          LogError(kLog, absl::StrCat(WorkerName(w.rank), " sent an unreadable reply to request ",
                                      call->first, " (", call->second.method, "): ", error.message()));
          completions_.push_back([done = std::move(call->second.done), error, method = call->second.method] {
            done(absl::InternalError(absl::StrCat("the engine's reply to ", method,
                                                  " could not be read: ", error.message())));
          });
          in_flight_.erase(call);
          continue;
        }
      }
      WorkerDownLocked(w, now, absl::StrCat("sent a bad message: ", error.message()));
      continue;
    }
    w.last_seen = now;
    const ipc::Message& m = *received->message;
    switch (m.envelope.type) {
      case ipc::MessageType::kHello: {
        absl::StatusOr<ipc::HelloBody> hello = ipc::Unpack<ipc::HelloBody>(m.envelope.body, "hello");
        if (!hello.ok() || hello->protocol_version != ipc::kProtocolVersion) {
          WorkerDownLocked(w, now, hello.ok() ? absl::StrCat("speaks protocol ",
                                                             hello->protocol_version, ", we speak ",
                                                             ipc::kProtocolVersion)
                                              : std::string(hello.status().message()));
          break;
        }
        if (!w.node.empty()) w.remote_pid = hello->pid;
        ipc::Message ack;
        ack.envelope.type = ipc::MessageType::kHelloAck;
        ipc::Message load;
        load.envelope.type = ipc::MessageType::kRequest;
        load.envelope.request_id = w.load_request_id = next_request_id_++;
        load.envelope.method = ipc::kMethodLoadModel;
        load.envelope.body =
            ipc::Pack(ipc::LoadModelRequest{options_.model_dir, options_.dtype, w.engine_device,
                                                options_.max_lora_rank, options_.kv_cache_blocks,
                                                options_.kv_block_size, options_.state_slots,
                                                options_.activation_checkpointing,
                                                options_.logit_chunk_rows});
        absl::Status s = ipc::SendMessage(socket, ack, w.identity);
        if (s.ok()) s = ipc::SendMessage(socket, load, w.identity);
        if (!s.ok()) {
          WorkerDownLocked(w, now, std::string(s.message()));
          break;
        }
        w.acknowledged = true;
        w.state = State::kLoading;
        break;
      }
      case ipc::MessageType::kHeartbeat: {
        absl::StatusOr<ipc::HeartbeatBody> beat = ipc::Unpack<ipc::HeartbeatBody>(m.envelope.body, "heartbeat");
        if (beat.ok()) NoteBusyLocked(beat->busy_request_id, now);
        break;
      }
      case ipc::MessageType::kReply: {
        if (m.envelope.request_id != w.load_request_id) {
          auto call = in_flight_.find(m.envelope.request_id);
          if (call == in_flight_.end()) break;  // its caller was already failed
          absl::Status status = ipc::ReplyStatus(m.envelope);
          absl::StatusOr<ipc::Message> reply =
              status.ok() ? absl::StatusOr<ipc::Message>(std::move(*received->message))
                          : absl::StatusOr<ipc::Message>(status);
          if (call->second.served_generation != nullptr) *call->second.served_generation = w.loaded_generation;
          completions_.push_back([done = std::move(call->second.done),
                                  reply = std::move(reply)]() mutable { done(std::move(reply)); });
          in_flight_.erase(call);
          break;
        }
        absl::Status status = ipc::ReplyStatus(m.envelope);
        absl::StatusOr<ipc::LoadModelReply> reply =
            status.ok() ? ipc::Unpack<ipc::LoadModelReply>(m.envelope.body, "load_model reply")
                        : absl::StatusOr<ipc::LoadModelReply>(status);
        if (!reply.ok()) {
          WorkerDownLocked(w, now, absl::StrCat("could not load the model: ",
                                                reply.status().message()));
          break;
        }
        model_info_ = ModelInfo{reply->architecture, reply->model_type, reply->parameter_count,
                                reply->dtype, reply->num_layers, reply->vocab_size,
                                reply->hidden_size, reply->supported_losses,
                                reply->kv_cache_blocks, reply->kv_block_size,
                                reply->max_position_embeddings, reply->state_slots,
                                ActivationCost{reply->activation_fixed_bytes,
                                               reply->activation_token_bytes,
                                               reply->activation_seq_sq_bytes,
                                               reply->activation_chunk_rows,
                                               reply->activation_chunk_row_bytes}};
        w.state = State::kReady;
        w.backoff = options_.backoff_initial;
        w.loaded_generation = ++engine_generation_;
        LogInfo(kLog, absl::StrCat(WorkerName(w.rank), " ready: ", reply->architecture, ", ",
                                   reply->parameter_count, " parameters, ", reply->dtype, " on ",
                                   reply->device, ", loaded in ", reply->load_seconds, " s"));
        NotifyLocked();
        break;
      }
      default:
        LogWarning(kLog, absl::StrCat(WorkerName(w.rank), " sent an unexpected ",
                                      ipc::MessageTypeName(m.envelope.type), " message"));
    }
  }
}

void Supervisor::Housekeep(absl::Time now) {
  absl::MutexLock lock(&mu_);
  CheckDeadlinesLocked(now);
  CheckNodesLocked(now);
  for (auto& wp : workers_) {
    Worker& w = *wp;
    switch (w.state) {
      case State::kStarting:
      case State::kLoading:
      case State::kReady: {
        if (std::optional<std::string> how = w.node.empty() ? w.process.PollExit() : std::nullopt) {
          WorkerDownLocked(w, now, absl::StrCat("process exited (", *how, ")"));
          break;
        }
        if (w.spawn_pending) {  // on another node whose agent has not connected
          if (now - w.spawned_at > options_.startup_timeout) {
            WorkerDownLocked(w, now, absl::StrCat("node agent '", w.node, "' did not connect within ",
                                                  absl::FormatDuration(options_.startup_timeout)));
          }
          break;
        }
        // Before the hello, a fresh process may still be loading LibTorch: give it the
        // startup timeout. Afterwards its heartbeats must keep coming.
        const absl::Duration limit =
            w.state == State::kStarting ? options_.startup_timeout : options_.heartbeat_timeout;
        if (now - w.last_seen > limit) {
          WorkerDownLocked(w, now, absl::StrCat("silent for ", absl::FormatDuration(now - w.last_seen),
                                                " (pid ", w.pid(), w.node.empty() ? "" : absl::StrCat(" on node ", w.node),
                                                " killed)"));
        } else if (w.state == State::kLoading && now - w.spawned_at > options_.startup_timeout) {
          WorkerDownLocked(w, now, absl::StrCat("did not load the model within ",
                                                absl::FormatDuration(options_.startup_timeout)));
        }
        break;
      }
      case State::kBackoff:
        if (now >= w.restart_at) {
          ++w.restarts;
          SpawnLocked(w, now);
          NotifyLocked();
        }
        break;
      case State::kStopped:
        break;
    }
  }
}

void Supervisor::ShutdownWorkers() {
  absl::Duration grace;
  {
    absl::MutexLock lock(&mu_);
    grace = stop_grace_;
    ipc::Message bye;
    bye.envelope.type = ipc::MessageType::kShutdown;
    for (auto& w : workers_) {
      if ((w->process.running() || (!w->node.empty() && w->state != State::kStopped)) && w->acknowledged) {
        (void)ipc::SendMessage(SocketOf(*w), bye, w->identity);
      }
    }
  }
  absl::MutexLock lock(&mu_);
  for (auto& w : workers_) {
    if (!w->process.running()) continue;
    const std::string how =
        w->process.WaitOrKill(static_cast<int>(absl::ToInt64Milliseconds(grace)));
    LogInfo(kLog, absl::StrCat(WorkerName(w->rank), " stopped: ", how));
    w->state = State::kStopped;
  }
}

void Supervisor::RequestStop() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
}

void Supervisor::Stop(absl::Duration grace) {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    stop_grace_ = grace;
  }
  if (thread_.joinable()) thread_.join();
  {
    // Start() may have failed before the loop ran; make sure no child outlives us.
    absl::MutexLock lock(&mu_);
    for (auto& w : workers_) {
      if (w->process.running()) w->process.Kill(SIGKILL);
      w->state = State::kStopped;
    }
  }
  zmq_.reset();
  if (!run_dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(run_dir_, ec);
    run_dir_.clear();
  }
}

bool Supervisor::AllReady() const {
  absl::MutexLock lock(&mu_);
  if (stopping_ || workers_.empty()) return false;
  return std::all_of(workers_.begin(), workers_.end(),
                     [](const auto& w) { return w->state == State::kReady; });
}

std::vector<WorkerSnapshot> Supervisor::Snapshot() const {
  absl::MutexLock lock(&mu_);
  std::vector<WorkerSnapshot> out;
  for (const auto& w : workers_) {
    out.push_back({w->rank, w->device, w->state == State::kReady, w->restarts, w->pid()});
  }
  return out;
}

std::optional<ModelInfo> Supervisor::model_info() const {
  absl::MutexLock lock(&mu_);
  return model_info_;
}

}  // namespace twinkle
