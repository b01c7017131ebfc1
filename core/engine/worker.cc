#include "core/engine/worker.h"

#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include <zmq.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/common/log.h"
#include "core/engine/request_handler.h"
#include "core/ipc/messages.h"
#include "core/ipc/socket.h"
#include "twinkle_version.h"

namespace twinkle::engine {
namespace {

constexpr char kWakeEndpoint[] = "inproc://twinkle-engine-wake";

// Requests flow I/O thread -> compute thread through `pending`; replies flow back through
// `done` plus a one-byte wake-up on the inproc socket.
class ComputeThread {
 public:
  ComputeThread(zmq::context_t& context, std::string device, bool test_hooks,
                const DistributedOptions& distributed)
      : handler_(std::move(device), test_hooks, distributed), wake_(context, zmq::socket_type::push) {
    wake_.connect(kWakeEndpoint);
    thread_ = std::thread([this] { Loop(); });
  }
  ~ComputeThread() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  void Submit(ipc::Message request) {
    {
      std::lock_guard lock(mu_);
      pending_.push_back(std::move(request));
    }
    cv_.notify_all();
  }

  std::deque<ipc::Message> TakeReplies() {
    std::lock_guard lock(mu_);
    return std::exchange(done_, {});
  }

  uint64_t busy_request_id() const { return busy_.load(); }

 private:
  void Loop() {
    while (true) {
      ipc::Message request;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !pending_.empty(); });
        if (stop_) return;
        request = std::move(pending_.front());
        pending_.pop_front();
      }
      busy_.store(request.envelope.request_id);
      absl::StatusOr<MethodReply> result = handler_.Handle(request);
      busy_.store(0);
      ipc::Message reply =
          result.ok() ? ipc::MakeReply(request.envelope, absl::OkStatus(), std::move(result->envelope.body))
                      : ipc::MakeReply(request.envelope, result.status());
      if (result.ok()) reply.buffers = std::move(result->buffers);
      {
        std::lock_guard lock(mu_);
        done_.push_back(std::move(reply));
      }
      wake_.send(zmq::str_buffer("w"), zmq::send_flags::dontwait);
    }
  }

  RequestHandler handler_;
  zmq::socket_t wake_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<ipc::Message> pending_;
  std::deque<ipc::Message> done_;
  bool stop_ = false;
  std::atomic<uint64_t> busy_{0};
  std::thread thread_;
};

// Sends a reply; one over the message limits (a result larger than the link carries) goes
// as an error reply naming the limit instead, so the caller learns why and the coordinator
// never sees a message it would refuse. Only a socket failure is an error here.
absl::Status SendReply(zmq::socket_t& dealer, const ipc::Message& reply, const std::string& log_name) {
  absl::Status s = ipc::SendMessage(dealer, reply);
  if (!absl::IsResourceExhausted(s)) return s;
  LogWarning(log_name, absl::StrCat("reply to request ", reply.envelope.request_id, " (",
                                    reply.envelope.method, ") is too large: ", s.message()));
  return ipc::SendMessage(
      dealer, ipc::MakeReply(reply.envelope,
                             absl::InvalidArgumentError(absl::StrCat(
                                 "the engine's reply to ", reply.envelope.method,
                                 " is too large for the engine link (", s.message(),
                                 "); split the request into smaller ones"))));
}

}  // namespace

std::string WorkerLogName(const WorkerOptions& options) {
  return options.pool.empty() ? absl::StrCat("engine rank ", options.rank)
                              : absl::StrCat(options.pool, " engine rank ", options.rank);
}

