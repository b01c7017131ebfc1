#include "server/tinker/http_routes.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "core/tenancy/rate_limiter.h"
#include "core/common/log.h"
#include "server/auth/audit.h"
#include "server/auth/jwt.h"
#include "server/auth/roles.h"
#include "server/tinker/stored_result.h"
#include "server/tinker/tinker_codec.h"
#include "server/tinker/tinker_json.h"

namespace twinkle::tinker {
namespace {

constexpr char kApi[] = "/api/v1";

std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

}  // namespace

HttpResponse JsonResponse(const Json& j, int status) { return {status, "application/json", Dump(j)}; }

// Every error has a JSON body with an explicit length (the SDK treats an empty 400 as a
// proxy failure and retries it) and says whether a retry can help.
HttpResponse ErrorResponse(const absl::Status& status) {
  const int code = HttpStatusFor(status);
  HttpResponse r = JsonResponse({{"detail", std::string(status.message())},
                                 {"code", absl::StatusCodeToString(status.code())},
                                 {"category", ErrorCategory(status)}},
                                code);
  // RFC 6750: a rejected token (expired, revoked key) tells the SDK to fetch a new one.
  if (IsInvalidToken(status)) r.headers.emplace_back("WWW-Authenticate", "Bearer error=\"invalid_token\"");
  const bool retry = code == 429 || code == 503 || code == 504;
  r.headers.emplace_back("x-should-retry", retry ? "true" : "false");
  if (code == 429) {
    const int64_t wait = tenancy::RetryAfterSeconds(status).value_or(1);
    r.headers.emplace_back("Retry-After", absl::StrCat(std::max<int64_t>(wait, 1)));
  }
  return r;
}

namespace {

HttpResponse Answer(const absl::StatusOr<Json>& result) {
  return result.ok() ? JsonResponse(*result) : ErrorResponse(result.status());
}

// A typed result as the SDK's JSON.
template <typename T>
absl::StatusOr<Json> Encoded(absl::StatusOr<T> result) {
  if (!result.ok()) return result.status();
  return ToJson(*result);
}

using JsonCall = std::function<absl::StatusOr<Json>(const tenancy::Tenant&, const Json&)>;

// A JSON-bodied call of a typed operation: the body decoded by `decode`, handed to `call`
// (a generic lambda naming the TinkerApi method), its result encoded.
template <typename Decode, typename Call>
JsonCall Codec(Decode decode, Call call) {
  return [decode, call](const tenancy::Tenant& t, const Json& body) -> absl::StatusOr<Json> {
    auto request = decode(body);
    if (!request.ok()) return request.status();
    return Encoded(call(t, *request));
  };
}

absl::StatusOr<Json> ParseBody(const HttpRequest& request) { return ParseJsonBody(request.body); }

int32_t QueryInt(const HttpRequest& request, const char* name, int32_t fallback) {
  std::optional<std::string> v = request.QueryParam(name);
  int32_t parsed = 0;
  if (v && absl::SimpleAtoi(*v, &parsed) && parsed >= 0) return parsed;
  return fallback;
}

// What every handler needs; shared by the handlers, so it lives as long as the server.
struct Context {
  TinkerApi& api;
  ServingState& state;
  // The caller's tenant, or the error to answer instead.
  absl::StatusOr<const tenancy::Tenant*> Admit(const HttpRequest& request) const {
    if (state.draining.load()) return absl::UnavailableError("server is shutting down");
    return state.authenticator->AuthenticateHttp(request.headers);
  }
};

// training_runs/<model_id>/checkpoints/<kind>/<name>/<action>
struct CheckpointAction {
  std::string model_id;
  std::string checkpoint_id;  // <kind>/<name>
  std::string action;
};
std::optional<CheckpointAction> ParseCheckpointAction(const std::string& tail) {
  std::vector<std::string> parts = absl::StrSplit(tail, '/');
  if (parts.size() != 5 || parts[1] != "checkpoints") return std::nullopt;
  return CheckpointAction{parts[0], absl::StrCat(parts[2], "/", parts[3]), parts[4]};
}

// A checkpoint state change that succeeded gets its audit row (server/auth/audit.h): who, the
// action, the tinker:// path, from where. A row that cannot be written is logged; the change
// stands (it has happened).
absl::StatusOr<Json> Audited(const Context& ctx, const tenancy::Tenant& who, const HttpRequest& request,
                             absl::string_view action, absl::string_view object, absl::StatusOr<Json> result) {
  if (!result.ok() || ctx.state.registry == nullptr) return result;
  if (absl::Status s = Audit(*ctx.state.registry, who, action, object, request.peer); !s.ok()) {
    LogWarning("tinker", absl::StrCat("audit row for ", action, " not written: ", s.message()));
  }
  return result;
}

std::string CheckpointPath(const std::string& model_id, const std::string& checkpoint_id) {
  return absl::StrCat("tinker://", model_id, "/", checkpoint_id);
}

// What an audited JSON call acted on: the path it answered, else the one it named.
std::string AuditObjectOf(const Json& body, const absl::StatusOr<Json>& answer) {
  if (answer.ok()) {
    for (const char* key : {"tinker_path", "path"}) {
      if (answer->contains(key) && (*answer)[key].is_string()) return (*answer)[key].get<std::string>();
    }
  }
  auto text = [&body](const char* key) {
    return body.contains(key) && body[key].is_string() ? body[key].get<std::string>() : std::string();
  };
  if (!text("model_id").empty()) return absl::StrCat("tinker://", text("model_id"), "/external_weights/", text("path"));
  return absl::StrCat("import:", text("name"));
}

// The URL scheme and host the caller reached us by, for the signed download URLs.
std::string BaseUrl(const HttpRequest& r, const ServingState& state) {
  const std::string* host = r.Header("host");
  const bool tls = !state.config.server.tls.cert_file.empty();
  return absl::StrCat(tls ? "https://" : "http://", host != nullptr ? *host : std::string("localhost"));
}

class Routes {
 public:
  Routes(HttpServer& http, TinkerApi& api, ServingState& state)
      : http_(http), api_(api), ctx_(std::make_shared<Context>(Context{api, state})) {}

