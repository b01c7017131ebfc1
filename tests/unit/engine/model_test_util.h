// Helpers for the engine model tests: temp directories and hand-written safetensors files.
// The files are written byte by byte here, independent of the reader under test, so a bug
// in the reader cannot hide behind a matching bug in a shared writer.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace twinkle::engine::testing {

// A fresh directory under the test temp dir, removed with its contents on destruction.
class ScopedTempDir {
 public:
  ScopedTempDir() {
    std::string tmpl = ::testing::TempDir() + "twinkle_model_test_XXXXXX";
    char* made = ::mkdtemp(tmpl.data());
    EXPECT_NE(made, nullptr) << "mkdtemp failed for " << tmpl;
    path_ = tmpl;
  }
  ~ScopedTempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

inline void WriteBytes(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

// 8-byte little-endian length + header + data, exactly as the format lays it out.
inline std::string SafetensorsBytes(const std::string& header, const std::string& data,
                                    uint64_t declared_header_len) {
  std::string out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(declared_header_len >> (8 * i)));
  return out + header + data;
}
inline std::string SafetensorsBytes(const std::string& header, const std::string& data) {
  return SafetensorsBytes(header, data, header.size());
}

template <typename T>
std::string RawBytes(const std::vector<T>& values) {
  std::string out(values.size() * sizeof(T), '\0');
  if (!values.empty()) std::memcpy(out.data(), values.data(), out.size());
  return out;
}

// bf16 is the upper half of an f32; tests use values exactly representable in bf16, so
// truncation is exact.
inline std::string Bf16Bytes(const std::vector<float>& values) {
  std::string out;
  for (float v : values) {
    uint32_t bits = 0;
    std::memcpy(&bits, &v, 4);
    out.push_back(static_cast<char>((bits >> 16) & 0xff));
    out.push_back(static_cast<char>(bits >> 24));
  }
  return out;
}

// Builds a well-formed file tensor by tensor; offsets are assigned contiguously.
class SafetensorsBuilder {
 public:
  SafetensorsBuilder& Add(const std::string& name, const std::string& dtype,
                          std::vector<int64_t> shape, const std::string& bytes) {
    header_[name] = {{"dtype", dtype},
                     {"shape", std::move(shape)},
                     {"data_offsets", {data_.size(), data_.size() + bytes.size()}}};
    data_ += bytes;
    return *this;
  }
  SafetensorsBuilder& AddF32(const std::string& name, std::vector<int64_t> shape,
                             const std::vector<float>& values) {
    return Add(name, "F32", std::move(shape), RawBytes(values));
  }
  SafetensorsBuilder& Metadata(const std::string& key, const std::string& value) {
    header_["__metadata__"][key] = value;
    return *this;
  }
  // Appends spaces so the data section starts at an offset of the given alignment plus
  // `misalign` bytes (the format allows trailing whitespace in the header).
  SafetensorsBuilder& PadHeader(size_t alignment, size_t misalign) {
    alignment_ = alignment;
    misalign_ = misalign;
    return *this;
  }
  std::string Build() const {
    std::string header = header_.is_null() ? std::string("{}") : header_.dump();
    if (alignment_ > 0) {
      while ((8 + header.size()) % alignment_ != misalign_) header.push_back(' ');
    }
    return SafetensorsBytes(header, data_);
  }
  void Write(const std::filesystem::path& path) const { WriteBytes(path, Build()); }

 private:
  nlohmann::json header_;
  std::string data_;
  size_t alignment_ = 0;
  size_t misalign_ = 0;
};

}  // namespace twinkle::engine::testing
