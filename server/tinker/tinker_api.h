#pragma once
// The Tinker API (../shared/reference/tinker-protocol.md), independent of the transport:
// the HTTP routes (http_routes.cc) and the gRPC tinker.v1.TinkerService
// (server/grpc/tinker_service.cc) are thin layers over this class.
//
// Each operation takes a typed request and returns a typed result (tinker_requests.h); the
// transports are codecs around it: the HTTP routes decode the SDK's JSON bodies and encode the
// results as JSON (tinker_codec.h), TinkerService does the same with the tinker.v1 messages.
// forward_backward takes the protobuf ForwardBackwardRequest itself (its JSON form, of
// <=0.24 SDKs, is decoded into the same datums). A future's result is encoded both ways when
// its op completes (the JSON and a serialised v1::RetrieveFutureResponse), because that is
// what is journaled; retrieve_future hands back the stored encodings.
//
// What lives here and nowhere else:
//  - Tinker model ids: a model is an adapter of the caller's tenant created through
//    TrainingCoordinator::AddAdapter (lora_alpha training::kDefaultLoraAlpha = 32, rsLoRA off, targets from
//    train_attn/train_mlp/train_unembed); its model_id is the adapter's run id, so
//    tinker://<model_id>/weights/<name> resolves through the checkpoint registry.
//  - Sessions: the coordinator's sessions; models die with a session that stops beating.
//  - seq_id ordering per model: an op whose seq_id is ahead of the next expected one waits
//    in a reorder buffer (the SDK posts the chunks of one forward_backward concurrently,
//    the first one last); a gap that is not filled within seq_gap_timeout is skipped.
//  - Idempotency: (session, model_seq_id), (model_id, seq_id), (session,
//    sampling_session_seq_id) and (sampling session, seq_id) return the first request id;
//    a (model_id, seq_id) replayed with another op or another body is refused (400), and the
//    scheduler's idempotency key "tinker-seq-N" carries the op's name and fingerprint too.
//  - Futures: a request id ("tk-<id>") is a future of the server's one FutureStore,
//    completed with the encoded answer (EncodedResult) when the op it wraps finishes, so it
//    is journaled in the registry: after a restart retrieve_future still answers a request
//    finished before it, and one still in flight gets HTTP 410 ("interrupted by a
//    restart"; the SDK resubmits). retrieve_future long-polls without a thread (a
//    completion callback or a timer answers).
//  - Errors: absl codes; transports map them (server/status_map.h, one map each). A failure
//    inside a future is {"error", "category": "user" | "server"}.

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/futures/future_store.h"
#include "core/registry/registry.h"
#include "core/storage/tar_stream.h"
#include "core/tenancy/rate_limiter.h"
#include "core/tenancy/tenant.h"
#include "core/training/checkpoints.h"
#include "core/training/coordinator.h"
#include "server/tinker/stability_store.h"
#include "server/tinker/tinker_requests.h"
#include "server/tinker/trace_store.h"
#include "tinker/v1/tinker_public.pb.h"

namespace twinkle::sampling {
class SamplerCoordinator;
}  // namespace twinkle::sampling

namespace twinkle {
class ModelSet;
class ModelStack;
}  // namespace twinkle