  // A JSON-bodied call answered at once; with `audit_action`, a success gets its audit row.
  void Post(const char* path, JsonCall fn, const char* audit_action = nullptr) {
    PostWithRequest(
        path, [fn = std::move(fn)](const tenancy::Tenant& t, const Json& b, const HttpRequest&) { return fn(t, b); },
        audit_action);
  }
  // The same, for a call that also reads the request's headers.
  void PostWithRequest(const char* path,
                       std::function<absl::StatusOr<Json>(const tenancy::Tenant&, const Json&, const HttpRequest&)> fn,
                       const char* audit_action = nullptr) {
    http_.Route("POST", absl::StrCat(kApi, path),
                [ctx = ctx_, fn = std::move(fn), audit_action](const HttpRequest& request) {
      absl::StatusOr<const tenancy::Tenant*> tenant = ctx->Admit(request);
      if (!tenant.ok()) return ErrorResponse(tenant.status());
      absl::StatusOr<Json> body = ParseBody(request);
      if (!body.ok()) return ErrorResponse(body.status());
      const absl::Time start = absl::Now();
      absl::StatusOr<Json> answer = fn(**tenant, *body, request);
      if (audit_action != nullptr) {
        const std::string object = AuditObjectOf(*body, answer);  // before `answer` is moved
        answer = Audited(*ctx, **tenant, request, audit_action, object, std::move(answer));
      }
      HttpResponse response = Answer(std::move(answer));
      ctx->api.traces().Record((*tenant)->id, ctx->api.TraceSessionOf(**tenant, *body),
                               {request.method + " " + request.path, start, absl::Now() - start,
                                static_cast<int64_t>(request.body.size()),
                                static_cast<int64_t>(response.body.size()), response.status});
      return response;
    });
  }

