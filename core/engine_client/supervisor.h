#pragma once
// The coordinator's view of its engine workers: one twinkle-engine process per configured
// device. The supervisor spawns them, accepts their handshake, has them load the model,
// watches their heartbeats, and restarts a dead or silent one with exponential back-off.
//
// One thread (the supervisor loop) owns the ZeroMQ ROUTER socket; other threads only read
// snapshots. Readiness changes are reported through a listener so the transport layer can
// flip health status and metrics without knowing about processes.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/common/activation_memory.h"
#include "core/common/clock.h"
#include "core/ipc/envelope.h"

namespace zmq {
class socket_t;
}

namespace twinkle {

struct SupervisorOptions {
  // Which pool this supervisor runs: "" for the training workers, "sampler" for dedicated
  // sampler workers. It prefixes log lines and errors ("sampler engine rank 0 ...") and the
  // workers' routing identities, so two pools in one server can be told apart.
  std::string pool;
  std::string engine_binary;          // path to twinkle-engine
  std::vector<std::string> devices;   // one worker per entry: "cpu", "cuda:0", ...
  std::string model_dir;
  std::string dtype;
  std::string log_level = "info";
  std::string log_format = "text";  // text | json (logging.format)
  int64_t max_lora_rank = 0;          // passed to the workers, which refuse larger adapters
  int64_t kv_cache_blocks = 0;        // sampler KV cache blocks per worker (0 = engine default 2048)
  int64_t kv_block_size = 0;          // tokens per KV block (0 = engine default 16)
  int64_t state_slots = 0;            // recurrent state slots of a hybrid model (0 = engine default 64)
  bool activation_checkpointing = false;  // engine.activation_checkpointing
  int64_t logit_chunk_rows = 0;           // engine.logit_chunk_rows (0 = engine default)
  absl::Duration heartbeat_interval = absl::Milliseconds(200);
  absl::Duration heartbeat_timeout = absl::Seconds(3);
  absl::Duration startup_timeout = absl::Seconds(120);
  absl::Duration backoff_initial = absl::Milliseconds(500);
  absl::Duration backoff_max = absl::Seconds(30);
  // Each call's deadline, counted from when the worker's heartbeat first reports it
  // executing (time queued behind other calls on the worker does not count): the base plus
  // the per-MiB allowance times the request's size, a work estimate that grows with the
  // tokens or tensors it carries. A call past its deadline means a hung device step: the
  // worker is killed and restarted, and its callers get UNAVAILABLE (retryable).
  absl::Duration call_timeout = absl::InfiniteDuration();
  absl::Duration call_timeout_per_mib = absl::ZeroDuration();
  bool test_hooks = false;  // passes --test-hooks: the worker then accepts its debug methods
  // Data parallelism (docs/device_pool.md), with two or more devices: the workers form one
  // c10d process group (rank 0 serves its TCPStore rendezvous on a free loopback port), so
  // a CPU (Gloo) rank other than 0 going down restarts alone and the others re-form the
  // group with it at their next collective; rank 0 (which serves the rendezvous) or a CUDA
  // (NCCL) rank going down takes the whole group down. Off: independent workers.
  bool data_parallel = false;
  // How long a rendezvous or a collective waits for the other ranks.
  absl::Duration collective_timeout = absl::Minutes(5);
  // Engines on other nodes (docs/device_pool.md "Engines on other nodes"): a device
  // "DEVICE@NODE" is a worker that node agent NODE (`twinkle-server worker --join`) starts
  // on its node. Agents and their engines connect to `node_listen` (host:port; a second
  // ROUTER socket, CURVE-encrypted, accepting only peers that hold `node_secret`, the Z85
  // node secret). With data parallelism rank 0 must be local, and the ranks rendezvous at
  // rendezvous_host:rendezvous_port (an address of this node the others reach; port 0 = a
  // free port at each start of the group).
  std::string node_listen;
  std::string node_secret;
  std::string rendezvous_host;
  int32_t rendezvous_port = 0;
};

struct WorkerSnapshot {
  int32_t rank = 0;
  std::string device;
  bool ready = false;
  int64_t restarts = 0;
  int64_t pid = 0;
};

// What the workers reported after loading the model (identical across ranks).
struct ModelInfo {
  std::string architecture;
  std::string model_type;
  int64_t parameter_count = 0;
  std::string dtype;
  int32_t num_layers = 0;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  std::vector<std::string> supported_losses;
  int64_t kv_cache_blocks = 0;  // the sampler's KV cache per worker, as allocated
  int64_t kv_block_size = 0;
  int64_t max_position_embeddings = 0;
  int64_t state_slots = 0;  // the sampler's recurrent state slots per worker (0: dense model)
  ActivationCost activation_cost;  // a forward_backward's activation memory (unknown: zeros)
};

class Supervisor {
 public:
  // Called from the supervisor thread whenever a worker's readiness or restart count changes.
  using Listener = std::function<void(const std::vector<WorkerSnapshot>&)>;

