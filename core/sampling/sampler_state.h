#pragma once
// SamplerCoordinator's private types, shared by its two source files: sampler_coordinator.cc
// (sessions, snapshots, submission) and sampler_decode.cc (the decode thread). Included by
// nothing else.

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/sampling/sampler_coordinator.h"

namespace twinkle::sampling {
namespace sampler_internal {
inline constexpr char kLog[] = "sampler";
}  // namespace sampler_internal

// An immutable copy of adapter weights, on the engine as adapter `engine_id` once the
// decode thread put it there (again after an engine restart).
struct SamplerCoordinator::Snapshot {
  std::string engine_id;
  std::string tenant;
  std::string source;  // the checkpoint path, or "adapter <name>"
  training::TrainingCoordinator::CapturedWeights weights;
  // Per lane (sampling engine), written by that lane's decode thread: the engine generation
  // the snapshot was created in there; 0 = not on that engine.
  std::vector<uint64_t> engine_generation;
};

struct SamplerCoordinator::Session {
  std::string id;
  std::string tenant;
  std::string model_path;
  std::shared_ptr<Snapshot> snapshot;  // null: the base model
  std::string owner;                   // the training session it belongs to, or empty
  bool live = false;                   // its snapshot is a live (unnamed) adapter capture
  absl::Time last_used;
};

// One SubmitSample call: its prompts run as engine rows; the future completes when the last
// row finished (or the first one failed).
struct SamplerCoordinator::Request {
  uint64_t future_id = 0;
  std::string tenant;
  int64_t key_id = 0;      // usage metering
  std::string usage_session;
  std::shared_ptr<Snapshot> snapshot;
  std::vector<std::vector<int64_t>> prompts;
  SamplingParams params;
  // Streaming requests, and non-streamed ones their caller may cancel (a SampleStream with no
  // consumer): CancelStream ends either.
  std::shared_ptr<SampleStream> stream;
  bool streams() const { return stream != nullptr && stream->streams(); }
  SampleOutput output;
  size_t rows_left = 0;
  bool finished = false;  // guarded by the coordinator's mu_
};

struct SamplerCoordinator::Row {
  std::shared_ptr<Request> request;
  size_t prompt_index = 0;
  uint64_t engine_id = 0;
  int64_t tokens = 0;  // (prompt + max_tokens) x num_samples: what it holds of a lane's KV cache at most
  // Rows with stop strings (decode thread only): each sample's tokens so far, from the
  // engine's progress reports, and whether it has been told to stop.
  std::vector<std::vector<int64_t>> partial;
  std::vector<bool> stop_sent;
  // Streaming rows: each sample's progress so far with log-probs (tokens as in `partial`).
  std::vector<SampledSequence> partial_streamed;
  // Streaming rows (decode thread only): each sample's tokens already handed to the stream.
  std::vector<size_t> emitted;
  // Streaming rows that asked for prompt log-probs (decode thread only): the prompt's, aligned
  // as PromptOutput's, from the engine's first progress report (or the result), for each
  // sample's first delta.
  std::vector<float> prompt_logprobs;
  TopLogprobs prompt_top_logprobs;
};

// One engine that samples (the training engine when colocated, else one dedicated sampler
// worker) and the decode thread that drives its running batch. Rows are spread over lanes
// when they are handed over (Enqueue): each goes to the lane with the fewest tokens waiting
// and running, and stays there (a replay after that engine restarts runs on it again).
struct SamplerCoordinator::Lane {
  size_t index = 0;
  training::EngineLink* engine = nullptr;
  // Guarded by the coordinator's mu_.
  std::deque<std::shared_ptr<Row>> waiting;          // FIFO, not yet in the engine
  std::map<uint64_t, std::shared_ptr<Row>> running;  // by engine request id
  std::vector<uint64_t> cancel;                      // engine rows of failed requests, to drop
  int64_t blocks_in_use = 0;  // from the engine's last sample_step reply
  int64_t blocks_total = 0;
  int64_t block_size = 0;
  int64_t states_in_use = 0;  // recurrent state slots (hybrid models), from the same reply
  int64_t states_total = 0;
  int64_t tokens_generated = 0;
  absl::CondVar wake;  // with mu_: work arrived, a snapshot may be free, or stop
  std::thread thread;
  // The lane's decode thread only.
  uint64_t generation = 0;
  bool reset_engine = false;
  // (engine request id, sample) whose tokens so far contain a stop string: the next
  // sample_step ends them, so they stop decoding within one chunk of the match.
  std::vector<std::pair<uint64_t, int64_t>> early_stops;
  std::string last_step_error;  // the last sample_step error logged; cleared by a success
};

}  // namespace twinkle::sampling
