#pragma once
// The one mapping from absl::Status to what each transport reports: gRPC (the codes are
// absl's, unchanged) and HTTP (the Tinker API's conventions, tinker-protocol.md §1.5).

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace twinkle {

grpc::Status ToGrpcStatus(const absl::Status& status);

// The HTTP status of an error: bad input 400 (also a replayed idempotency key of another op
// or body, and a cancelled call: never retried), auth 401, lasting limits 403, unknown 404,
// an op interrupted by a restart or a finished session 410 (the Tinker SDK resubmits the
// one, stops heartbeating the other), transient limits 429,
// 5xx for conditions that clear. Never 409 (the SDK would retry a conflict for ever).
int ToHttpStatus(const absl::Status& status);

}  // namespace twinkle
