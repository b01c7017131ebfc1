#include "core/storage/safetensors_writer.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string_view>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace twinkle::storage {
namespace {

struct DtypeInfo {
  const char* name;
  int rank;       // the safetensors crate's Dtype order; higher is laid out first
  size_t size;    // bytes per element
};

constexpr DtypeInfo kDtypes[] = {
    {"BOOL", 0, 1}, {"U8", 1, 1},  {"I8", 2, 1},  {"I16", 3, 2}, {"F16", 4, 2},
    {"BF16", 5, 2}, {"I32", 6, 4}, {"F32", 7, 4}, {"F64", 8, 8}, {"I64", 9, 8},
};

const DtypeInfo* FindDtype(const std::string& name) {
  for (const DtypeInfo& d : kDtypes) {
    if (name == d.name) return &d;
  }
  return nullptr;
}

bool IsValidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    size_t n;
    uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n >= s.size()) return false;  // truncated sequence
    for (size_t k = 1; k <= n; ++k) {
      unsigned char cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    // Overlong forms, surrogates and values past U+10FFFF are not UTF-8.
    if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) ||
        (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) {
      return false;
    }
    i += n + 1;
  }
  return true;
}

// A JSON string literal as serde_json writes it.
void AppendJsonString(std::string& out, std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  out.push_back('"');
  for (char ch : s) {
    unsigned char c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          out += "\\u00";
          out.push_back(kHex[c >> 4]);
          out.push_back(kHex[c & 0xF]);
        } else {
          out.push_back(ch);
        }
    }
  }
  out.push_back('"');
}

std::string QuoteName(const std::string& name) { return absl::StrCat("'", absl::CHexEscape(name), "'"); }

}  // namespace

absl::StatusOr<SafetensorsLayout> PlanSafetensors(const std::map<std::string, TensorSpec>& tensors,
                                                  const std::map<std::string, std::string>& metadata) {
  struct Entry {
    const std::string* name;
    const TensorSpec* tensor;
    const DtypeInfo* dtype;
    uint64_t nbytes;
  };
  std::vector<Entry> entries;
  entries.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    if (name == "__metadata__") {
      return absl::InvalidArgumentError("tensor name '__metadata__' is reserved for the header's metadata");
    }
    if (!IsValidUtf8(name)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", QuoteName(name), ": name is not valid UTF-8"));
    }
    const DtypeInfo* d = FindDtype(t.dtype);
    if (d == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", QuoteName(name), ": unknown dtype ",
                                                     QuoteName(t.dtype)));
    }
    // numel with overflow checks: the byte count must fit comfortably in uint64.
    uint64_t numel = 1;
    for (int64_t dim : t.shape) {
      if (dim < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", QuoteName(name), ": negative dimension ", dim));
      }
      if (dim != 0 && numel > std::numeric_limits<uint64_t>::max() / 16 / static_cast<uint64_t>(dim)) {
        return absl::InvalidArgumentError(absl::StrCat("tensor ", QuoteName(name), ": shape too large"));
      }
      numel *= static_cast<uint64_t>(dim);
    }
    entries.push_back({&name, &t, d, numel * d->size});
  }
  for (const auto& [k, v] : metadata) {
    if (!IsValidUtf8(k) || !IsValidUtf8(v)) {
      return absl::InvalidArgumentError(absl::StrCat("metadata ", QuoteName(k), ": not valid UTF-8"));
    }
  }
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    if (a.dtype->rank != b.dtype->rank) return a.dtype->rank > b.dtype->rank;
    return *a.name < *b.name;  // std::string compares bytes as unsigned char (char_traits)
  });

  std::string header = "{";
  bool first = true;
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first_kv = true;
    for (const auto& [k, v] : metadata) {
      if (!first_kv) header.push_back(',');
      first_kv = false;
      AppendJsonString(header, k);
      header.push_back(':');
      AppendJsonString(header, v);
    }
    header.push_back('}');
    first = false;
  }
  SafetensorsLayout layout;
  uint64_t offset = 0;
  for (const Entry& e : entries) {
    if (!first) header.push_back(',');
    first = false;
    AppendJsonString(header, *e.name);
    absl::StrAppend(&header, ":{\"dtype\":\"", e.dtype->name, "\",\"shape\":[");
    for (size_t i = 0; i < e.tensor->shape.size(); ++i) {
      if (i > 0) header.push_back(',');
      absl::StrAppend(&header, e.tensor->shape[i]);
    }
    const uint64_t end = offset + e.nbytes;
    absl::StrAppend(&header, "],\"data_offsets\":[", offset, ",", end, "]}");
    layout.order.push_back({*e.name, e.nbytes});
    offset = end;
  }
  header.push_back('}');
  header.append((8 - header.size() % 8) % 8, ' ');

  const uint64_t n = header.size();
  layout.prefix.reserve(8 + n);
  for (int i = 0; i < 8; ++i) layout.prefix.push_back(static_cast<char>((n >> (8 * i)) & 0xFF));
  layout.prefix += header;
  layout.file_size = layout.prefix.size() + offset;
  return layout;
}

absl::StatusOr<std::string> SerializeSafetensors(const std::map<std::string, TensorBytes>& tensors,
                                                 const std::map<std::string, std::string>& metadata) {
  std::map<std::string, TensorSpec> specs;
  for (const auto& [name, t] : tensors) specs.emplace(name, TensorSpec{t.dtype, t.shape});
  absl::StatusOr<SafetensorsLayout> layout = PlanSafetensors(specs, metadata);
  if (!layout.ok()) return layout.status();
  std::string out;
  out.reserve(layout->file_size);
  out += layout->prefix;
  for (const SafetensorsLayout::Slot& slot : layout->order) {
    const TensorBytes& t = tensors.at(slot.name);
    if (t.bytes.size() != slot.nbytes) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", QuoteName(slot.name), ": ", t.bytes.size(),
                                                     " bytes, but ", t.dtype, " with shape [",
                                                     absl::StrJoin(t.shape, ","), "] needs ", slot.nbytes));
    }
    out += t.bytes;
  }
  return out;
}

absl::StatusOr<std::string> SafetensorsDtype(const std::string& ipc_dtype) {
  static constexpr std::pair<const char*, const char*> kMap[] = {
      {"float64", "F64"}, {"float32", "F32"}, {"float16", "F16"}, {"bfloat16", "BF16"},
      {"int64", "I64"},   {"int32", "I32"},   {"int16", "I16"},   {"int8", "I8"},
      {"uint8", "U8"},    {"bool", "BOOL"},
  };
  for (const auto& [ipc, st] : kMap) {
    if (ipc_dtype == ipc) return std::string(st);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("dtype ", QuoteName(ipc_dtype), " has no safetensors equivalent"));
}

}  // namespace twinkle::storage
