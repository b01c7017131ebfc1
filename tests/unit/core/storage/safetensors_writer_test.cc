#include "core/storage/safetensors_writer.h"

#include <cstring>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/escaping.h"
#include "core/engine/model/safetensors.h"
#include "core/storage/filesystem.h"
#include "tests/unit/core/storage/temp_dir.h"

namespace twinkle::storage {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

template <typename T>
std::string Raw(std::initializer_list<T> values) {
  std::string out;
  for (T v : values) out.append(reinterpret_cast<const char*>(&v), sizeof(T));  // little-endian host
  return out;
}

std::map<std::string, TensorBytes> MixedTensors() {
  return {
      {"w", {"F32", {2, 3}, Raw<float>({0, 1, 2, 3, 4, 5})}},
      {"idx", {"I64", {2}, Raw<int64_t>({7, -1})}},
      {"m", {"BOOL", {3}, std::string("\x01\x00\x01", 3)}},
      {"h", {"F16", {1}, std::string("\x00\x3e", 2)}},  // 1.5
      {"s", {"I32", {}, Raw<int32_t>({3})}},
      {"e", {"F64", {2, 0}, ""}},
      {"b", {"U8", {2}, std::string("\xff\x01", 2)}},
  };
}

// Produced by Python safetensors 0.8.0 (safetensors.numpy.save) from the same tensors and
// metadata={"format": "pt"}.
constexpr char kMixedGolden[] =
    "a8010000000000007b225f5f6d657461646174615f5f223a7b22666f726d6174223a227074227d2c22696478223a"
    "7b226474797065223a22493634222c227368617065223a5b325d2c22646174615f6f666673657473223a5b302c31"
    "365d7d2c2265223a7b226474797065223a22463634222c227368617065223a5b322c305d2c22646174615f6f6666"
    "73657473223a5b31362c31365d7d2c2277223a7b226474797065223a22463332222c227368617065223a5b322c33"
    "5d2c22646174615f6f666673657473223a5b31362c34305d7d2c2273223a7b226474797065223a22493332222c22"
    "7368617065223a5b5d2c22646174615f6f666673657473223a5b34302c34345d7d2c2268223a7b22647479706522"
    "3a22463136222c227368617065223a5b315d2c22646174615f6f666673657473223a5b34342c34365d7d2c226222"
    "3a7b226474797065223a225538222c227368617065223a5b325d2c22646174615f6f666673657473223a5b34362c"
    "34385d7d2c226d223a7b226474797065223a22424f4f4c222c227368617065223a5b335d2c22646174615f6f6666"
    "73657473223a5b34382c35315d7d7d2020200700000000000000ffffffffffffffff000000000000803f00000040"
    "00004040000080400000a04003000000003eff01010001";

// Python safetensors 0.8.0: {'q"\\\n\x01é': [1.0] float32}, metadata={'k\t': 'v\x1f'}.
constexpr char kEscapeGolden[] =
    "68000000000000007b225f5f6d657461646174615f5f223a7b226b5c74223a22765c7530303166227d2c22715c22"
    "5c5c5c6e5c7530303031c3a9223a7b226474797065223a22463332222c227368617065223a5b315d2c2264617461"
    "5f6f666673657473223a5b302c345d7d7d2020200000803f";

TEST(SerializeSafetensorsTest, MatchesPythonBytes) {
  auto out = SerializeSafetensors(MixedTensors(), {{"format", "pt"}});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(absl::BytesToHexString(*out), kMixedGolden);

  auto esc = SerializeSafetensors({{"q\"\\\n\x01\xc3\xa9", {"F32", {1}, Raw<float>({1.0f})}}},
                                  {{"k\t", "v\x1f"}});
  ASSERT_TRUE(esc.ok()) << esc.status();
  EXPECT_EQ(absl::BytesToHexString(*esc), kEscapeGolden);
}

TEST(SerializeSafetensorsTest, HeaderRuleWithoutMetadata) {
  auto out = SerializeSafetensors({{"b", {"BF16", {1}, "\x80\x3f"}},
                                   {"a", {"BF16", {2}, std::string(4, '\0')}},
                                   {"c", {"I8", {1}, "\x05"}},
                                   {"d", {"I16", {1}, "\x01\x02"}}});
  ASSERT_TRUE(out.ok());
  const std::string json =
      R"({"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},)"
      R"("b":{"dtype":"BF16","shape":[1],"data_offsets":[4,6]},)"
      R"("d":{"dtype":"I16","shape":[1],"data_offsets":[6,8]},)"
      R"("c":{"dtype":"I8","shape":[1],"data_offsets":[8,9]}})";
  std::string header = json + std::string((8 - json.size() % 8) % 8, ' ');
  uint64_t n = header.size();
  std::string expected(reinterpret_cast<const char*>(&n), 8);
  expected += header;
  expected += std::string(4, '\0') + "\x80\x3f" + "\x01\x02" + "\x05";
  EXPECT_EQ(*out, expected);

  auto empty = SerializeSafetensors({});
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, std::string("\x08\0\0\0\0\0\0\0{}      ", 16));
}

