#pragma once
// A finished Tinker future's gRPC form. Both encodings of an op's result are made when the op
// completes (they are what the future keeps and the journal stores, as EncodedResult): the
// HTTP API's JSON (tinker_codec.h) and this, a serialised tinker.v1.RetrieveFutureResponse
// with the result set, which TinkerService answers as it is. The HTTP API's protobuf answers
// (forward_backward, sample) are sliced out of it.

#include <string>

#include "absl/strings/string_view.h"
#include "server/tinker/tinker_requests.h"
#include "tinker/v1/tinker_public.pb.h"

namespace twinkle::tinker {

namespace v1 = ::tinker::v1;  // the generated wire messages

std::string StoredProto(v1::ForwardBackwardOutput output);
std::string StoredProto(v1::SampleResponse response);
std::string StoredProto(const OpResult& result);

// Whether `stored` is a RetrieveFutureResponse as StoredProto writes it (not empty, not a
// result stored bare by an earlier server).
bool IsStoredResponse(absl::string_view stored);

// The HTTP API's protobuf body (Accept: application/x-protobuf) of a stored result: the
// ForwardBackwardOutput or SampleResponse inside it, sliced out without parsing; "" for an op
// result (its answer is JSON) or none. Servers before this encoding stored those two messages
// bare: such a result is returned whole, as they answered it.
absl::string_view HttpProtoBody(absl::string_view stored);

}  // namespace twinkle::tinker
