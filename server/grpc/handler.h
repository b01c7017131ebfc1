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
#include "absl/time/time.h"
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
// A wait for a future the caller already has (WaitFuture, WaitSample): the call finishes with
// `fill(value)` when the future completes (at once when it has; its error, or NotFound for
// an unknown or another tenant's id, when it failed), or after `not_done()` when `timeout`
// passes first. No thread is held meanwhile: the completion or state.wait_timers answers.
grpc::ServerUnaryReactor* HandleWait(grpc::CallbackServerContext* context, ServingState& state, const char* method,
                                     uint64_t future_id, absl::Duration timeout,
                                     std::function<absl::Status(const FutureValue&)> fill,
                                     std::function<void()> not_done);

// HandleQueued for ops whose result is not an OpOutput (sampling): `fill` gets the value.
grpc::ServerUnaryReactor* HandleQueuedAny(
    grpc::CallbackServerContext* context, ServingState& state, const char* method, bool return_future,
    const std::function<absl::StatusOr<uint64_t>(const tenancy::Tenant&)>& submit,
    std::function<void(uint64_t)> set_future_id, std::function<absl::Status(const FutureValue&)> fill);

}  // namespace twinkle
