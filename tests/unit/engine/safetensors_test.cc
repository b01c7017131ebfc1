#include "core/engine/model/safetensors.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/engine/model_test_util.h"

namespace twinkle::engine {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using testing::SafetensorsBuilder;
using testing::SafetensorsBytes;
using testing::ScopedTempDir;

absl::Span<const uint8_t> AsSpan(const std::string& s) {
  return absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

// Parses `header` followed by `data` and returns the error (the test expects one).
absl::Status ParseError(const std::string& header, const std::string& data) {
  const std::string bytes = SafetensorsBytes(header, data);
  auto result = ParseSafetensorsHeader(AsSpan(bytes), "bad.safetensors");
  EXPECT_FALSE(result.ok()) << "header unexpectedly accepted: " << header;
  return result.status();
}

TEST(SafetensorsTest, RoundTripsF32ThroughMmap) {
  ScopedTempDir dir;
  const std::vector<float> values = {1.0f, -2.5f, 3.25f, 0.0f, 1e-3f, 42.0f};
  SafetensorsBuilder()
      .AddF32("w", {2, 3}, values)
      .Metadata("format", "pt")
      .Write(dir.path() / "a.safetensors");

  auto file = SafetensorsFile::Open(dir.path() / "a.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ((*file)->tensors().size(), 1u);
  const TensorInfo& info = (*file)->tensors()[0];
  EXPECT_EQ(info.name, "w");
  EXPECT_EQ(info.dtype, SafetensorsDtype::kF32);
  EXPECT_EQ(info.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(info.numel(), 6);
  EXPECT_EQ(info.nbytes(), 24u);
  EXPECT_EQ((*file)->metadata().at("format"), "pt");
  EXPECT_EQ((*file)->Find("w"), &info);
  EXPECT_EQ((*file)->Find("v"), nullptr);

  absl::Span<const uint8_t> data = (*file)->Data(info);
  ASSERT_EQ(data.size(), 24u);
  std::vector<float> read(6);
  std::memcpy(read.data(), data.data(), 24);
  EXPECT_EQ(read, values);
}

TEST(SafetensorsTest, SortsByNameAndKeepsOffsets) {
  const std::string bytes = SafetensorsBuilder()
                                .AddF32("zeta", {1}, {1.0f})
                                .Add("alpha", "BF16", {2}, testing::Bf16Bytes({1.0f, 2.0f}))
                                .Add("mask", "BOOL", {3}, std::string("\1\0\1", 3))
                                .Build();
  auto tensors = ParseSafetensorsHeader(AsSpan(bytes), "x");
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  ASSERT_EQ(tensors->size(), 3u);
  EXPECT_EQ((*tensors)[0].name, "alpha");
  EXPECT_EQ((*tensors)[0].dtype, SafetensorsDtype::kBF16);
  EXPECT_EQ((*tensors)[1].name, "mask");
  EXPECT_EQ((*tensors)[2].name, "zeta");
  // Data is laid out in insertion order: zeta (4 bytes), alpha (4), mask (3).
  EXPECT_EQ((*tensors)[2].file_offset, bytes.size() - 11);
  EXPECT_EQ((*tensors)[0].file_offset, bytes.size() - 7);
  EXPECT_EQ((*tensors)[1].data_begin, 8u);
  EXPECT_EQ((*tensors)[1].data_end, 11u);
}

TEST(SafetensorsTest, AcceptsScalarsEmptyTensorsAndPaddedHeader) {
  const std::string bytes = SafetensorsBuilder()
                                .AddF32("scalar", {}, {7.0f})
                                .AddF32("empty", {0, 5}, {})
                                .PadHeader(8, 0)
                                .Build();
  auto tensors = ParseSafetensorsHeader(AsSpan(bytes), "x");
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  EXPECT_EQ((*tensors)[0].name, "empty");
  EXPECT_EQ((*tensors)[0].numel(), 0);
  EXPECT_EQ((*tensors)[1].numel(), 1);
}

TEST(SafetensorsTest, OpenMissingFileIsNotFound) {
  ScopedTempDir dir;
  auto file = SafetensorsFile::Open(dir.path() / "nope.safetensors");
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(file.status().ToString(), HasSubstr("nope.safetensors"));
}

TEST(SafetensorsTest, TruncatedFileNamesFile) {
  ScopedTempDir dir;
  testing::WriteBytes(dir.path() / "short.safetensors", "abc");
  auto file = SafetensorsFile::Open(dir.path() / "short.safetensors");
  EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(file.status().ToString(),
              AllOf(HasSubstr("short.safetensors"), HasSubstr("truncated")));
}

TEST(SafetensorsTest, EmptyFileIsTruncated) {
  ScopedTempDir dir;
  testing::WriteBytes(dir.path() / "empty.safetensors", "");
  auto file = SafetensorsFile::Open(dir.path() / "empty.safetensors");
  EXPECT_THAT(file.status().ToString(), HasSubstr("truncated"));
}

TEST(SafetensorsTest, HeaderLengthOverLimit) {
  const std::string bytes = SafetensorsBytes("{}", "", uint64_t{200} << 20);
  auto r = ParseSafetensorsHeader(AsSpan(bytes), "big.safetensors");
  EXPECT_THAT(r.status().ToString(),
              AllOf(HasSubstr("big.safetensors"), HasSubstr("exceeds the limit")));
}

TEST(SafetensorsTest, HeaderLengthPastEndOfFile) {
  const std::string bytes = SafetensorsBytes("{}", "", 1000);
  auto r = ParseSafetensorsHeader(AsSpan(bytes), "cut.safetensors");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(r.status().ToString(),
              AllOf(HasSubstr("header length 1000"), HasSubstr("file truncated")));
}

TEST(SafetensorsTest, HeaderLengthHugeValueDoesNotWrap) {
  const std::string bytes = SafetensorsBytes("{}", "", ~uint64_t{0});
  auto r = ParseSafetensorsHeader(AsSpan(bytes), "x");
  EXPECT_THAT(r.status().ToString(), HasSubstr("exceeds the limit"));
}

TEST(SafetensorsTest, NonJsonHeader) {
  EXPECT_THAT(
      ParseError("{\"w\": not json", "").ToString(),
      AllOf(HasSubstr("bad.safetensors"), HasSubstr("not valid JSON"), HasSubstr("column 8")));
}

TEST(SafetensorsTest, HeaderNotAnObject) {
  EXPECT_THAT(ParseError("[1, 2]", "").ToString(), HasSubstr("must be a JSON object"));
}

TEST(SafetensorsTest, UnknownDtypeNamed) {
  const auto s =
      ParseError(R"({"w8": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}})", "ab");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.ToString(), AllOf(HasSubstr("'w8'"), HasSubstr("unsupported dtype 'F8_E4M3'")));
}

TEST(SafetensorsTest, ErrorMessagesArePrintableAndBounded) {
  // Names from the file end up in logs and in error JSON: no control bytes, no invalid UTF-8.
  const auto s =
      ParseError(absl::StrCat(R"({"bad\nname\u00ff": {"dtype": ")", std::string(5000, 'Q'),
                              R"(", "shape": [], "data_offsets": [0, 0]}})"),
                 "");
  EXPECT_THAT(s.ToString(), HasSubstr("bad?name??"));
  EXPECT_LE(s.message().size(), 1003u);
  for (char c : s.message()) {
    EXPECT_TRUE(c >= 0x20 && c < 0x7f) << static_cast<int>(c);
  }
}

