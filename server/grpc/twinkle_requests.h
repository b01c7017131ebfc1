#pragma once
// What the Twinkle-native services (TrainingService, SamplerService) read the same way from
// a request: its RequestOptions, and how long a WaitFuture-style call may wait.

#include <algorithm>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/message.h"
#include "core/futures/future_store.h"
#include "core/training/types.h"
#include "server/grpc/handler.h"
#include "twinkle/v1/training.pb.h"

namespace twinkle {

// A fingerprint of `request` for idempotency: a hash of its deterministic serialization, so a
// retry of the same request matches and a different body under the same key does not.
// Never 0 (0 means "not given").
inline uint64_t Fingerprint(const google::protobuf::Message& request) {
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream stream(&bytes);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    request.SerializeToCodedStream(&coded);
  }
  return static_cast<uint64_t>(std::hash<std::string_view>{}(bytes)) | 1;
}

// `request`, when given, is fingerprinted for the idempotency key (only when there is one).
inline training::SubmitOptions ToSubmitOptions(grpc::CallbackServerContext* context,
                                               const twinkle::v1::RequestOptions& o,
                                               const google::protobuf::Message* request = nullptr) {
  training::SubmitOptions s;
  s.deadline = ClientDeadline(*context);
  s.seq_id = o.seq_id() > 0 ? o.seq_id() : -1;
  s.idempotency_key = o.idempotency_key();
  if (!s.idempotency_key.empty() && request != nullptr) s.fingerprint = Fingerprint(*request);
  return s;
}

// The longest a WaitFuture-style call waits before answering "not done yet" (done = false):
// the client polls again; a larger timeout_ms is cut to this. The wait holds no thread (see
// HandleWait); the bound keeps a lost client's registration from living for hours.
inline constexpr absl::Duration kMaxFutureWait = absl::Seconds(60);

// How long a WaitFuture-style call waits: its timeout_ms (30 s when unset), at most
// kMaxFutureWait and the client's deadline.
inline absl::Duration WaitTimeout(const grpc::CallbackServerContext& context,
                                  const twinkle::v1::WaitFutureRequest& request) {
  absl::Duration timeout = request.timeout_ms() > 0 ? absl::Milliseconds(request.timeout_ms()) : absl::Seconds(30);
  timeout = std::min(timeout, kMaxFutureWait);
  const absl::Time deadline = ClientDeadline(context);
  if (deadline != absl::InfiniteFuture()) timeout = std::min(timeout, deadline - absl::Now());
  return std::max(timeout, absl::ZeroDuration());
}

}  // namespace twinkle
