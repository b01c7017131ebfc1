#pragma once
// The coordinator's side of the sampler pool, independent of any transport: sampling
// sessions, adapter snapshots, and the decode loop that feeds the engine's continuous
// batch (ipc `sample_step`).
//
// Snapshots. A snapshot is an immutable copy of an adapter's LoRA weights, living in the
// engine as an adapter of its own ("snap:<n>") next to the training adapters, plus a host
// copy here so it can be recreated after an engine restart. Two ways to make one:
//  - from a checkpoint path (twinkle:// or tinker://, sampler_weights or weights) of the
//    caller's tenant: loaded once per path and shared by every session on that path;
//  - from a live adapter (Tinker's save_weights_and_get_sampling_client): captured in the
//    adapter's own queue, after its earlier ops, so it sees exactly the weights those ops
//    left; in memory only, never listed as a checkpoint.
// (A named sampler snapshot, Twinkle's save(is_sampler) / Tinker's save_weights_for_sampler
// with a path, is a sampler_weights checkpoint written by the training coordinator; a
// session on its path loads it.) Snapshots are reference counted by the sessions that pin
// them and removed from the engine when the last one closes or expires.
//
// Sampling requests are queued ops of the training scheduler on a per-session queue, so
// they get future ids, deadlines, idempotency, the tenant's pending-op cap and fair-share
// accounting like every other op. When the scheduler picks one, it is handed to the decode
// thread (the op completes later, from there). The decode thread admits waiting requests
// into the engine's running batch and runs bounded decode chunks; the engine worker serves
// calls in arrival order, so training steps and decode chunks interleave and neither waits
// for more than one of the other (see docs/architecture.md, "Sampler").
//
// Which engines sample are the links given at construction: the training engine (colocated,
// the default) or the dedicated sampler workers (sampler.devices), one lane each with a decode
// thread of its own. A request's rows (its prompts) are spread over the lanes when its turn
// comes, each to the lane with the fewest tokens waiting and running; a snapshot is put on a
// lane's engine when a row there first needs it. Every engine call made here (snapshots,
// sample_step) goes over a lane's link; only the capture of a live adapter's weights runs on
// the training engine, in the adapter's queue. So with dedicated workers the training engine
// holds no snapshot, and a restart of any engine is seen through its own link's generation
// and replays only that lane's rows.
//
// Restarts. Sessions on the base model or a checkpoint path are journaled in the registry
// (SamplerOptions::registry) while open, so a sampling client outlives a restart of the
// server: after it, the session's first use reopens it under the same id (loading its
// checkpoint again), which is what lets the tinker SDK's retry of a sample that a restart
// interrupted succeed. A journaled session nobody uses again is dropped session_timeout after
// the start. Sessions on live snapshots are not journaled (the weights were only in memory):
// their ids carry the boot they were made in, so a later use is told they were lost in a
// restart, never confused with a session of the new boot.

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/common/clock.h"
#include "core/futures/future_store.h"
#include "core/registry/registry.h"
#include "core/training/checkpoints.h"
#include "core/training/coordinator.h"
#include "core/training/engine_link.h"
#include "core/sampling/token_text.h"
#include "core/sampling/types.h"
#include "core/training/types.h"