  Supervisor(SupervisorOptions options, const Clock& clock = RealClock());
  ~Supervisor();
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  // Spawns every worker and blocks until all have loaded the model. Fails, naming the rank
  // and the reason, if any worker dies, reports an error, or the startup timeout passes;
  // during startup nothing is retried (a broken model or binary would only loop).
  // Start = Launch + WaitReady.
  absl::Status Start(Listener listener);

  // Start in two halves, so that a server with two pools spawns both from its main thread
  // and then waits for both. Launch spawns every worker and starts the loop, without
  // waiting. Call it on a thread that outlives the workers: they get SIGKILL (their
  // PR_SET_PDEATHSIG) when the thread that forked them exits, not only the process.
  absl::Status Launch(Listener listener);
  // Blocks until every launched worker has loaded the model (OK), one failed (its error),
  // or RequestStop (Cancelled). Any thread.
  absl::Status WaitReady();

  // Makes a pending or future Start() return Cancelled and the loop wind down; safe from
  // any thread (the signal thread uses it). Stop() still has to be called to reap workers.
  void RequestStop();

  // Asks every worker to exit, waits up to `grace`, then kills what is left.
  void Stop(absl::Duration grace);

  // Sends a request (method, body and tensor buffers in `request`; the envelope's type and id
  // are set here) to engine rank `rank` and calls `done` with its reply, on the supervisor
  // thread, once. Any thread may call. The reply's status is already folded in: `done` gets
  // the worker's error as a Status, or the reply Message. UNAVAILABLE when the worker is not
  // ready, or when it goes down before replying (the request is lost with it, and a call
  // past its deadline takes the worker down). INVALID_ARGUMENT, with the worker untouched,
  // when the request or its reply is larger than the link carries (ipc::DecodeLimits).
  // `served_generation`, when given, is set before `done` runs with a reply to the generation
  // (engine_generation(rank)) of the worker process that replied: what holds the state the
  // call made, even if that process is replaced right after.
  using ReplyCallback = std::function<void(absl::StatusOr<ipc::Message>)>;
  void Call(int32_t rank, ipc::Message request, ReplyCallback done, uint64_t* served_generation = nullptr);

  // Call, waiting for the reply.
  absl::StatusOr<ipc::Message> CallAndWait(int32_t rank, ipc::Message request,
                                           uint64_t* served_generation = nullptr);

  // Increments every time a worker (re)loads the model: engine-side state such as adapters
  // does not survive a change of it.
  uint64_t engine_generation() const;
  // The same count as it stood when worker `rank` last loaded the model (0: not yet, or no
  // such rank): it changes only when that worker reloads, so a restart of another rank leaves
  // this one's state, and its users, alone.
  uint64_t engine_generation(int32_t rank) const;

  bool AllReady() const;
  std::vector<WorkerSnapshot> Snapshot() const;
  std::optional<ModelInfo> model_info() const;