  void Get(const char* path, std::function<absl::StatusOr<Json>(const tenancy::Tenant&, const HttpRequest&)> fn) {
    http_.Route("GET", absl::StrCat(kApi, path), [ctx = ctx_, fn = std::move(fn)](const HttpRequest& request) {
      absl::StatusOr<const tenancy::Tenant*> tenant = ctx->Admit(request);
      if (!tenant.ok()) return ErrorResponse(tenant.status());
      return Answer(fn(**tenant, request));
    });
  }

  void Prefix(const char* method, const char* prefix,
              std::function<absl::StatusOr<Json>(const tenancy::Tenant&, const HttpRequest&)> fn) {
    http_.RoutePrefix(method, absl::StrCat(kApi, prefix),
                      [ctx = ctx_, fn = std::move(fn)](const HttpRequest& request, HttpResponder respond) {
                        absl::StatusOr<const tenancy::Tenant*> tenant = ctx->Admit(request);
                        if (!tenant.ok()) return respond(ErrorResponse(tenant.status()));
                        respond(Answer(fn(**tenant, request)));
                      });
  }

  void AddAll() {
    TinkerApi& api = api_;
    // Configuration and sessions.
    Post("/client/config", [&api](const tenancy::Tenant&, const Json&) { return api.ClientConfig(); });
    Post("/client/dynamic_config", [&api](const tenancy::Tenant&, const Json&) { return api.DynamicConfig(); });
    Post("/create_session", Codec(DecodeCreateSession, [&api](auto& t, auto& r) { return api.CreateSession(t, r); }));
    Post("/session_heartbeat",
         Codec(DecodeSessionHeartbeat, [&api](auto& t, auto& r) { return api.SessionHeartbeat(t, r); }));
    // Telemetry is accepted and dropped, with or without a valid key: the SDK retries a
    // refused post every second for ever.
    http_.Route("POST", absl::StrCat(kApi, "/telemetry"), [&api](const HttpRequest&) {
      return JsonResponse(api.Telemetry(Json::object()));
    });
    Get("/get_server_capabilities", [&api](const tenancy::Tenant&, const HttpRequest&) -> absl::StatusOr<Json> {
      return ToJson(api.GetServerCapabilities());
    });
    http_.RouteInline("GET", absl::StrCat(kApi, "/healthz"), [](const HttpRequest&) {
      return JsonResponse({{"status", "ok"}});
    });
    Prefix("POST", "/sessions/", [&api](const tenancy::Tenant& t, const HttpRequest& r) -> absl::StatusOr<Json> {
      std::vector<std::string> parts = absl::StrSplit(r.path_tail, '/');
      if (parts.size() != 2 || parts[1] != "finish") {
        return absl::NotFoundError(absl::StrCat("no route POST /api/v1/sessions/", r.path_tail));
      }
      return api.FinishSession(t, parts[0]);
    });
    Get("/sessions", [&api](const tenancy::Tenant& t, const HttpRequest& r) {
      return api.ListSessions(t, QueryInt(r, "limit", 20), QueryInt(r, "offset", 0));
    });
    // sessions/{id} and sessions/{id}/trace_export (PUT sessions/{id}/project is
    // admin_routes.cc's); an unknown tail is 404, never another session's answer.
    Prefix("GET", "/sessions/", [&api](const tenancy::Tenant& t, const HttpRequest& r) -> absl::StatusOr<Json> {
      std::vector<std::string> parts = absl::StrSplit(r.path_tail, '/');
      if (parts.size() == 2 && parts[1] == "trace_export") return api.TraceExport(t, parts[0]);
      if (parts.size() != 1 || parts[0].empty()) {
        return absl::NotFoundError(absl::StrCat("no route GET /api/v1/sessions/", r.path_tail));
      }
      return api.GetSession(t, parts[0]);
    });

    // Training.
    Post("/create_model", Codec(DecodeCreateModel, [&api](auto& t, auto& r) { return api.CreateModel(t, r); }));
    Post("/get_info", Codec(DecodeModelRequest, [&api](auto& t, auto& r) { return api.GetInfo(t, r); }));
    Post("/unload_model", Codec(DecodeModelRequest, [&api](auto& t, auto& r) { return api.UnloadModel(t, r); }));
    http_.Route("POST", absl::StrCat(kApi, "/forward_backward"), [ctx = ctx_](const HttpRequest& request) {
      absl::StatusOr<const tenancy::Tenant*> tenant = ctx->Admit(request);
      if (!tenant.ok()) return ErrorResponse(tenant.status());
      if (const std::string* enc = request.Header("content-encoding"); enc != nullptr && !enc->empty() && *enc != "identity") {
        return ErrorResponse(absl::InvalidArgumentError(absl::StrCat("Content-Encoding '", *enc, "' is not supported")));
      }
      const std::string* type = request.Header("content-type");
      if (type != nullptr && absl::StrContains(*type, "json")) {
        absl::StatusOr<Json> body = ParseBody(request);
        if (!body.ok()) return ErrorResponse(body.status());
        return Answer(Encoded(ctx->api.ForwardBackwardJson(**tenant, *body, false)));
      }
      v1::ForwardBackwardRequest proto;
      if (!proto.ParseFromString(request.body)) {
        return ErrorResponse(absl::InvalidArgumentError("body: not a ForwardBackwardRequest protobuf"));
      }
      const absl::Time start = absl::Now();
      HttpResponse response = Answer(Encoded(ctx->api.ForwardBackward(**tenant, proto)));
      ctx->api.traces().Record((*tenant)->id, ctx->api.TraceSessionOf(**tenant, Json{{"model_id", proto.model_id()}}),
                               {request.method + " " + request.path, start, absl::Now() - start,
                                static_cast<int64_t>(request.body.size()),
                                static_cast<int64_t>(response.body.size()), response.status});
      return response;
    });
    Post("/forward", [&api](const tenancy::Tenant& t, const Json& b) {
      return Encoded(api.ForwardBackwardJson(t, b, true));
    });
    Post("/optim_step", Codec(DecodeOptimStep, [&api](auto& t, auto& r) { return api.OptimStep(t, r); }));
    Post("/save_weights", Codec(DecodeSaveWeights, [&api](auto& t, auto& r) { return api.SaveWeights(t, r); }));
    Post("/load_weights", Codec(DecodeLoadWeights, [&api](auto& t, auto& r) { return api.LoadWeights(t, r); }));
    Post("/save_weights_for_sampler",
         Codec(DecodeSaveWeightsForSampler, [&api](auto& t, auto& r) { return api.SaveWeightsForSampler(t, r); }));
    Post("/weights_info", Codec(DecodeWeightsInfo, [&api](auto& t, auto& r) { return api.WeightsInfo(t, r); }));

    // Sampling.
    Post("/create_sampling_session",
         Codec(DecodeCreateSamplingSession, [&api](auto& t, auto& r) { return api.CreateSamplingSession(t, r); }));
    Post("/asample", Codec(DecodeSample, [&api](auto& t, auto& r) { return api.Sample(t, r); }));
    Prefix("GET", "/samplers/", [&api](const tenancy::Tenant& t, const HttpRequest& r) {
      return api.GetSampler(t, r.path_tail);
    });

    // Futures: the long-poll answers from a completion callback or a timer, holding no thread.
    http_.RouteAsync("POST", absl::StrCat(kApi, "/retrieve_future"), [ctx = ctx_](const HttpRequest& request,
                                                                           HttpResponder respond) {
      absl::StatusOr<const tenancy::Tenant*> tenant = ctx->Admit(request);
      if (!tenant.ok()) return respond(ErrorResponse(tenant.status()));
      absl::StatusOr<Json> body = ParseBody(request);
      if (!body.ok()) return respond(ErrorResponse(body.status()));
      absl::StatusOr<RetrieveFutureRequest> decoded = DecodeRetrieveFuture(*body);
      if (!decoded.ok()) return respond(ErrorResponse(decoded.status()));
      const std::string* accept = request.Header("accept");
      const bool proto = accept != nullptr && absl::StrContains(*accept, "application/x-protobuf");
      ctx->api.RetrieveFuture(**tenant, *decoded, [respond, proto](absl::StatusOr<Poll> poll) {
        if (!poll.ok()) return respond(ErrorResponse(poll.status()));
        if (!poll->done) {
          return respond(JsonResponse(
              {{"type", "try_again"}, {"request_id", poll->request_id}, {"queue_state", poll->queue_state}}));
        }
        if (!poll->error.ok()) return respond(JsonResponse(FailureJson(poll->error)));
        // The answer as stored at completion: its protobuf body when asked for and it has one
        // (forward_backward, sample), else its JSON text.
        if (absl::string_view bytes = HttpProtoBody(poll->result.proto); proto && !bytes.empty()) {
          return respond(HttpResponse{200, "application/x-protobuf", std::string(bytes)});
        }
        respond(HttpResponse{200, "application/json", std::move(poll->result.json)});
      });
    });

    // REST.
    Get("/training_runs", [&api](const tenancy::Tenant& t, const HttpRequest& r) {
      return Encoded(api.ListTrainingRuns(t, ListTrainingRunsRequest{QueryInt(r, "limit", 20), QueryInt(r, "offset", 0),
                                                                     r.QueryParam("access_scope").value_or("")}));
    });
    Get("/checkpoints", [&api](const tenancy::Tenant& t, const HttpRequest& r) {
      return api.ListUserCheckpointsScoped(t, QueryInt(r, "limit", 100), QueryInt(r, "offset", 0),
                                           r.QueryParam("access_scope").value_or(""));
    });
    AddCheckpointRoutes();
    // training_runs/{id}, training_runs/{id}/checkpoints, .../checkpoints/{checkpoint_id},
    // where checkpoint ids contain a slash (weights/<name>).
    Prefix("GET", "/training_runs/", [&api, ctx = ctx_](const tenancy::Tenant& t, const HttpRequest& r) -> absl::StatusOr<Json> {
      const std::string& tail = r.path_tail;
      const size_t slash = tail.find('/');
      const std::string run = tail.substr(0, slash);
      const std::string scope = r.QueryParam("access_scope").value_or("");
      if (slash == std::string::npos) return api.GetTrainingRunScoped(t, run, scope);
      const std::string rest = tail.substr(slash + 1);
      if (rest == "checkpoints") return Encoded(api.ListCheckpoints(t, ListCheckpointsRequest{run, scope}));
      if (std::optional<CheckpointAction> a = ParseCheckpointAction(tail); a && a->action == "external_weights_urls") {
        return api.ExternalWeightsUrls(t, a->model_id, a->checkpoint_id, BaseUrl(r, ctx->state));
      }
      if (std::optional<CheckpointAction> a = ParseCheckpointAction(tail); a && a->action == "archive") {
        return api.ArchiveUrl(t, a->model_id, a->checkpoint_id, BaseUrl(r, ctx->state));
      }
      return absl::NotFoundError(absl::StrCat("no route GET /api/v1/training_runs/", tail));
    });
    Prefix("DELETE", "/training_runs/", [&api, ctx = ctx_](const tenancy::Tenant& t,
                                                         const HttpRequest& r) -> absl::StatusOr<Json> {
      const std::string& tail = r.path_tail;
      const size_t slash = tail.find('/');
      if (std::optional<CheckpointAction> a = ParseCheckpointAction(tail); a && a->action == "publish") {
        return Audited(*ctx, t, r, "checkpoint_unpublish", CheckpointPath(a->model_id, a->checkpoint_id),
                       api.PublishCheckpoint(t, a->model_id, a->checkpoint_id, false));
      }
      constexpr absl::string_view kCheckpoints = "checkpoints/";
      if (slash == std::string::npos || !absl::StartsWith(absl::string_view(tail).substr(slash + 1), kCheckpoints)) {
        return absl::NotFoundError(absl::StrCat("no route DELETE /api/v1/training_runs/", tail));
      }
      const std::string run = tail.substr(0, slash), checkpoint = tail.substr(slash + 1 + kCheckpoints.size());
      return Audited(*ctx, t, r, "checkpoint_delete", CheckpointPath(run, checkpoint),
                     Encoded(api.DeleteCheckpoint(t, DeleteCheckpointRequest{run, checkpoint})));
    });
  }