namespace twinkle::sampling {

using training::SubmitOptions;
using training::TenantContext;

struct SamplingParams {
  int64_t max_tokens = 16;
  double temperature = 1.0;  // 0 = greedy
  double top_p = 1.0;        // 1 = off
  int64_t top_k = 0;         // <= 0 = off
  // The engine's penalties and min-p (ipc::SampleRowMsg, engine/sampler/sampler.h): each off
  // at its default; repetition_penalty > 0, presence / frequency in [-ipc::kMaxPenalty,
  // ipc::kMaxPenalty], min_p in [0, 1].
  double repetition_penalty = 1.0;
  double presence_penalty = 0.0;
  double frequency_penalty = 0.0;
  double min_p = 0.0;
  std::vector<int64_t> stop_token_ids;
  // Matched on the decoded text of the generated tokens; the token that completes a stop
  // string is the last one returned (as for a stop token).
  std::vector<std::string> stop_strings;
  std::optional<uint64_t> seed;  // unset: the server draws one (recorded, so a replay after an engine restart is exact)
  int64_t num_samples = 1;
  bool prompt_logprobs = false;
  bool ignore_eos = false;  // false: the model's eos_token_id ends a sequence, like a stop token
  // k > 0: the k most likely tokens with their logprobs at every generated position / every
  // prompt position, in [0, min(vocab, ipc::kMaxTopLogprobs)]; 0 = off.
  int64_t top_logprobs = 0;
  int64_t prompt_top_logprobs = 0;
  // Tinker's target_prompt_logprobs (one-prompt requests only): [P - 1, target_prompt_width]
  // token ids row-major, row i scored at prompt position i + 1; -1 asks nothing. Width 0 = off.
  std::vector<int64_t> target_prompt_tokens;
  int64_t target_prompt_width = 0;
  // Tinker's prompt_alt_tokens_k: k draws at every prompt position after the first, at
  // `temperature`, seeded by `seed`; 0 = off, at most ipc::kMaxPromptTargets.
  int64_t prompt_alt_tokens_k = 0;
};

// What a streaming request's samples made since their last delta (SubmitSample's `stream`).
struct StreamDelta {
  size_t prompt_index = 0;
  int64_t sample = 0;
  std::vector<int64_t> tokens;  // new tokens, in order; a prefix of the sample's final tokens
  std::vector<float> logprobs;  // theirs, as SampledSequence::logprobs
  TopLogprobs top_logprobs;     // when the request asked top_logprobs: one position per token
  std::string finish_reason;    // on the sample's last delta only: "stop" | "length"
  // On the sample's first delta only, when the request asked prompt_logprobs (and
  // prompt_top_logprobs): the prompt's, aligned as PromptOutput's ([0] NaN / placeholders).
  std::vector<float> prompt_logprobs;
  TopLogprobs prompt_top_logprobs;
};

// A streaming request's consumer. `on_delta` runs on a decode thread, once per decode step
// that gave a sample new tokens (and once more with its finish reason), before the request's
// future completes; it must be quick (hand the bytes to a writer, never block). Cancel
// through SamplerCoordinator::CancelStream: the request's rows leave the batch within one
// decode step and its future completes Cancelled.
//
// A SampleStream made without a consumer is a cancellation handle only: the request is not
// streamed (no deltas, the usual decode chunks), and CancelStream ends it the same way (the
// OpenAI routes' non-streamed request whose client closed its connection).
class SampleStream {
 public:
  SampleStream() = default;
  explicit SampleStream(std::function<void(const StreamDelta&)> on_delta) : on_delta_(std::move(on_delta)) {}
  bool cancelled() const { return cancelled_.load(); }
  bool streams() const { return static_cast<bool>(on_delta_); }

