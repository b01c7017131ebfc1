#include "core/engine/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace twinkle::engine {
namespace {

using Json = nlohmann::json;

struct DtypeEntry {
  SafetensorsDtype dtype;
  std::string_view name;
  size_t size;
  bool floating;
};
constexpr DtypeEntry kDtypes[] = {
    {SafetensorsDtype::kF64, "F64", 8, true},  {SafetensorsDtype::kF32, "F32", 4, true},
    {SafetensorsDtype::kF16, "F16", 2, true},  {SafetensorsDtype::kBF16, "BF16", 2, true},
    {SafetensorsDtype::kI64, "I64", 8, false}, {SafetensorsDtype::kI32, "I32", 4, false},
    {SafetensorsDtype::kI16, "I16", 2, false}, {SafetensorsDtype::kI8, "I8", 1, false},
    {SafetensorsDtype::kU8, "U8", 1, false},   {SafetensorsDtype::kBool, "BOOL", 1, false},
};

const DtypeEntry& Entry(SafetensorsDtype dtype) {
  for (const DtypeEntry& e : kDtypes) {
    if (e.dtype == dtype) return e;
  }
  return kDtypes[1];  // Unreachable: every enumerator is in the table.
}

// Reads a JSON integer that must be >= 0; false for floats, negatives, bools, etc.
bool ReadNonNegative(const Json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(v.get<int64_t>());
    return true;
  }
  return false;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

class HeaderParser {
 public:
  HeaderParser(std::string_view file, uint64_t data_size) : file_(file), data_size_(data_size) {}

  absl::Status Invalid(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(file_, ": ", what));
  }
  absl::Status TensorInvalid(absl::string_view tensor, absl::string_view what) const {
    return Invalid(absl::StrCat("tensor '", tensor, "': ", what));
  }

  absl::StatusOr<TensorInfo> ParseTensor(const std::string& name, const Json& entry,
                                         uint64_t data_start) const {
    if (!entry.is_object()) {
      return TensorInvalid(name, absl::StrCat("expected an object, got ", entry.type_name()));
    }
    for (const auto& [key, unused] : entry.items()) {
      if (key != "dtype" && key != "shape" && key != "data_offsets") {
        return TensorInvalid(name, absl::StrCat("unknown key '", key, "'"));
      }
    }
    TensorInfo info;
    info.name = name;

    auto dtype_it = entry.find("dtype");
    if (dtype_it == entry.end() || !dtype_it->is_string()) {
      return TensorInvalid(name, "'dtype' missing or not a string");
    }
    const std::string dtype_name = dtype_it->get<std::string>();
    std::optional<SafetensorsDtype> dtype = ParseSafetensorsDtype(dtype_name);
    if (!dtype.has_value()) {
      return TensorInvalid(name, absl::StrCat("unsupported dtype '", dtype_name, "'"));
    }
    info.dtype = *dtype;

    auto shape_it = entry.find("shape");
    if (shape_it == entry.end() || !shape_it->is_array()) {
      return TensorInvalid(name, "'shape' missing or not an array");
    }
    // numel in uint64 with overflow checks; a zero dimension makes any other size legal.
    uint64_t numel = 1;
    bool overflow = false;
    for (const Json& dim : *shape_it) {
      uint64_t d = 0;
      if (!ReadNonNegative(dim, &d) ||
          d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return TensorInvalid(name, absl::StrCat("shape ", shape_it->dump(),
                                                " has an entry that is not a non-negative "
                                                "integer"));
      }
      info.shape.push_back(static_cast<int64_t>(d));
      overflow |= __builtin_mul_overflow(numel, d, &numel);
    }
    if (std::find(info.shape.begin(), info.shape.end(), 0) != info.shape.end()) {
      numel = 0;
      overflow = false;
    }
    uint64_t nbytes = 0;
    overflow |= __builtin_mul_overflow(numel, Entry(info.dtype).size, &nbytes);
    if (overflow || numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return TensorInvalid(
          name, absl::StrCat("shape ", ShapeString(info.shape), " is too large (size overflows)"));
    }

    auto off_it = entry.find("data_offsets");
    uint64_t begin = 0;
    uint64_t end = 0;
    if (off_it == entry.end() || !off_it->is_array() || off_it->size() != 2 ||
        !ReadNonNegative((*off_it)[0], &begin) || !ReadNonNegative((*off_it)[1], &end)) {
      return TensorInvalid(name, "'data_offsets' missing or not two non-negative integers");
    }
    if (begin > end) {
      return TensorInvalid(
          name, absl::StrCat("data_offsets [", begin, ", ", end, "] end before they begin"));
    }
    if (end > data_size_) {
      return absl::DataLossError(absl::StrCat(file_, ": tensor '", name, "': data_offsets [", begin,
                                              ", ", end, "] extend past the data section of ",
                                              data_size_, " bytes (file truncated?)"));
    }
    if (end - begin != nbytes) {
      return TensorInvalid(name, absl::StrCat("shape ", ShapeString(info.shape), " of ", dtype_name,
                                              " needs ", nbytes, " bytes but data_offsets [", begin,
                                              ", ", end, "] span ", end - begin));
    }
    info.data_begin = begin;
    info.data_end = end;
    info.file_offset = data_start + begin;
    return info;
  }