absl::Status RunWorker(const WorkerOptions& options) {
  const std::string log_name = WorkerLogName(options);
  zmq::context_t context(1);
  zmq::socket_t wake_pull(context, zmq::socket_type::pull);
  wake_pull.bind(kWakeEndpoint);
  zmq::socket_t dealer(context, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::routing_id, options.identity);
  dealer.set(zmq::sockopt::linger, 1000);
  if (!options.node_secret_file.empty()) {
    absl::StatusOr<std::string> secret = ipc::ReadNodeSecret(options.node_secret_file);
    if (!secret.ok()) return secret.status();
    if (absl::Status s = ipc::SetCurveClient(dealer, *secret); !s.ok()) return s;
  }
  try {
    dealer.connect(options.endpoint);
  } catch (const zmq::error_t& e) {
    return absl::UnavailableError(absl::StrCat("cannot connect to ", options.endpoint, ": ", e.what()));
  }

  ipc::Message hello;
  hello.envelope.type = ipc::MessageType::kHello;
  hello.envelope.body = ipc::Pack(ipc::HelloBody{ipc::kProtocolVersion, kTwinkleVersion,
                                                 options.rank, static_cast<int64_t>(getpid()),
                                                 options.device});
  if (absl::Status s = ipc::SendMessage(dealer, hello); !s.ok()) return s;

  DistributedOptions distributed = options.distributed;
  distributed.rank = options.rank;
  ComputeThread compute(context, options.device, options.test_hooks, distributed);
  const pid_t parent = getppid();
  const absl::Duration interval = absl::Milliseconds(options.heartbeat_interval_ms);
  absl::Time next_heartbeat = absl::Now();
  uint64_t heartbeat_seq = 0;

  zmq::pollitem_t items[] = {{dealer.handle(), 0, ZMQ_POLLIN, 0},
                             {wake_pull.handle(), 0, ZMQ_POLLIN, 0}};
  while (true) {
    // A coordinator that died without telling us leaves us orphaned: stop.
    if (getppid() != parent) return absl::AbortedError("coordinator process went away");

    const absl::Time now = absl::Now();
    if (now >= next_heartbeat) {
      ipc::Message beat;
      beat.envelope.type = ipc::MessageType::kHeartbeat;
      beat.envelope.body = ipc::Pack(ipc::HeartbeatBody{++heartbeat_seq, compute.busy_request_id()});
      if (absl::Status s = ipc::SendMessage(dealer, beat); !s.ok()) return s;
      next_heartbeat = now + interval;
    }
    const auto timeout_ms = std::max<int64_t>(0, absl::ToInt64Milliseconds(next_heartbeat - absl::Now()));
    try {
      zmq::poll(items, 2, std::chrono::milliseconds(timeout_ms));
    } catch (const zmq::error_t& e) {
      if (e.num() == EINTR) continue;
      return absl::UnavailableError(absl::StrCat("poll failed: ", e.what()));
    }

    if (items[1].revents & ZMQ_POLLIN) {
      zmq::message_t ignored;
      while (wake_pull.recv(ignored, zmq::recv_flags::dontwait)) {
      }
      for (ipc::Message& reply : compute.TakeReplies()) {
        if (absl::Status s = SendReply(dealer, reply, log_name); !s.ok()) return s;
      }
    }
    if (items[0].revents & ZMQ_POLLIN) {
      while (true) {
        absl::StatusOr<ipc::Received> received = ipc::ReceiveMessage(dealer, /*with_routing_id=*/false);
        if (absl::IsNotFound(received.status())) break;
        if (!received.ok()) return received.status();
        if (!received->message.ok()) {
          // A request whose envelope is readable is answered with the error, so its caller
          // fails at once instead of waiting for a reply that would never come.
          const absl::Status& error = received->message.status();
          if (received->header && received->header->type == ipc::MessageType::kRequest) {
            LogWarning(log_name, absl::StrCat("refusing request ", received->header->request_id, " (",
                                              received->header->method, "): ", error.message()));
            if (absl::Status s = SendReply(dealer, ipc::MakeReply(*received->header, error), log_name);
                !s.ok()) {
              return s;
            }
          } else {
            LogWarning(log_name, absl::StrCat("dropping a bad message: ", error.message()));
          }
          continue;
        }
        ipc::Message& message = *received->message;
        switch (message.envelope.type) {
          case ipc::MessageType::kHelloAck:
            LogInfo(log_name, "handshake accepted by the coordinator");
            break;
          case ipc::MessageType::kRequest:
            compute.Submit(std::move(message));
            break;
          case ipc::MessageType::kShutdown:
            LogInfo(log_name, "shutdown requested by the coordinator");
            return absl::OkStatus();
          default:
            LogWarning(log_name, absl::StrCat("unexpected ", ipc::MessageTypeName(message.envelope.type),
                                              " message ignored"));
        }
      }
    }
  }
}

}  // namespace twinkle::engine
