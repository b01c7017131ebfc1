// The Tinker model id <-> coordinator run id maps and the tinker:// path translation that
// tinker_internal.h declares; pure string functions, shared by every file of TinkerApi.
#include <cstdint>
#include <string>

#include <functional>
#include <string_view>

#include "absl/strings/numbers.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "absl/strings/str_cat.h"
#include "server/tinker/tinker_internal.h"

namespace twinkle::tinker {

absl::Status NoCheckpoints() { return absl::UnimplementedError("checkpoints are not configured"); }
absl::Status NoRegistry() { return absl::UnimplementedError("the run registry is not configured"); }
absl::Status NoSigner() { return absl::UnimplementedError("signed download URLs are not configured"); }

uint64_t FingerprintOf(std::string_view bytes) {
  return static_cast<uint64_t>(std::hash<std::string_view>{}(bytes)) | 1;
}

uint64_t FingerprintOf(const google::protobuf::Message& message) {
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream stream(&bytes);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    message.SerializeToCodedStream(&coded);
  }
  return FingerprintOf(std::string_view(bytes));
}

std::string ModelIdFor(const std::string& session_id, int64_t model_seq_id) {
  return absl::StrCat(session_id, ":train:", model_seq_id);
}

std::string AdapterNameFor(const std::string& session_id, int64_t model_seq_id) {
  return absl::StrCat(session_id, ".t", model_seq_id);
}

std::string RunIdOf(const std::string& model_id) {
  const size_t at = model_id.find(":train:");
  if (at == std::string::npos) return model_id;
  const std::string session = model_id.substr(0, at);
  int64_t seq = 0;
  if (!absl::SimpleAtoi(model_id.substr(at + 7), &seq) || seq < 0) return model_id;
  return absl::StrCat(session, "-", AdapterNameFor(session, seq));
}

std::string ModelIdOf(const std::string& run_id) {
  // "{S}-{S}.t{N}" with both S equal.
  const size_t dot = run_id.rfind(".t");
  if (dot == std::string::npos) return run_id;
  int64_t seq = 0;
  if (!absl::SimpleAtoi(run_id.substr(dot + 2), &seq) || seq < 0) return run_id;
  const std::string head = run_id.substr(0, dot);  // "{S}-{S}"
  if (head.size() % 2 == 0) return run_id;
  const size_t half = head.size() / 2;
  if (head[half] != '-' || head.compare(0, half, head, half + 1, half) != 0) return run_id;
  return ModelIdFor(head.substr(0, half), seq);
}

std::string InternalPath(const std::string& path) {
  const size_t scheme = path.find("://");
  if (scheme == std::string::npos) return path;
  const size_t start = scheme + 3;
  const size_t slash = path.find('/', start);
  const std::string id = path.substr(start, slash == std::string::npos ? std::string::npos : slash - start);
  return absl::StrCat(path.substr(0, start), RunIdOf(id), slash == std::string::npos ? "" : path.substr(slash));
}

std::string TinkerPathOf(const std::string& run_id, const std::string& checkpoint_id) {
  return absl::StrCat("tinker://", ModelIdOf(run_id), "/", checkpoint_id);
}

}  // namespace twinkle::tinker