namespace twinkle::tinker {

class UrlSigner;

namespace v1 = ::tinker::v1;  // the generated wire messages

using Json = nlohmann::json;

// What an op's encoder makes of its result when the op finishes: both encodings, which the
// future keeps (and the journal stores) as an EncodedResult.
struct Outcome {
  absl::Status error;  // not OK: the op failed
  Json json;           // OK: the HTTP API's answer
  std::string proto;   // OK: TinkerService's, a serialised v1::RetrieveFutureResponse ("" for
                       // an HTTP-only call)
  static Outcome Failed(absl::Status status) {
    Outcome o;
    o.error = std::move(status);
    return o;
  }
  // An op result in both encodings.
  static Outcome Of(const OpResult& result);
};

// "user" for errors the caller caused (bad input, unknown names, quotas), "server" otherwise.
const char* ErrorCategory(const absl::Status& status);

// The HTTP status for an error: server/status_map.h's ToHttpStatus (the one HTTP map).
int HttpStatusFor(const absl::Status& status);

// retrieve_future's HTTP body for a failed op: {"error", "category"}.
Json FailureJson(const absl::Status& status);

// retrieve_future's answer.
struct Poll {
  bool done = false;     // false: still pending (answer try_again)
  absl::Status error;    // done: the op's failure, or OK
  EncodedResult result;  // done and OK: the stored encodings (Outcome's json as text, proto)
  std::string request_id;
  std::string queue_state = "active";
};

// The largest create_model / create_session user_metadata, as serialised JSON (docs/config.md).
inline constexpr size_t kMaxUserMetadataBytes = 16 * 1024;
// create_session's other metadata (docs/api.md): tags per session and bytes per tag, the
// display name's bytes, a project id's bytes ([A-Za-z0-9_.:-]); search pages.
inline constexpr size_t kMaxSessionTags = 64;
inline constexpr size_t kMaxTagBytes = 128;
inline constexpr size_t kMaxDisplayNameBytes = 256;
inline constexpr size_t kMaxProjectIdBytes = 128;
inline constexpr int32_t kMaxSearchLimit = 200;
// The longest X-Idempotency-Key honoured (the SDK's are ~60 bytes).
inline constexpr size_t kMaxIdempotencyKeyBytes = 256;

// The served base models, their coordinators, samplers and checkpoint stores come from the
// ModelSet (server/model_set.h): a model is created on the base model create_model names,
// and every later call on it goes to that model's stack.
struct TinkerOptions {
  int32_t max_lora_rank = 128;
  absl::Duration long_poll = absl::Seconds(25);
  absl::Duration seq_gap_timeout = absl::Seconds(30);
  absl::Duration retention = absl::Hours(24);  // completed futures stay fetchable this long
  int64_t fwdbwd_max_chunk_len = 1024;
  int64_t sample_max_concurrent_requests = 128;
  bool jwt_auth = false;  // client config pjwt_auth_enabled: the SDK exchanges its key for a token
};

class TinkerApi {
 public:
  // `checkpoints`: the default model's store, for what reads the shared registry and data_dir
  // (resolving, listing, deleting, copying checkpoints); saves go through each model's
  // coordinator and so its own store.
  TinkerApi(TinkerOptions options, ModelSet& models, FutureStore& futures, registry::Registry* registry,
            training::CheckpointStore* checkpoints, tenancy::TokenRateLimiter* rate_limiter);
  ~TinkerApi();

  // ---- configuration, sessions (direct) ----
  Json ClientConfig() const;
  Json DynamicConfig() const;
  ServerCapabilities GetServerCapabilities() const;
  absl::StatusOr<CreateSessionResult> CreateSession(const tenancy::Tenant& tenant, const CreateSessionRequest& request);
  // A session finished with FinishSession answers 410 (the SDK then stops heartbeating);
  // an unknown or expired one 404.
  absl::StatusOr<SessionHeartbeatResult> SessionHeartbeat(const tenancy::Tenant& tenant,
                                                          const SessionHeartbeatRequest& request);
  // sessions/{id}/finish (ServiceClient.close): the session's sampling sessions and their
  // snapshots are closed at once; its models are unloaded and the session ended on the
  // blocking thread (GetCapacity and /metrics are back to the figures before it within a
  // second). Finishing an unknown or already finished session answers OK (the SDK retries).
  absl::StatusOr<Json> FinishSession(const tenancy::Tenant& tenant, const std::string& session_id);
  Json Telemetry(const Json& body) const;

  // ---- training (futures) ----
  absl::StatusOr<FuturePromise> CreateModel(const tenancy::Tenant& tenant, const CreateModelRequest& request);
  absl::StatusOr<FuturePromise> UnloadModel(const tenancy::Tenant& tenant, const ModelRequest& request);
  absl::StatusOr<FuturePromise> ForwardBackward(const tenancy::Tenant& tenant,
                                                const v1::ForwardBackwardRequest& request);
  // The JSON form of forward_backward (<=0.24 SDKs): {"forward_backward_input" | "forward_input":
  // {"data", "loss_fn", "loss_fn_config"}, "model_id", "seq_id"}.
  absl::StatusOr<FuturePromise> ForwardBackwardJson(const tenancy::Tenant& tenant, const Json& body, bool forward_only);
  absl::StatusOr<FuturePromise> OptimStep(const tenancy::Tenant& tenant, const OptimStepRequest& request);
  absl::StatusOr<FuturePromise> SaveWeights(const tenancy::Tenant& tenant, const SaveWeightsRequest& request);
  absl::StatusOr<FuturePromise> LoadWeights(const tenancy::Tenant& tenant, const LoadWeightsRequest& request);
  absl::StatusOr<FuturePromise> SaveWeightsForSampler(const tenancy::Tenant& tenant,
                                                      const SaveWeightsForSamplerRequest& request);

