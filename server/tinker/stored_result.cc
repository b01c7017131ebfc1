// A finished future's gRPC form (stored_result.h).
#include "server/tinker/stored_result.h"

#include <string>
#include <utility>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"
#include "tinker/v1/tinker_service.pb.h"

namespace twinkle::tinker {

std::string StoredProto(v1::ForwardBackwardOutput output) {
  v1::RetrieveFutureResponse response;
  response.mutable_forward_backward()->Swap(&output);
  return response.SerializeAsString();
}

std::string StoredProto(v1::SampleResponse sample) {
  v1::RetrieveFutureResponse response;
  response.mutable_sample()->Swap(&sample);
  return response.SerializeAsString();
}

std::string StoredProto(const OpResult& result) {
  v1::RetrieveFutureResponse response;
  v1::OpResult* op = response.mutable_op();
  if (result.model_id) op->set_model_id(*result.model_id);
  if (result.path) op->set_path(*result.path);
  if (result.sampling_session_id) op->set_sampling_session_id(*result.sampling_session_id);
  if (result.metrics) op->mutable_metrics()->insert(result.metrics->begin(), result.metrics->end());
  return response.SerializeAsString();
}

namespace {

// The field of RetrieveFutureResponse that `stored` holds (forward_backward, sample or op) and
// where that field's bytes start; 0 when `stored` is not such a message.
int StoredField(absl::string_view stored, size_t* start) {
  if (stored.empty()) return 0;
  // A message with one field set serialises as that field alone: its tag, its length, its
  // bytes. Reading the two varints finds the embedded message without parsing it.
  using google::protobuf::internal::WireFormatLite;
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(stored.data()),
                                            static_cast<int>(stored.size()));
  const uint32_t tag = in.ReadTag();
  const int field = static_cast<int>(WireFormatLite::GetTagFieldNumber(tag));
  if (WireFormatLite::GetTagWireType(tag) != WireFormatLite::WIRETYPE_LENGTH_DELIMITED) return 0;
  if (field != v1::RetrieveFutureResponse::kForwardBackwardFieldNumber &&
      field != v1::RetrieveFutureResponse::kSampleFieldNumber && field != v1::RetrieveFutureResponse::kOpFieldNumber) {
    return 0;  // a bare ForwardBackwardOutput or SampleResponse starts with its field 1
  }
  uint32_t length = 0;
  if (!in.ReadVarint32(&length) || static_cast<size_t>(in.CurrentPosition()) + length != stored.size()) return 0;
  *start = static_cast<size_t>(in.CurrentPosition());
  return field;
}

}  // namespace

bool IsStoredResponse(absl::string_view stored) {
  size_t start = 0;
  return StoredField(stored, &start) != 0;
}

absl::string_view HttpProtoBody(absl::string_view stored) {
  size_t start = 0;
  switch (StoredField(stored, &start)) {
    case 0:
      return stored;  // empty, or stored bare by an earlier server: as it answered
    case v1::RetrieveFutureResponse::kOpFieldNumber:
      return {};
    default:
      return stored.substr(start);
  }
}

}  // namespace twinkle::tinker
