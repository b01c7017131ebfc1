#pragma once
// What every gRPC handler does around its own work: refuse while draining, authenticate
// the caller to a tenant, time the call into the metrics, map absl::Status onto the wire
// (with `retry-after` trailing metadata for throttled calls), and finish the reactor — at
// once for immediate work, or when a queued op's future completes.

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/futures/future_value.h"
#include "core/tenancy/tenant.h"
#include "core/training/types.h"
#include "server/serving_state.h"

namespace twinkle {

// The client's deadline as an absl::Time (InfiniteFuture when it set none).
absl::Time ClientDeadline(const grpc::CallbackServerContext& context);

// Finishes `reactor` with `status`, adding `retry-after` when the status carries a wait, and
// `x-request-id` (the client's own when valid, else a fresh one) to every call's trailers;
// logs the call's access line with the same id. HandleNow/HandleQueued* finish this way too,
// with the method, tenant and duration in the line.
void FinishCall(grpc::CallbackServerContext* context, grpc::ServerUnaryReactor* reactor,
                const absl::Status& status);

// Immediate work: `body(tenant)` runs on the gRPC thread.
grpc::ServerUnaryReactor* HandleNow(grpc::CallbackServerContext* context, ServingState& state,
                                    const char* method,
                                    const std::function<absl::Status(const tenancy::Tenant&)>& body);

// Queued work: `submit(tenant)` queues an op and returns its future id; the call finishes
// when the op completes, after `fill(result)` wrote the response. With `return_future`, the
// call finishes at once after `set_future_id(id)`.
grpc::ServerUnaryReactor* HandleQueued(
    grpc::CallbackServerContext* context, ServingState& state, const char* method, bool return_future,
    const std::function<absl::StatusOr<uint64_t>(const tenancy::Tenant&)>& submit,
    std::function<void(uint64_t)> set_future_id,
    std::function<absl::Status(const training::OpOutput&)> fill);
// HandleQueued for ops whose result is not an OpOutput (sampling): `fill` gets the value.
grpc::ServerUnaryReactor* HandleQueuedAny(
    grpc::CallbackServerContext* context, ServingState& state, const char* method, bool return_future,
    const std::function<absl::StatusOr<uint64_t>(const tenancy::Tenant&)>& submit,
    std::function<void(uint64_t)> set_future_id, std::function<absl::Status(const FutureValue&)> fill);

}  // namespace twinkle