 private:

  // Retention, export and sharing (tinker_checkpoints.cc; docs/api.md).
  void AddCheckpointRoutes() {
    TinkerApi& api = api_;
    Post("/save_weights_external",
         [&api](const tenancy::Tenant& t, const Json& b) { return api.SaveWeightsExternal(t, b); }, "checkpoint_export");
    // Deduplicated by the SDK's X-Idempotency-Key (the same across its retries of one call):
    // only the call that copied gets the audit row, never its replays.
    PostWithRequest("/copy_weights", [&api, ctx = ctx_](const tenancy::Tenant& t, const Json& b,
                                                        const HttpRequest& r) -> absl::StatusOr<Json> {
      const std::string* key = r.Header("x-idempotency-key");
      bool replayed = false;
      absl::StatusOr<Json> answer = api.CopyWeights(t, b, key != nullptr ? *key : std::string(), &replayed);
      if (replayed) return answer;
      const std::string object = AuditObjectOf(b, answer);
      return Audited(*ctx, t, r, "checkpoint_copy", object, std::move(answer));
    });
    Post("/twinkle/import_adapter", [&api](const tenancy::Tenant& t, const Json& b) { return api.ImportAdapter(t, b); },
         "checkpoint_import");
    // The import's body is bounded before it is read (storage.max_import_bytes). A caller
    // without a valid key is left to the key check (401), learning nothing of the limit; the
    // lookup here counts no auth failure (the key check does).
    http_.AddHeaderCheck([ctx = ctx_](const HttpRequest& head) -> std::optional<HttpResponse> {
      if (head.path != absl::StrCat(kApi, "/twinkle/import_adapter")) return std::nullopt;
      if (!ctx->state.authenticator->Identify(head.headers).ok()) return std::nullopt;
      const int64_t max = ctx->state.config.storage.max_import_bytes;
      const std::string* length = head.Header("content-length");
      int64_t n = 0;
      if (length == nullptr || !absl::SimpleAtoi(*length, &n)) {
        return ErrorResponse(absl::InvalidArgumentError("import_adapter: a Content-Length is required"));
      }
      if (n > max) {
        return ErrorResponse(absl::InvalidArgumentError(absl::StrCat(
            "import_adapter: the body is ", n, " bytes, over storage.max_import_bytes (", max, ")")));
      }
      return std::nullopt;
    });
    Prefix("POST", "/training_runs/", [&api, ctx = ctx_](const tenancy::Tenant& t,
                                                       const HttpRequest& r) -> absl::StatusOr<Json> {
      if (std::optional<CheckpointAction> a = ParseCheckpointAction(r.path_tail); a && a->action == "publish") {
        return Audited(*ctx, t, r, "checkpoint_publish", CheckpointPath(a->model_id, a->checkpoint_id),
                       api.PublishCheckpoint(t, a->model_id, a->checkpoint_id, true));
      }
      return absl::NotFoundError(absl::StrCat("no route POST /api/v1/training_runs/", r.path_tail));
    });
    Prefix("PUT", "/training_runs/", [&api, ctx = ctx_](const tenancy::Tenant& t,
                                                      const HttpRequest& r) -> absl::StatusOr<Json> {
      std::optional<CheckpointAction> a = ParseCheckpointAction(r.path_tail);
      if (!a || a->action != "ttl") {
        return absl::NotFoundError(absl::StrCat("no route PUT /api/v1/training_runs/", r.path_tail));
      }
      absl::StatusOr<Json> body = ParseBody(r);
      if (!body.ok()) return body.status();
      return Audited(*ctx, t, r, "checkpoint_ttl_set", CheckpointPath(a->model_id, a->checkpoint_id),
                     api.SetCheckpointTtl(t, a->model_id, a->checkpoint_id, *body));
    });
    // Downloads: outside /api/v1 (no API key; the URL's signature is the credential). The
    // signature, the access and the file list are checked here; the bytes are streamed by the
    // HTTP server's producer (HttpBodySource: Content-Length known up front, 1 MiB chunks read
    // as the client takes them, each file checked against its size and SHA-256 as it goes by,
    // the connection aborted short of its length when a check fails).
    http_.RoutePrefix("GET", "/twinkle/weights/", [&api](const HttpRequest& r, HttpResponder respond) {
      absl::StatusOr<TinkerApi::WeightsFile> file = api.ServeWeightsFile(
          r.path_tail, r.QueryParam("expires").value_or(""), r.QueryParam("sig").value_or(""));
      if (!file.ok()) return respond(ErrorResponse(file.status()));
      HttpResponse out{200, "application/octet-stream", std::string(),
                       {{"X-Checksum-SHA256", file->sha256}, {"Cache-Control", "no-store"}}};
      if (file->sha256.size() == 64) {  // lower-case hex of the 32-byte digest
        const std::string raw = absl::HexStringToBytes(file->sha256);
        out.headers.emplace_back("Repr-Digest", absl::StrCat("sha-256=:", absl::Base64Escape(raw), ":"));
      }
      out.body_source = HttpBodySource{
          file->size, [stream = std::move(file->stream), expected = file->sha256](const HttpBodySink& sink) {
            absl::StatusOr<std::string> sha = stream(sink);
            if (!sha.ok()) return sha.status();
            if (*sha != expected) {
              return absl::DataLossError("the download changed while it was read (checksum differs); retry");
            }
            return absl::OkStatus();
          }};
      respond(std::move(out));
    });
  }

