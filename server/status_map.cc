#include "server/status_map.h"

#include <string>

#include "core/futures/future_value.h"
#include "core/scheduler/op.h"

namespace twinkle {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  // absl and gRPC share the canonical code numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

int ToHttpStatus(const absl::Status& status) {
  // A replayed key or seq_id of another op: the caller's mistake, and never retried.
  if (sched::IsIdempotencyConflict(status)) return 400;
  if (IsInterruptedByRestart(status) || IsGone(status)) return 410;
  switch (status.code()) {
    case absl::StatusCode::kOk: return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kCancelled:
      return 400;
    case absl::StatusCode::kUnauthenticated: return 401;
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kFailedPrecondition:
      return 403;
    case absl::StatusCode::kNotFound: return 404;
    case absl::StatusCode::kResourceExhausted: return 429;
    case absl::StatusCode::kUnimplemented: return 501;
    case absl::StatusCode::kUnavailable: return 503;
    case absl::StatusCode::kDeadlineExceeded: return 504;
    default: return 500;
  }
}

}  // namespace twinkle