TEST(SafetensorsTest, OffsetsPastDataSection) {
  const auto s =
      ParseError(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", "1234");
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.ToString(), AllOf(HasSubstr("'w'"), HasSubstr("extend past the data section")));
}

TEST(SafetensorsTest, OverlappingOffsetsNameBothTensors) {
  const auto s = ParseError(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                            std::string(12, '\0'));
  EXPECT_THAT(s.ToString(), AllOf(HasSubstr("'a'"), HasSubstr("'b'"), HasSubstr("overlap")));
}

TEST(SafetensorsTest, ShapeByteSizeMismatch) {
  const auto s = ParseError(R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})",
                            std::string(8, 'x'));
  EXPECT_THAT(s.ToString(),
              AllOf(HasSubstr("'w'"), HasSubstr("needs 12 bytes"), HasSubstr("span 8")));
}

TEST(SafetensorsTest, OffsetsEndBeforeBegin) {
  const auto s =
      ParseError(R"({"w": {"dtype": "U8", "shape": [0], "data_offsets": [4, 2]}})", "1234");
  EXPECT_THAT(s.ToString(), AllOf(HasSubstr("'w'"), HasSubstr("end before they begin")));
}

TEST(SafetensorsTest, BadShapeEntries) {
  for (const char* shape : {"[-1]", "[2.0]", "[\"2\"]", "[true]", "3"}) {
    const auto s = ParseError(
        absl::StrCat(R"({"w": {"dtype": "U8", "shape": )", shape, R"(, "data_offsets": [0, 2]}})"),
        "12");
    EXPECT_THAT(s.ToString(), AllOf(HasSubstr("'w'"), HasSubstr("shape"))) << shape;
  }
}