 private:
  struct Worker;
  void Loop();
  void Housekeep(absl::Time now);
  void HandleMessages(absl::Time now, zmq::socket_t& socket);
  void SpawnLocked(Worker& w, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WorkerDownLocked(Worker& w, absl::Time now, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void NotifyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ShutdownWorkers();
  // Engines on other nodes: the socket a worker talks through, its kill and exit, and the
  // node agents' own messages (hello, heartbeats, exits of the engines they started).
  struct NodeAgent;
  zmq::socket_t& SocketOf(const Worker& w);
  void KillLocked(Worker& w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SpawnRemoteLocked(Worker& w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleNodeMessageLocked(const std::string& node, const ipc::Message& m, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void NodeConnectedLocked(const std::string& node, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Node agents silent past heartbeat_timeout: gone, with their workers.
  void CheckNodesLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleZapRequest();
  void HandleNodeMonitorEvent();
  absl::Status BindNodeSocket();
  void SendQueuedCalls(absl::Time now);
  // Fails every call in flight to `rank` (its worker went down).
  void FailCallsLocked(int32_t rank, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Wake();
  // "engine rank R", or "<pool> engine rank R" for a named pool.
  std::string WorkerName(int32_t rank) const;

  const SupervisorOptions options_;
  const Clock& clock_;
  std::string run_dir_;    // private 0700 temp dir holding the ipc socket
  std::string endpoint_;
  struct ZmqState;
  std::unique_ptr<ZmqState> zmq_;
  std::thread thread_;

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Worker>> workers_ ABSL_GUARDED_BY(mu_);
  std::optional<ModelInfo> model_info_ ABSL_GUARDED_BY(mu_);
  Listener listener_ ABSL_GUARDED_BY(mu_);
  bool started_ ABSL_GUARDED_BY(mu_) = false;      // Start() succeeded: failures now restart
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Duration stop_grace_ ABSL_GUARDED_BY(mu_) = absl::Seconds(5);
  absl::Status startup_error_ ABSL_GUARDED_BY(mu_);
  uint64_t next_request_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t engine_generation_ ABSL_GUARDED_BY(mu_) = 0;
  // Data parallelism: the rendezvous port of the group's current incarnation (a new one
  // after the group went down), and whether WorkerDownLocked is taking the group down.
  int32_t dist_port_ ABSL_GUARDED_BY(mu_) = 0;
  bool group_going_down_ ABSL_GUARDED_BY(mu_) = false;
  // The process group's membership epoch: a rank restarted alone joins the survivors at the
  // next one (docs/device_pool.md, "A rank's crash").
  int64_t group_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  // Whether `w`, just gone down, can restart alone while the other ranks keep running.
  bool CanRestartAloneLocked(const Worker& w) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::map<std::string, std::unique_ptr<NodeAgent>> nodes_ ABSL_GUARDED_BY(mu_);  // by node name
  std::string node_public_key_;  // binary, 32 bytes: the one key the ZAP handler accepts
  bool data_parallel() const { return options_.data_parallel && options_.devices.size() > 1; }

  // Calls from other threads wait here until the loop sends them; the eventfd wakes the
  // loop's poll at once, so a call pays no polling delay.
  struct OutgoingCall {
    int32_t rank;
    ipc::Message request;
    ReplyCallback done;
    uint64_t* served_generation = nullptr;
  };
  struct InFlightCall {
    int32_t rank;
    ReplyCallback done;
    std::string method;
    absl::Duration budget;                 // its deadline, counted from `started_at`
    std::optional<absl::Time> started_at;  // first heartbeat that reported it executing
    uint64_t* served_generation = nullptr;
  };
  // Marks the call a heartbeat reports executing as started.
  void NoteBusyLocked(uint64_t request_id, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes down the workers of calls past their deadline.
  void CheckDeadlinesLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Duration CallBudget(const ipc::Message& request) const;
  std::vector<OutgoingCall> outgoing_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, InFlightCall> in_flight_ ABSL_GUARDED_BY(mu_);
  // Callbacks to run once the lock is released (they may call back into the supervisor).
  std::vector<std::function<void()>> completions_ ABSL_GUARDED_BY(mu_);
  int wake_fd_ = -1;
};

}  // namespace twinkle