 private:
  friend class SamplerCoordinator;
  std::function<void(const StreamDelta&)> on_delta_;
  std::atomic<bool> cancelled_{false};
};

struct SamplingSessionInfo {
  std::string id;
  std::string base_model;
  std::string model_path;  // "" = the base model; for a live snapshot, the adapter it came from
  std::string owner;       // the training session it belongs to, or empty
};

struct SamplerOptions {
  std::string base_model;
  std::string model_dir;  // its tokenizer.json decodes tokens for stop strings
  int64_t max_decode_steps_per_call = 8;  // one decode chunk; bounds what a training step waits
  // The decode chunk while a lane runs a streaming request's rows: 1 flushes every token.
  int64_t stream_decode_steps_per_call = 1;
  int32_t max_snapshots = 64;             // engine snapshots held at once, server-wide
  // Live (unnamed) adapter snapshots a tenant holds at once: a new one beyond this evicts the
  // tenant's least recently used one (its session is closed; using it later is refused).
  int32_t max_snapshots_per_tenant = 16;
  int32_t max_sessions_per_tenant = 64;
  // Sessions closed (evicted, owner finished or gone) are remembered this many at most, so a
  // later use gets "released: <why>" rather than "not found".
  int32_t released_sessions_remembered = 4096;
  absl::Duration session_timeout = absl::Seconds(1800);  // unused this long: closed
  int64_t default_max_tokens = 16;
  int64_t max_num_samples = 128;
  // Where open sessions are journaled so they outlive a restart (null: in memory only). Each
  // row names base_model, and only this model's rows are reopened here; the default (first)
  // model also takes the rows that name none (journaled before the registry's schema v6), and
  // deletes those of a model no longer served (not one of other_models): a session is never
  // reopened on another model than its own.
  registry::Registry* registry = nullptr;
  bool default_model = true;
  std::vector<std::string> other_models;  // the other served models (the default model's only)
};

// One lane (engine that samples): its share of the figures below.
struct SamplerLaneStats {
  int64_t waiting = 0;
  int64_t running = 0;
  int64_t blocks_in_use = 0;
  int64_t blocks_total = 0;
  int64_t tokens_generated = 0;
  int64_t states_in_use = 0;  // recurrent state slots of a hybrid model (0 and 0: dense)
  int64_t states_total = 0;
};

// Sums over the lanes, and each lane's own figures (`lanes`, in link order).
struct SamplerStats {
  int64_t sessions = 0;
  int64_t snapshots = 0;
  int64_t waiting = 0;   // handed over by the scheduler, not yet admitted
  int64_t running = 0;   // in an engine's batch
  int64_t blocks_in_use = 0;
  int64_t blocks_total = 0;  // known once a lane's engine has answered a sample_step
  int64_t block_size = 0;
  int64_t tokens_generated = 0;
  int64_t states_in_use = 0;
  int64_t states_total = 0;
  std::vector<SamplerLaneStats> lanes;
};

class SamplerCoordinator {
 public:
  // `engines`: the links of the engines that sample (at least one; the same model on each).
  SamplerCoordinator(SamplerOptions options, std::vector<training::EngineLink*> engines,
                     training::TrainingCoordinator& training, training::CheckpointStore* checkpoints,
                     FutureStore& futures, const Clock& clock = RealClock());
  ~SamplerCoordinator();

  void Start();
  void Stop();

  // A session on the base model (`model_path` empty) or on a checkpoint of the caller's
  // tenant (another tenant's path is NotFound, like an unknown one). `owner`: the training
  // session (TrainingCoordinator's) it belongs to, or empty; an owned session is closed when
  // its owner ends (CloseOwnedBy) or is gone (Housekeep).
  absl::StatusOr<std::string> CreateSession(const TenantContext& tenant, const std::string& model_path,
                                            const std::string& owner = "");
  // Snapshots adapter `adapter_name` in its queue and opens a session on the snapshot.
  // Future value: SnapshotSession. Live snapshots are capped per tenant
  // (max_snapshots_per_tenant): making one beyond the cap evicts the tenant's least recently
  // used one, so a loop that never closes anything holds a bounded number.
  absl::StatusOr<uint64_t> SubmitSnapshotSession(const TenantContext& tenant, const std::string& adapter_name,
                                                 const SubmitOptions& options, const std::string& owner = "");
  // The one implicit session of (tenant, model_path), for requests that name no session:
  // made on first use, reused afterwards (and made again if it was closed).
  absl::StatusOr<std::string> ImplicitSession(const TenantContext& tenant, const std::string& model_path);
  // The open sessions of the tenant owned by training session `owner`, by id.
  std::vector<std::string> SessionsOwnedBy(const std::string& tenant, const std::string& owner) const;
  // Closes every session of the tenant owned by training session `owner`; returns how many.
  int64_t CloseOwnedBy(const TenantContext& tenant, const std::string& owner);
  absl::StatusOr<SamplingSessionInfo> GetSession(const TenantContext& tenant, const std::string& session_id);
  // Whether the tenant's session is here: open, or journaled by the last run on this model
  // and not yet reopened (its first use reopens it). Not a use (GetSession is: it moves the
  // session up the LRU order and resets its idle timer).
  bool HoldsSession(const std::string& tenant, const std::string& session_id) const;
  absl::Status CloseSession(const TenantContext& tenant, const std::string& session_id);