 private:
  std::string file_;
  uint64_t data_size_;
};

}  // namespace

std::string_view SafetensorsDtypeName(SafetensorsDtype dtype) { return Entry(dtype).name; }

std::optional<SafetensorsDtype> ParseSafetensorsDtype(std::string_view name) {
  for (const DtypeEntry& e : kDtypes) {
    if (e.name == name) return e.dtype;
  }
  return std::nullopt;
}

size_t SafetensorsDtypeSize(SafetensorsDtype dtype) { return Entry(dtype).size; }

bool IsFloatingPoint(SafetensorsDtype dtype) { return Entry(dtype).floating; }

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // Validated by the parser not to overflow.
  return n;
}

namespace {

absl::StatusOr<std::vector<TensorInfo>> ParseHeaderImpl(
    absl::Span<const uint8_t> file_bytes, std::string_view name_for_errors,
    std::map<std::string, std::string>* metadata) {
  // absl may be built with its own string_view, which StrCat does not take from std.
  const std::string file(name_for_errors);
  const uint64_t size = file_bytes.size();
  if (size < 8) {
    return absl::DataLossError(absl::StrCat(file, ": truncated: ", size,
                                            " bytes, too short for the 8-byte header length"));
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | file_bytes[i];
  if (header_len > kMaxSafetensorsHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": header length ", header_len,
                                                   " exceeds the limit of ",
                                                   kMaxSafetensorsHeaderBytes, " bytes"));
  }
  if (header_len > size - 8) {
    return absl::DataLossError(absl::StrCat(file, ": header length ", header_len, " exceeds the ",
                                            size - 8,
                                            " bytes after the length field (file truncated?)"));
  }