  // ---- training (direct) ----
  absl::StatusOr<GetInfoResult> GetInfo(const tenancy::Tenant& tenant, const ModelRequest& request);
  absl::StatusOr<WeightsInfoResult> WeightsInfo(const tenancy::Tenant& tenant, const WeightsInfoRequest& request);

  // ---- sampling ----
  absl::StatusOr<CreateSamplingSessionResult> CreateSamplingSession(const tenancy::Tenant& tenant,
                                                                    const CreateSamplingSessionRequest& request);
  absl::StatusOr<FuturePromise> Sample(const tenancy::Tenant& tenant, const SampleRequest& request);
  absl::StatusOr<Json> GetSampler(const tenancy::Tenant& tenant, const std::string& sampler_id);

  // ---- futures ----
  // Calls `done` once: with the outcome when the future completes within long_poll, else
  // with a pending Poll. NotFound for an unknown request id or another tenant's. `done`
  // may run on this thread, a completion thread or the timer thread.
  void RetrieveFuture(const tenancy::Tenant& tenant, const RetrieveFutureRequest& request,
                      std::function<void(absl::StatusOr<Poll>)> done);

  // ---- REST (tinker_runs.cc) ----
  // access_scope "owned" (default) or "accessible" (also other tenants' published
  // checkpoints and their runs); anything else is InvalidArgument.
  absl::StatusOr<TrainingRunsResult> ListTrainingRuns(const tenancy::Tenant& tenant,
                                                      const ListTrainingRunsRequest& request);
  absl::StatusOr<CheckpointsResult> ListCheckpoints(const tenancy::Tenant& tenant,
                                                    const ListCheckpointsRequest& request);
  absl::StatusOr<DeleteCheckpointResult> DeleteCheckpoint(const tenancy::Tenant& tenant,
                                                          const DeleteCheckpointRequest& request);
  // The JSON forms behind the HTTP routes GET /training_runs/{id} and /checkpoints
  // (tinker_rest.cc; their scoped wrappers are in tinker_checkpoints.cc).
  absl::StatusOr<Json> GetTrainingRun(const tenancy::Tenant& tenant, const std::string& run_id);
  absl::StatusOr<Json> ListUserCheckpoints(const tenancy::Tenant& tenant, int32_t limit, int32_t offset);
  // ---- sessions (tinker_sessions.cc) ----
  // Newest first, from the registry (finished sessions included).
  absl::StatusOr<Json> ListSessions(const tenancy::Tenant& tenant, int32_t limit, int32_t offset);
  // training_run_ids, sampler_ids, user_metadata, display_name (+ tags, project_id); another
  // tenant's or an unknown session is 404.
  absl::StatusOr<Json> GetSession(const tenancy::Tenant& tenant, const std::string& session_id);
  // POST /sessions/search (SessionSearchRequest → SessionSearchResponse).
  absl::StatusOr<Json> SearchSessions(const tenancy::Tenant& tenant, const Json& body);
  // PUT /sessions/{id}/project: the project is created for the tenant when new.
  absl::StatusOr<Json> SetSessionProject(const tenancy::Tenant& tenant, const std::string& session_id,
                                         const Json& body, const std::string& peer);
  // GET /sessions/{id}/trace_export: {"status": "ready", "url": a data: URL holding the
  // session's requests as a Chrome/Perfetto JSON trace} (timings and sizes only).
  absl::StatusOr<Json> TraceExport(const tenancy::Tenant& tenant, const std::string& session_id);
  // The session a request body belongs to (session_id, a model_id's session, a sampling
  // session's owner), or "" — for the trace.
  std::string TraceSessionOf(const tenancy::Tenant& tenant, const Json& body);
  TraceStore& traces() { return traces_; }