  // Future value: SampleOutput. Bad input → INVALID_ARGUMENT naming the field, before
  // anything is queued (token ids, lengths against the model's positions, parameters).
  // `stream` (optional): its on_delta gets each sample's tokens as they are decoded.
  absl::StatusOr<uint64_t> SubmitSample(const TenantContext& tenant, const std::string& session_id,
                                        std::vector<std::vector<int64_t>> prompts, const SamplingParams& params,
                                        const SubmitOptions& options, std::shared_ptr<SampleStream> stream = nullptr);
  // The stream's consumer is gone (a client disconnected): its request's rows leave the
  // waiting lines and the engines' batches at the next decode step, and its future completes
  // Cancelled. Any thread; idempotent.
  void CancelStream(SampleStream& stream);

  // What a sampling request costs, in tokens: (prompt + max_tokens) x num_samples summed over
  // the prompts (max_tokens 0 = the default). The figure max_tokens_per_request limits and
  // the transports charge to the tenant's token rate (tokens_per_s), as for training.
  int64_t TokensOf(const std::vector<std::vector<int64_t>>& prompts, const SamplingParams& params) const;

  // What a finished sampling request used, for usage metering: its prompts' tokens (counted
  // once per prompt) and the tokens it generated (every sample). Failed requests report none.
  struct SampleUsage {
    std::string tenant;
    int64_t key_id = 0;
    std::string session_id;  // the training session that owns the sampling session, else the sampling session
    int64_t prefill_tokens = 0;
    int64_t sampled_tokens = 0;
  };
  // Called once per successful request, on a decode thread. Set before Start.
  void SetUsageListener(std::function<void(const SampleUsage&)> listener) { usage_listener_ = std::move(listener); }

  // Closes sessions unused for session_timeout, and owned sessions whose training session
  // ended. Call periodically.
  void Housekeep();
  SamplerStats stats() const;

 private:
  struct Snapshot;
  struct Session;
  struct Request;
  struct Row;
  struct Lane;
  std::function<void(const SampleUsage&)> usage_listener_;

