#include "server/grpc/handler.h"

#include <chrono>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/common/log.h"
#include "core/tenancy/rate_limiter.h"
#include "server/status_map.h"

namespace twinkle {

absl::Time ClientDeadline(const grpc::CallbackServerContext& context) {
  const auto deadline = context.deadline();
  // gRPC reports "no deadline" as a time far in the future.
  if (deadline >= std::chrono::system_clock::now() + std::chrono::hours(24 * 365)) {
    return absl::InfiniteFuture();
  }
  return absl::FromChrono(deadline);
}

namespace {

// The call's request id: the client's `x-request-id` metadata when it is a valid id, else a
// fresh one.
std::string RequestIdOf(const grpc::CallbackServerContext& context) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("x-request-id");
  if (it != metadata.end()) {
    const absl::string_view id(it->second.data(), it->second.size());
    if (IsValidRequestId(id)) return std::string(id);
  }
  return NewRequestId();
}

// What the access log records of a call besides its status.
struct CallLog {
  std::string request_id;
  std::string tenant;  // empty when the call was not admitted
  const char* method = "";
  absl::Time start;
};

// Finishes `reactor` with `status`; every call's trailers carry its `x-request-id`, and the
// access log gets one line with the same id.
void FinishCallLogged(grpc::CallbackServerContext* context, grpc::ServerUnaryReactor* reactor,
                      const absl::Status& status, const CallLog& log) {
  context->AddTrailingMetadata("x-request-id", log.request_id);
  const std::string outcome = absl::StatusCodeToString(status.code());
  LogRequest(LogLevel::kInfo, "grpc",
             {log.request_id, log.tenant, log.method, outcome,
              log.start == absl::InfinitePast() ? -1.0 : absl::ToDoubleSeconds(absl::Now() - log.start)});
  if (status.ok()) {
    reactor->Finish(grpc::Status::OK);
    return;
  }
  if (std::optional<int64_t> wait = tenancy::RetryAfterSeconds(status)) {
    context->AddTrailingMetadata("retry-after", absl::StrCat(*wait));
  }
  reactor->Finish(ToGrpcStatus(status));
}

}  // namespace

void FinishCall(grpc::CallbackServerContext* context, grpc::ServerUnaryReactor* reactor,
                const absl::Status& status) {
  // Callers outside HandleNow/HandleQueued*: neither the method nor the start is known here.
  FinishCallLogged(context, reactor, status, CallLog{RequestIdOf(*context), "", "", absl::InfinitePast()});
}

namespace {

// The metrics label of a status code: absl's name, built once per code rather than per call.
const std::string& CodeName(absl::StatusCode code) {
  static const auto* names = [] {
    auto* v = new std::vector<std::string>();
    for (int c = 0; c <= static_cast<int>(absl::StatusCode::kUnauthenticated); ++c) {
      v->push_back(absl::StatusCodeToString(static_cast<absl::StatusCode>(c)));
    }
    return v;
  }();
  const auto index = static_cast<size_t>(code);
  if (index < names->size()) return (*names)[index];
  static const std::string* unknown = new std::string();  // what absl names a non-canonical code
  return *unknown;
}

// Draining and authentication, shared by both kinds of handler.
absl::StatusOr<const tenancy::Tenant*> Admit(grpc::CallbackServerContext* context, ServingState& state) {
  if (state.draining.load()) return absl::UnavailableError("server is shutting down");
  return state.authenticator->AuthenticateGrpc(*context);
}

}  // namespace

grpc::ServerUnaryReactor* HandleNow(grpc::CallbackServerContext* context, ServingState& state,
                                    const char* method,
                                    const std::function<absl::Status(const tenancy::Tenant&)>& body) {
  RequestTimer timer(state.metrics, method);
  CallLog log{RequestIdOf(*context), "", method, absl::Now()};
  absl::StatusOr<const tenancy::Tenant*> tenant = Admit(context, state);
  if (tenant.ok()) log.tenant = (*tenant)->id;
  const absl::Status status = tenant.ok() ? body(**tenant) : tenant.status();
  timer.set_code(CodeName(status.code()));
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  FinishCallLogged(context, reactor, status, log);
  return reactor;
}

grpc::ServerUnaryReactor* HandleQueuedAny(
    grpc::CallbackServerContext* context, ServingState& state, const char* method, bool return_future,
    const std::function<absl::StatusOr<uint64_t>(const tenancy::Tenant&)>& submit,
    std::function<void(uint64_t)> set_future_id, std::function<absl::Status(const FutureValue&)> fill) {
  auto timer = std::make_shared<RequestTimer>(state.metrics, method);
  auto log = std::make_shared<CallLog>(CallLog{RequestIdOf(*context), "", method, absl::Now()});
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto finish = [context, reactor, timer, log](const absl::Status& status) {
    timer->set_code(CodeName(status.code()));
    FinishCallLogged(context, reactor, status, *log);
  };
  absl::StatusOr<const tenancy::Tenant*> tenant = Admit(context, state);
  if (tenant.ok()) log->tenant = (*tenant)->id;
  absl::StatusOr<uint64_t> id = tenant.ok() ? submit(**tenant) : absl::StatusOr<uint64_t>(tenant.status());
  if (!id.ok()) {
    finish(id.status());
    return reactor;
  }
  if (return_future) {
    set_future_id(*id);
    finish(absl::OkStatus());
    return reactor;
  }
  absl::Status watched = state.futures->OnComplete(
      *id, (*tenant)->id, [finish, fill = std::move(fill)](const FutureResult& result) {
        finish(result.ok() ? fill(*result) : result.status());
      });
  if (!watched.ok()) finish(watched);
  return reactor;
}

grpc::ServerUnaryReactor* HandleQueued(
    grpc::CallbackServerContext* context, ServingState& state, const char* method, bool return_future,
    const std::function<absl::StatusOr<uint64_t>(const tenancy::Tenant&)>& submit,
    std::function<void(uint64_t)> set_future_id,
    std::function<absl::Status(const training::OpOutput&)> fill) {
  return HandleQueuedAny(context, state, method, return_future, submit, std::move(set_future_id),
                         [fill = std::move(fill)](const FutureValue& result) {
                           const auto* out = std::get_if<training::OpOutput>(&result);
                           if (out == nullptr) return absl::InternalError("the op produced an unexpected result type");
                           return fill(*out);
                         });
}

}  // namespace twinkle