  // ---- checkpoints: retention, export, sharing (tinker_checkpoints.cc) ----
  // access_scope as for ListTrainingRuns.
  absl::StatusOr<Json> GetTrainingRunScoped(const tenancy::Tenant& tenant, const std::string& model_id,
                                            const std::string& access_scope);
  absl::StatusOr<Json> ListUserCheckpointsScoped(const tenancy::Tenant& tenant, int32_t limit, int32_t offset,
                                                 const std::string& access_scope);
  // Signing of download URLs; without it external_weights_urls is UNIMPLEMENTED. Set once
  // before serving. `clock` decides URL expiry (the retention clock).
  void SetDownloads(const UrlSigner* signer, absl::Duration url_ttl, const Clock* clock);
  // save_weights_external: a future like save_weights_for_sampler; the checkpoint is
  // external_weights/<path> (a PEFT directory: adapter_model.safetensors + adapter_config.json).
  absl::StatusOr<Json> SaveWeightsExternal(const tenancy::Tenant& tenant, const Json& body);
  // PUT .../checkpoints/{id}/ttl {"ttl_seconds": int | null}. Owner only (404 otherwise).
  absl::StatusOr<Json> SetCheckpointTtl(const tenancy::Tenant& tenant, const std::string& model_id,
                                        const std::string& checkpoint_id, const Json& body);
  // POST (publish) / DELETE (unpublish) .../checkpoints/{id}/publish. Owner only (404
  // otherwise); already in that state: 409.
  absl::StatusOr<Json> PublishCheckpoint(const tenancy::Tenant& tenant, const std::string& model_id,
                                         const std::string& checkpoint_id, bool publish);
  // GET .../checkpoints/external_weights/<name>/external_weights_urls: one signed URL per file
  // under `base_url` (scheme://host[:port]), {"urls", "expires", "sha256"}. The caller must be
  // able to read the checkpoint (its own or published).
  absl::StatusOr<Json> ExternalWeightsUrls(const tenancy::Tenant& tenant, const std::string& model_id,
                                           const std::string& checkpoint_id, const std::string& base_url);
  // GET .../checkpoints/{checkpoint_id}/archive (SDKs <= 0.30 get_checkpoint_archive_url and
  // their `tinker checkpoint download`): {"url", "expires"}, one signed URL of the file
  // "archive.tar": a tar of the PEFT files (adapter_model.safetensors, adapter_config.json)
  // plus an empty checkpoint_complete marker. Same access rule and errors as
  // ExternalWeightsUrls.
  absl::StatusOr<Json> ArchiveUrl(const tenancy::Tenant& tenant, const std::string& model_id,
                                  const std::string& checkpoint_id, const std::string& base_url);
  // GET /twinkle/weights/<tenant>/<run>/<kind>/<name>/<file>?expires=&sig= (no API key: the
  // signature is the credential). PERMISSION_DENIED for a bad or expired signature; NotFound
  // when the checkpoint is gone, expired, unpublished (for another tenant) or lacks the file.
  // The answer is a stream: its length and checksum are known before the first byte; the
  // files are read in chunks (core/storage/tar_stream.h) and checked as they go by.
  struct WeightsFile {
    int64_t size = 0;
    std::string sha256;  // lower-case hex: the file's recorded one, or the archive's
    // Hands the bytes to `sink` in chunks; returns their SHA-256 (DataLoss when a file
    // differs from its record: the transfer must then be aborted).
    std::function<absl::StatusOr<std::string>(const storage::ChunkSink& sink)> stream;
  };
  absl::StatusOr<WeightsFile> ServeWeightsFile(const std::string& path_tail, const std::string& expires,
                                               const std::string& signature);
  // POST /api/v1/copy_weights {"source_path", "destination_project_id", "ttl_seconds"}: a
  // copy (same kind and name) in a new run of the caller that cannot be trained on.
  // `idempotency_key` (the SDK's X-Idempotency-Key header, at most kMaxIdempotencyKeyBytes;
  // "" = none): a replay with the same key and body answers the first copy's answer and
  // copies nothing (the answer is a future of the FutureStore, so it is kept, bounded and
  // expired like every other); the same key with another body is an idempotency conflict
  // (400); a replay while the first is still copying waits for it (at most 60 s, then 503).
  // A failed copy keeps nothing: its replay copies again. `replayed`, when set, tells
  // whether the answer is an earlier call's (nothing was copied: no audit row for it).
  absl::StatusOr<Json> CopyWeights(const tenancy::Tenant& tenant, const Json& body,
                                   const std::string& idempotency_key = "", bool* replayed = nullptr);
  // POST /api/v1/twinkle/import_adapter: a PEFT LoRA adapter trained elsewhere, as the
  // caller's checkpoint weights/<name> of a new run (import-<hex>) that load_state,
  // create_training_client_from_state and sampling use like any other. Body:
  // {"name", "adapter_config": {...adapter_config.json...}, "adapter_model": base64 of
  // adapter_model.safetensors, "ttl_seconds"?, "base_model"? (a served model's name or
  // directory; default: the first)}. Validated against that model's weights before anything
  // is written (CheckpointStore::ImportPeftAdapter), and its run is recorded on that model
  // (load_state, sampling and the OpenAI routes then use it); quota-checked. Answers
  // {"tinker_path", "model_id"}. The body's size is bounded by the route (max_import_bytes).
  absl::StatusOr<Json> ImportAdapter(const tenancy::Tenant& tenant, const Json& body);