  HttpServer& http_;
  TinkerApi& api_;
  std::shared_ptr<Context> ctx_;
};

}  // namespace

void AddTinkerRoutes(HttpServer& http, TinkerApi& api, ServingState& state) {
  Routes(http, api, state).AddAll();
  // Every /api/v1 route but the open ones checks the key from the header, before the body is
  // read: a caller without a valid key cannot make the server read and hold a large body.
  // The handlers check again (Admit), which also covers draining.
  http.AddHeaderCheck([&state](const HttpRequest& head) -> std::optional<HttpResponse> {
    static const absl::flat_hash_set<std::string> kOpen = {
        absl::StrCat(kApi, "/telemetry"), absl::StrCat(kApi, "/healthz"), absl::StrCat(kApi, "/twinkle/endpoints")};
    if (!absl::StartsWith(head.path, absl::StrCat(kApi, "/")) || kOpen.contains(head.path)) return std::nullopt;
    absl::StatusOr<const tenancy::Tenant*> tenant = state.authenticator->AuthenticateHttp(head.headers);
    if (!tenant.ok()) return ErrorResponse(tenant.status());
    if (absl::Status s = CheckHttpRole(**tenant, head.method, head.path); !s.ok()) return ErrorResponse(s);
    return std::nullopt;
  });
}

}  // namespace twinkle::tinker