TEST(SafetensorsTest, ShapeOverflowRejected) {
  const auto s = ParseError(
      R"({"w": {"dtype": "F64", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})", "");
  EXPECT_THAT(s.ToString(), AllOf(HasSubstr("'w'"), HasSubstr("overflows")));
}

TEST(SafetensorsTest, BadDataOffsets) {
  for (const char* offsets : {"[0]", "[0, 1, 2]", "[-1, 1]", "\"0-1\"", "[0, 1.5]"}) {
    const auto s = ParseError(absl::StrCat(R"({"w": {"dtype": "U8", "shape": [1], )",
                                           R"("data_offsets": )", offsets, "}}"),
                              "1");
    EXPECT_THAT(s.ToString(), AllOf(HasSubstr("'w'"), HasSubstr("data_offsets"))) << offsets;
  }
}

TEST(SafetensorsTest, MissingAndUnknownFields) {
  EXPECT_THAT(ParseError(R"({"w": {"shape": [1], "data_offsets": [0, 1]}})", "1").ToString(),
              AllOf(HasSubstr("'w'"), HasSubstr("'dtype'")));
  EXPECT_THAT(ParseError(R"({"w": {"dtype": "U8", "data_offsets": [0, 1]}})", "1").ToString(),
              AllOf(HasSubstr("'w'"), HasSubstr("'shape'")));
  EXPECT_THAT(
      ParseError(R"({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "x": 1}})", "1")
          .ToString(),
      AllOf(HasSubstr("'w'"), HasSubstr("unknown key 'x'")));
  EXPECT_THAT(ParseError(R"({"w": [1, 2]})", "").ToString(),
              AllOf(HasSubstr("'w'"), HasSubstr("expected an object")));
}

TEST(SafetensorsTest, DuplicateTensorName) {
  const auto s = ParseError(R"({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                                "w": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}})",
                            "12");
  EXPECT_THAT(s.ToString(), AllOf(HasSubstr("'w'"), HasSubstr("appears twice")));
}

TEST(SafetensorsTest, MetadataMustBeStrings) {
  EXPECT_THAT(ParseError(R"({"__metadata__": {"step": 3}})", "").ToString(),
              AllOf(HasSubstr("__metadata__"), HasSubstr("'step'")));
  EXPECT_THAT(ParseError(R"({"__metadata__": "pt"})", "").ToString(), HasSubstr("__metadata__"));
}

TEST(SafetensorsTest, TruncatedDataSectionOnDisk) {
  ScopedTempDir dir;
  std::string bytes = SafetensorsBuilder().AddF32("w", {4}, {1, 2, 3, 4}).Build();
  bytes.resize(bytes.size() - 3);
  testing::WriteBytes(dir.path() / "t.safetensors", bytes);
  auto file = SafetensorsFile::Open(dir.path() / "t.safetensors");
  EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(file.status().ToString(), AllOf(HasSubstr("t.safetensors"), HasSubstr("'w'")));
}

TEST(SafetensorsTest, DtypeTable) {
  for (const char* name : {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL"}) {
    auto dtype = ParseSafetensorsDtype(name);
    ASSERT_TRUE(dtype.has_value()) << name;
    EXPECT_EQ(SafetensorsDtypeName(*dtype), name);
  }
  EXPECT_EQ(SafetensorsDtypeSize(SafetensorsDtype::kBF16), 2u);
  EXPECT_FALSE(ParseSafetensorsDtype("U16").has_value());
  EXPECT_FALSE(IsFloatingPoint(SafetensorsDtype::kI8));
  EXPECT_TRUE(IsFloatingPoint(SafetensorsDtype::kF16));
}

}  // namespace
}  // namespace twinkle::engine