  const TinkerOptions& options() const { return options_; }

 private:
  struct Entry;
  struct Model;
  class Worker;
  using Encoder = std::function<Outcome(const FutureValue&)>;
  // Submits to the coordinator (returns the future id) or fails.
  using Submit = std::function<absl::StatusOr<uint64_t>()>;

  // A model to create: the adapter, then `then(model, entry)` on the blocking thread
  // (it completes the future entry).
  struct ModelSpec {
    ModelStack* stack = nullptr;  // the base model it is created on
    std::string session;
    int64_t model_seq = 0;
    int64_t rank = 0;
    uint64_t seed = 0;
    bool attn = true, mlp = true, unembed = true;
    std::vector<std::string> targets;
  };
  using ModelThen = std::function<void(const std::shared_ptr<Model>&, const std::shared_ptr<Entry>&)>;
  absl::StatusOr<Json> CopyWeightsOnce(const tenancy::Tenant& tenant, const Json& body);
  absl::StatusOr<FuturePromise> StartModel(const tenancy::Tenant& tenant, ModelSpec spec, ModelThen then);
  absl::StatusOr<FuturePromise> CreateViaLoad(const tenancy::Tenant& tenant, const LoadWeightsRequest& request);

  std::shared_ptr<Entry> NewEntry(const std::string& tenant, const std::string& model_id);
  static void Complete(const std::shared_ptr<Entry>& entry, Outcome outcome);
  void Attach(const std::shared_ptr<Entry>& entry, uint64_t future_id, Encoder encode);
  FuturePromise Promise(const Entry& entry) const;
  absl::StatusOr<std::shared_ptr<Model>> FindModel(const tenancy::Tenant& tenant, const std::string& model_id);
  // What every save on a model names (save_weights, save_weights_for_sampler,
  // save_weights_external): one of the caller's models, its seq_id and a checkpoint name
  // (ValidatePathName). `path_required` false: an empty path is allowed
  // (save_weights_for_sampler's unnamed form).
  struct ModelCall {
    std::string model_id;
    int64_t seq = 0;
    std::shared_ptr<Model> model;
    std::string name;
  };
  absl::StatusOr<ModelCall> ModelCallOf(const tenancy::Tenant& tenant, const std::string& model_id, int64_t seq_id,
                                        const std::string& path, bool path_required = true);
  // What a seq-ordered call is, for idempotency: a replayed seq_id must repeat the same op
  // (`name`) with the same body (`fingerprint`, 0 = not compared).
  struct OpIdentity {
    const char* name = "";
    uint64_t fingerprint = 0;
    int64_t tokens = 0;  // what the op costs (forward_backward: its tokens), for the limits
  };
  // Orders by seq_id (see above); returns the promise or a direct error. A seq_id seen
  // before returns the first request's promise when `op` matches, else FAILED_PRECONDITION
  // (an idempotency conflict, HTTP 400) naming the seq_id.
  //
  // Every op is admitted against the tenant's limits before it is buffered or queued, so
  // ops waiting ahead of a gap count like queued ones: its size (max_tokens_per_request,
  // 403), its queued and buffered ops (max_pending_ops, 429), its buffered tokens
  // (max_buffered_tokens, 429) and its token rate (tokens_per_s, 429).
  // Each gap is timed on its own: the op after a missing seq_id waits at most
  // seq_gap_timeout from its arrival, then the gap is skipped.
  absl::StatusOr<FuturePromise> Sequenced(const tenancy::Tenant& tenant, const std::shared_ptr<Model>& model,
                                          int64_t seq_id, OpIdentity op, Submit submit, Encoder encode);
  void DrainLocked(Model& model) ABSL_EXCLUSIVE_LOCKS_REQUIRED(model.mu);
  // Arms the timer of the gap in front of the first buffered op (when there is one).
  void ArmGapTimer(const std::shared_ptr<Model>& model) ABSL_EXCLUSIVE_LOCKS_REQUIRED(model->mu);
  absl::StatusOr<FuturePromise> ForwardBackwardArgs(const tenancy::Tenant& tenant, const std::string& model_id,
                                                    int64_t seq_id, training::ForwardArgs args, bool forward_only,
                                                    uint64_t fingerprint, absl::Status bad_input = absl::OkStatus());
  void Housekeep();