TEST(SerializeSafetensorsTest, ReadBackByEngineParser) {
  testing::TempDir tmp;
  auto out = SerializeSafetensors(MixedTensors(), {{"format", "pt"}, {"b", "2"}, {"a", "1"}});
  ASSERT_TRUE(out.ok());
  const fs::path path = tmp.path() / "t.safetensors";
  testing::Spit(path, *out);
  auto file = engine::SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->metadata(),
            (std::map<std::string, std::string>{{"a", "1"}, {"b", "2"}, {"format", "pt"}}));
  const auto tensors = MixedTensors();
  ASSERT_EQ((*file)->tensors().size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    const engine::TensorInfo* info = (*file)->Find(name);
    ASSERT_NE(info, nullptr) << name;
    EXPECT_EQ(engine::SafetensorsDtypeName(info->dtype), t.dtype) << name;
    EXPECT_EQ(info->shape, t.shape) << name;
    auto data = (*file)->Data(*info);
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(data.data()), data.size()), t.bytes) << name;
  }
}

TEST(SerializeSafetensorsTest, Errors) {
  auto size = SerializeSafetensors({{"lora_A", {"F32", {2, 3}, std::string(20, '\0')}}});
  EXPECT_TRUE(absl::IsInvalidArgument(size.status()));
  EXPECT_THAT(std::string(size.status().message()), HasSubstr("lora_A"));
  EXPECT_THAT(std::string(size.status().message()), HasSubstr("20 bytes"));
  EXPECT_THAT(std::string(size.status().message()), HasSubstr("24"));

  auto dtype = SerializeSafetensors({{"t", {"F8", {1}, "x"}}});
  EXPECT_TRUE(absl::IsInvalidArgument(dtype.status()));
  EXPECT_THAT(std::string(dtype.status().message()), HasSubstr("F8"));

  EXPECT_TRUE(absl::IsInvalidArgument(SerializeSafetensors({{"t", {"U8", {-1}, ""}}}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(SerializeSafetensors({{"__metadata__", {"U8", {1}, "x"}}}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(SerializeSafetensors({{"bad\xff", {"U8", {1}, "x"}}}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(SerializeSafetensors({{"t", {"U8", {1}, "x"}}}, {{"k", "\xc3"}}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      SerializeSafetensors({{"t", {"U8", {int64_t{1} << 40, int64_t{1} << 40}, ""}}}).status()));
}

TEST(PlanSafetensorsTest, StreamingTheLayoutGivesTheSerialisedBytes) {
  std::map<std::string, TensorBytes> tensors;
  tensors["b.weight"] = {"F32", {2, 3}, std::string(24, '\x01')};
  tensors["a.weight"] = {"BF16", {4}, std::string(8, '\x02')};
  tensors["c.bias"] = {"F32", {3}, std::string(12, '\x03')};
  std::map<std::string, TensorSpec> specs;
  for (const auto& [name, t] : tensors) specs[name] = {t.dtype, t.shape};
  auto layout = PlanSafetensors(specs, {{"format", "pt"}});
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::string streamed = layout->prefix;
  for (const SafetensorsLayout::Slot& slot : layout->order) {
    EXPECT_EQ(slot.nbytes, tensors.at(slot.name).bytes.size());
    streamed += tensors.at(slot.name).bytes;
  }
  EXPECT_EQ(streamed.size(), layout->file_size);
  auto whole = SerializeSafetensors(tensors, {{"format", "pt"}});
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ(streamed, *whole);
}

TEST(SafetensorsDtypeTest, Mapping) {
  EXPECT_EQ(*SafetensorsDtype("float32"), "F32");
  EXPECT_EQ(*SafetensorsDtype("bfloat16"), "BF16");
  EXPECT_EQ(*SafetensorsDtype("float16"), "F16");
  EXPECT_EQ(*SafetensorsDtype("float64"), "F64");
  EXPECT_EQ(*SafetensorsDtype("int64"), "I64");
  EXPECT_EQ(*SafetensorsDtype("int32"), "I32");
  EXPECT_EQ(*SafetensorsDtype("uint8"), "U8");
  EXPECT_EQ(*SafetensorsDtype("bool"), "BOOL");
  auto bad = SafetensorsDtype("complex64");
  EXPECT_TRUE(absl::IsInvalidArgument(bad.status()));
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("complex64"));
}

}  // namespace
}  // namespace twinkle::storage
