#pragma once
// Internal to server/tinker: the state TinkerApi keeps per future and per model, its worker
// threads and the id helpers, shared by the tinker_*.cc files (the helpers are defined in
// tinker_internal.cc). Not part of the interface.

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "google/protobuf/message.h"
#include "core/common/timer_thread.h"
#include "server/model_set.h"
#include "server/tinker/tinker_api.h"

namespace twinkle::tinker {

inline constexpr char kLog[] = "tinker";

using training::ContextOf;

// Tinker model ids are "{session_id}:train:{model_seq_id}" (the SDK derives them itself when
// it creates a model through load_weights). The adapter is "{session_id}.t{model_seq_id}", so
// the coordinator's run id is "{session_id}-{session_id}.t{model_seq_id}". Both directions
// are pure string maps (they hold across restarts); ids of other runs (Twinkle's) pass
// through unchanged.
std::string ModelIdFor(const std::string& session_id, int64_t model_seq_id);
std::string AdapterNameFor(const std::string& session_id, int64_t model_seq_id);
std::string RunIdOf(const std::string& model_id);
std::string ModelIdOf(const std::string& run_id);
// scheme://<model_id>/rest → scheme://<run_id>/rest (anything else unchanged), and back.
std::string InternalPath(const std::string& path);
std::string TinkerPathOf(const std::string& run_id, const std::string& checkpoint_id);

// REST JSON (tinker_rest.cc): a checkpoint (with expires_at and public) and a training run
// (model_owner is the run's tenant; last_checkpoint / last_sampler_checkpoint from
// `checkpoints`, oldest first).
std::string IsoTime(absl::Time t);
Json CheckpointJson(const registry::CheckpointRecord& c);
Json RunJson(const registry::RunRecord& r, const std::vector<registry::CheckpointRecord>& checkpoints);
// The same, typed (tinker_runs.cc), for the codecs to encode.
CheckpointInfo CheckpointOf(const registry::CheckpointRecord& c);
TrainingRunInfo RunOf(const registry::RunRecord& r, const std::vector<registry::CheckpointRecord>& checkpoints);
// user_metadata as stored with a session or a run (tinker_sessions.cc): its JSON text, ""
// for null; InvalidArgument past kMaxUserMetadataBytes.
absl::StatusOr<std::string> StoredMetadata(const Json& metadata);
// A body's optional "ttl_seconds" (tinker_checkpoints.cc): absent or null = nullopt; else an
// integer in [1, training::kMaxTtlSeconds] (InvalidArgument naming the field otherwise).
absl::StatusOr<std::optional<int64_t>> GetTtl(const Json& body);

// A listing's access_scope (tinker_checkpoints.cc): "" or "owned", or "accessible"; anything
// else is InvalidArgument.
absl::Status CheckScope(const std::string& scope);

// The UNIMPLEMENTED answers of a server built without a part: checkpoints, the run registry,
// signed download URLs.
absl::Status NoCheckpoints();
absl::Status NoRegistry();
absl::Status NoSigner();

// A request body's fingerprint for idempotency (tinker_api.cc): a hash, never 0.
uint64_t FingerprintOf(std::string_view bytes);
// A protobuf's, over its deterministic serialization.
uint64_t FingerprintOf(const google::protobuf::Message& message);

// TinkerApi::models_'s key: model ids are chosen by clients (they embed the session id), so
// the map is per tenant.
inline std::string ModelKey(const std::string& tenant, const std::string& model_id) {
  return tenant + "\n" + model_id;
}

struct Switches {
  bool attn = false, mlp = false, unembed = false;
};

// Request ids are "tk-" and the id of their future in the FutureStore.
inline constexpr char kRequestIdPrefix[] = "tk-";

// A request id handed out: its future (in `store`, which holds the answer) and what its
// promise says when the request is replayed.
struct TinkerApi::Entry {
  std::string request_id, tenant, model_id;
  std::vector<std::string> sample_sequence_ids;  // asample promises
  uint64_t future = 0;
  FutureStore* store = nullptr;
  absl::Time created;
  uint64_t fingerprint = 0;  // a call deduplicated by X-Idempotency-Key (copy_weights): its body's
};

struct TinkerApi::Model {
  ModelStack* stack = nullptr;  // the base model's stack: every op on the model goes there
  std::string model_id, run_id, tenant, adapter, session_id, base_model;
  int64_t rank = 0;
  uint64_t seed = 0;
  Switches switches;
  absl::Mutex mu;
  int64_t next_seq ABSL_GUARDED_BY(mu) = 1;
  struct Waiting {
    std::shared_ptr<Entry> entry;
    Submit submit;
    Encoder encode;
    tenancy::Tenant tenant;  // whose rate was charged `tokens` when it was buffered
    int64_t tokens = 0;
    absl::Time arrived;      // its gap is timed from here
  };
  std::map<int64_t, Waiting> buffered ABSL_GUARDED_BY(mu);
  struct SeqRecord {
    std::string request_id;
    std::string op;            // OpIdentity::name
    uint64_t fingerprint = 0;  // OpIdentity::fingerprint
  };
  std::map<int64_t, SeqRecord> by_seq ABSL_GUARDED_BY(mu);  // seq_id → its first request
};

// A thread for blocking calls and timers (core/common/timer_thread.h).
class TinkerApi::Worker : public TimerThread {};

}  // namespace twinkle::tinker