  // The stack of the base model a sampling call names: create_sampling_session's base_model
  // (empty: the default model), or the model a checkpoint path's run was trained on.
  absl::StatusOr<ModelStack*> SamplingStack(const tenancy::Tenant& tenant, const std::string& base_model,
                                            const std::string& model_path);
  // Queued ops of the tenant over every model's scheduler.
  int64_t QueuedFor(const std::string& tenant) const;

  const TinkerOptions options_;
  ModelSet& served_;  // the base models
  FutureStore& futures_;
  registry::Registry* registry_;
  training::CheckpointStore* checkpoints_;
  tenancy::TokenRateLimiter* rate_limiter_;
  const UrlSigner* signer_ = nullptr;
  absl::Duration url_ttl_ = absl::Hours(1);
  const Clock* url_clock_ = &RealClock();
  absl::Mutex shapes_mu_;
  // Each served model's base weight shapes, by model name, read at its first import.
  std::map<std::string, std::map<std::string, std::vector<int64_t>>> base_shapes_ ABSL_GUARDED_BY(shapes_mu_);
  std::unique_ptr<Worker> blocking_;  // AddAdapter / RemoveAdapter (they wait for the engine)
  std::unique_ptr<Worker> timers_;    // long-poll timeouts, seq gaps, expiry
  // record_stability_info samples, for stable_reinforce; shared with the sample encoders,
  // which may run on a sampler thread after this object is gone (shutdown).
  const std::shared_ptr<StabilityStore> stability_ = std::make_shared<StabilityStore>();

  TraceStore traces_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<Model>> models_ ABSL_GUARDED_BY(mu_);  // by ModelKey
  // Idempotency: key → request id (create_model, sampling sessions, asample).
  absl::flat_hash_map<std::string, std::string> dedupe_ ABSL_GUARDED_BY(mu_);
  // Tinker ops buffered ahead of seq gaps, per tenant: (count, tokens).
  absl::flat_hash_map<std::string, std::pair<int64_t, int64_t>> buffered_ ABSL_GUARDED_BY(mu_);
  // Direct answers that must be idempotent: create_sampling_session (key → the session it
  // made and the reply), kept while that sampling session is open.
  struct DirectAnswer {
    tenancy::Tenant tenant;
    std::string sampling_session_id;
    CreateSamplingSessionResult reply;
  };
  absl::flat_hash_map<std::string, DirectAnswer> direct_dedupe_ ABSL_GUARDED_BY(mu_);
  // Sessions finished with /finish (tenant + "\n" + id, oldest first, at most 4096): their
  // heartbeat answers 410, which stops the SDK's heartbeat loop.
  std::deque<std::string> finished_order_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> finished_ ABSL_GUARDED_BY(mu_);
};

}  // namespace twinkle::tinker