  // nlohmann keeps the last of duplicate keys silently; two tensors of one name would make
  // the file ambiguous, so the callback rejects them while parsing.
  std::set<std::string> seen;
  std::string duplicate;
  auto callback = [&](int depth, Json::parse_event_t event, Json& parsed) {
    if (event == Json::parse_event_t::key && depth == 1 && duplicate.empty()) {
      if (!seen.insert(parsed.get<std::string>()).second) duplicate = parsed.get<std::string>();
    }
    return true;
  };
  const uint8_t* header_begin = file_bytes.data() + 8;
  Json root;
  try {
    root = Json::parse(header_begin, header_begin + header_len, callback);
  } catch (const Json::exception& e) {
    // The message carries the byte position of the syntax error.
    return absl::InvalidArgumentError(absl::StrCat(file, ": header is not valid JSON: ", e.what()));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": header must be a JSON object, got ", root.type_name()));
  }
  if (!duplicate.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": tensor '", duplicate, "' appears twice in the header"));
  }

  const uint64_t data_start = 8 + header_len;
  HeaderParser parser(file, size - data_start);
  std::vector<TensorInfo> tensors;
  for (const auto& [key, value] : root.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) {
        return parser.Invalid("'__metadata__' must be an object of strings");
      }
      for (const auto& [mkey, mvalue] : value.items()) {
        if (!mvalue.is_string()) {
          return parser.Invalid(absl::StrCat("'__metadata__' entry '", mkey, "' is not a string"));
        }
        if (metadata != nullptr) (*metadata)[mkey] = mvalue.get<std::string>();
      }
      continue;
    }
    absl::StatusOr<TensorInfo> info = parser.ParseTensor(key, value, data_start);
    if (!info.ok()) return info.status();
    tensors.push_back(*std::move(info));
  }

  // Overlapping ranges would let one tensor alias another's bytes; empty tensors own none.
  std::vector<const TensorInfo*> by_offset;
  for (const TensorInfo& t : tensors) {
    if (t.nbytes() > 0) by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return std::pair(a->data_begin, a->data_end) < std::pair(b->data_begin, b->data_end);
  });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const TensorInfo& prev = *by_offset[i - 1];
    const TensorInfo& cur = *by_offset[i];
    if (cur.data_begin < prev.data_end) {
      return absl::InvalidArgumentError(absl::StrCat(
          file, ": tensor '", cur.name, "' data_offsets [", cur.data_begin, ", ", cur.data_end,
          "] overlap tensor '", prev.name, "' [", prev.data_begin, ", ", prev.data_end, "]"));
    }
  }
  std::sort(tensors.begin(), tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });
  return tensors;
}

// Error messages quote tensor names and JSON snippets from an untrusted file; keep them to
// one printable, bounded log line.
absl::Status Printable(const absl::Status& status) {
  constexpr size_t kMaxLength = 1000;
  std::string msg(status.message());
  if (msg.size() > kMaxLength) msg = msg.substr(0, kMaxLength) + "...";
  for (char& c : msg) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) c = '?';
  }
  return absl::Status(status.code(), msg);
}

}  // namespace

absl::StatusOr<std::vector<TensorInfo>> ParseSafetensorsHeader(
    absl::Span<const uint8_t> file_bytes, std::string_view name_for_errors,
    std::map<std::string, std::string>* metadata) {
  absl::StatusOr<std::vector<TensorInfo>> result =
      ParseHeaderImpl(file_bytes, name_for_errors, metadata);
  if (!result.ok()) return Printable(result.status());
  return result;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(
    const std::filesystem::path& path) {
  const std::string name = path.string();
  auto errno_status = [&](absl::string_view op, int err) {
    const std::string msg = absl::StrCat(name, ": ", op, ": ", std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(msg);
    if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
    return absl::InternalError(msg);
  };

  const int fd = ::open(name.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno_status("open", errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return errno_status("fstat", err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(name, ": not a regular file"));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < 8) {
    // mmap rejects length 0; let the parser produce the usual truncation error instead.
    ::close(fd);
    uint8_t small[8] = {};
    return ParseSafetensorsHeader(absl::MakeConstSpan(small, size), name).status();
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int mmap_errno = errno;
  ::close(fd);  // The mapping keeps the file referenced.
  if (map == MAP_FAILED) return errno_status("mmap", mmap_errno);

  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->base_ = static_cast<const uint8_t*>(map);
  file->size_ = size;
  absl::StatusOr<std::vector<TensorInfo>> tensors =
      ParseSafetensorsHeader(absl::MakeConstSpan(file->base_, size), name, &file->metadata_);
  if (!tensors.ok()) return tensors.status();  // ~SafetensorsFile unmaps.
  file->tensors_ = *std::move(tensors);
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (base_ != nullptr) ::munmap(const_cast<uint8_t*>(base_), size_);
}

const TensorInfo* SafetensorsFile::Find(std::string_view name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const TensorInfo& t, std::string_view n) { return t.name < n; });
  if (it == tensors_.end() || it->name != name) return nullptr;
  return &*it;
}

absl::Span<const uint8_t> SafetensorsFile::Data(const TensorInfo& info) const {
  if (info.file_offset > size_ || info.nbytes() > size_ - info.file_offset) return {};
  return absl::MakeConstSpan(base_ + info.file_offset, info.nbytes());
}

}  // namespace twinkle::engine
