#pragma once
// The one mapping from absl::Status to what each transport reports.

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace twinkle {

grpc::Status ToGrpcStatus(const absl::Status& status);

// HTTP status for an absl code (the Tinker API's conventions: 400, 401, 403, 404, 409, 429,
// 499, 500, 503, 504).
int ToHttpStatus(absl::StatusCode code);

}  // namespace twinkle
