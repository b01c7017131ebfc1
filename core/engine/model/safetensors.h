// A reader for the safetensors format, written here rather than pulled in because model
// files come from users: every byte of the header is validated before any tensor is
// touched, and every failure names the file and tensor. No torch here, so the parser can be
// fuzzed and unit-tested on its own.
//
// Format: u64 little-endian header length N, N bytes of JSON object
//   {"__metadata__": {str: str}?, "<name>": {"dtype": "F32", "shape": [..],
//    "data_offsets": [begin, end]}, ...}
// then the data section; offsets are relative to its start.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace twinkle::engine {

enum class SafetensorsDtype {
  kF64,
  kF32,
  kF16,
  kBF16,
  kI64,
  kI32,
  kI16,
  kI8,
  kU8,
  kBool,
};

// "F32" etc. as written in the header.
std::string_view SafetensorsDtypeName(SafetensorsDtype dtype);
std::optional<SafetensorsDtype> ParseSafetensorsDtype(std::string_view name);
size_t SafetensorsDtypeSize(SafetensorsDtype dtype);
bool IsFloatingPoint(SafetensorsDtype dtype);

struct TensorInfo {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  std::vector<int64_t> shape;
  // Byte range within the data section, as in the header's data_offsets.
  uint64_t data_begin = 0;
  uint64_t data_end = 0;
  // Absolute byte offset of the tensor's data in the file (8 + N + data_begin).
  uint64_t file_offset = 0;

  uint64_t nbytes() const { return data_end - data_begin; }
  int64_t numel() const;
};

// Upper bound on the JSON header; real headers are a few hundred KB even for large shards.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100u << 20;

// Validates the header of a whole safetensors file held in `file_bytes` (only the data
// section's size is needed from the rest) and returns its tensors sorted by name. Errors
// name `name_for_errors` and, where one is at fault, the tensor. `metadata`, when given,
// receives the optional __metadata__ map.
absl::StatusOr<std::vector<TensorInfo>> ParseSafetensorsHeader(
    absl::Span<const uint8_t> file_bytes, std::string_view name_for_errors,
    std::map<std::string, std::string>* metadata = nullptr);

// A validated, read-only memory-mapped safetensors file. Tensor bytes stay in the page
// cache until copied, so opening a multi-GB shard costs no heap.
class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::filesystem::path& path);

  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  // Sorted by name.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // nullptr when the file has no tensor of that name.
  const TensorInfo* Find(std::string_view name) const;
  // The tensor's raw little-endian bytes inside the mapping; valid while *this lives.
  // `info` must come from this file's tensors(); anything out of range yields an empty span.
  absl::Span<const uint8_t> Data(const TensorInfo& info) const;

 private:
  SafetensorsFile() = default;

  std::filesystem::path path_;
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace twinkle::engine