  absl::StatusOr<std::shared_ptr<Session>> FindSession(const TenantContext& tenant, const std::string& id);
  // A session on the base model or a checkpoint (CreateSession without the journal); `id`
  // non-empty: reopens that journaled session under its id.
  absl::StatusOr<std::string> OpenSession(const TenantContext& tenant, const std::string& model_path,
                                          const std::string& owner, const std::string& id);
  // FindSession's miss: a session journaled before the restart is reopened (OK), one of an
  // earlier boot that was not kept is FailedPrecondition, anything else NotFound.
  absl::Status ReopenAfterRestart(const TenantContext& tenant, const std::string& id);
  // The registry rows of open non-live sessions: written after a session opens, deleted
  // after one is released (outside mu_: each is a synchronous SQLite write).
  void Journal(const std::string& tenant, const std::string& id, const std::string& model_path,
               const std::string& owner);
  void Unjournal(const std::vector<std::shared_ptr<Session>>& released);
  std::shared_ptr<Snapshot> NewSnapshot(const std::string& tenant, const std::string& source,
                                        training::TrainingCoordinator::CapturedWeights weights)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `id` empty: a new one ("sampler-<boot>-<n>").
  std::string AddSession(const std::string& tenant, const std::string& model_path,
                         std::shared_ptr<Snapshot> snapshot, const std::string& owner, bool live,
                         const std::string& id = "") ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes a session, remembering why (a later use is told), and returns its scheduler queue
  // for the caller to drop once mu_ is released.
  std::string ReleaseLocked(std::map<std::string, std::shared_ptr<Session>>::iterator it, const std::string& why,
                            std::vector<std::shared_ptr<Session>>* keep) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Evicts the tenant's least recently used live sessions (and so their snapshots) until a
  // new live snapshot fits the per-tenant caps (and, while it has any, the server-wide one).
  void MakeRoomForLiveSnapshotLocked(const std::string& tenant, std::vector<std::string>* queues,
                                     std::vector<std::shared_ptr<Session>>* keep) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropQueues(const std::string& tenant, const std::vector<std::string>& queues, const std::string& why);
  absl::Status CheckSnapshotRoom() const;
  absl::Status CheckSessionRoom(const std::string& tenant) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Scheduler thread: the op's turn came; its rows wait for the decode threads, each on the
  // lane that had the fewest tokens waiting and running.
  void Enqueue(std::shared_ptr<Request> request);
  Lane& LeastLoadedLane() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WakeAllLanes() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // A lane's decode thread.
  void DecodeLoop(Lane& lane);
  absl::Status EnsureOnEngine(Lane& lane, Snapshot& snapshot);
  void RemoveDeadSnapshots(Lane& lane);
  // Any decode thread: the request is done (or failed); its other rows leave every lane.
  void Finish(Request& request, FutureResult result);
  void Collect(Row& row, const ipc::SampleRowResultMsg& result, const std::vector<std::string>& buffers);
  // Streaming rows: hands sample `sample`'s tokens [emitted, upto) (with their log-probs and
  // top-k, indexed alike) to the request's stream.
  static void EmitDelta(Row& row, size_t sample, const SampledSequence& so_far, size_t upto,
                        const std::string& finish_reason);

  static std::vector<std::unique_ptr<Lane>> MakeLanes(const std::vector<training::EngineLink*>& engines);

  const SamplerOptions options_;
  std::vector<std::unique_ptr<Lane>> lanes_;  // fixed at construction
  training::EngineLink& model_;  // lanes_[0]'s link: vocabulary and positions (the same on every lane)
  training::TrainingCoordinator& training_;
  training::CheckpointStore* checkpoints_;
  FutureStore& futures_;
  const Clock& clock_;
  std::optional<TokenText> token_text_;  // stop strings; unset when the model has no tokenizer.json
  const std::vector<int64_t> eos_token_ids_;

  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  // Sessions closed by the server: id → (tenant, why), oldest first for the bound.
  std::map<std::string, std::pair<std::string, std::string>> released_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> released_order_ ABSL_GUARDED_BY(mu_);
  // ImplicitSession's: tenant + "\n" + model_path → session id.
  std::map<std::string, std::string> implicit_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::weak_ptr<Snapshot>> snapshots_by_source_ ABSL_GUARDED_BY(mu_);  // tenant + path
  std::map<std::string, int64_t> in_flight_by_tenant_ ABSL_GUARDED_BY(mu_);  // requests handed over
  // Sessions journaled by an earlier boot and not used since the start: id → its row, until
  // their first use (reopened) or start + session_timeout (dropped with their rows).
  std::map<std::string, registry::SamplingSessionRecord> dormant_ ABSL_GUARDED_BY(mu_);
  absl::Time dormant_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // This boot's tag in session ids: an id of another boot is never taken for one of this.
  const std::string boot_tag_;
  uint64_t next_session_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_snapshot_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_row_ ABSL_GUARDED_BY(mu_) = 1;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool started_ ABSL_GUARDED_BY(mu_) = false;

  // Snapshots die wherever their last holder lets go (often under mu_), so their engine ids
  // go to lists of their own, one per lane that holds them, emptied by that lane's thread.
  struct Graveyard {
    absl::Mutex mu;
    std::vector<std::vector<std::string>> engine_ids ABSL_GUARDED_BY(mu);  // by lane
    int64_t live ABSL_GUARDED_BY(mu) = 0;
  };
  std::shared_ptr<Graveyard> graveyard_ = std::make_shared<Graveyard>();
};

}  // namespace twinkle::sampling
