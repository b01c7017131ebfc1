#include "core/engine/model/loader.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/unit/engine/model_test_util.h"

namespace twinkle::engine {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using testing::SafetensorsBuilder;
using testing::ScopedTempDir;
using Json = nlohmann::json;

// 1 layer, hidden 8, 2 heads of 4 with 1 kv head (GQA), ffn 16, vocab 12.
Json TinyConfig(const std::string& arch, const std::string& model_type) {
  return Json{{"architectures", {arch}},
              {"model_type", model_type},
              {"vocab_size", 12},
              {"hidden_size", 8},
              {"intermediate_size", 16},
              {"num_hidden_layers", 1},
              {"num_attention_heads", 2},
              {"num_key_value_heads", 1},
              {"rms_norm_eps", 1e-6},
              {"max_position_embeddings", 64},
              {"tie_word_embeddings", false}};
}

// Deterministic values, distinct per weight, exactly representable in bf16 (multiples of
// 1/8 below 16), so bf16 round trips are exact.
std::vector<float> ValuesFor(int weight_index, int64_t numel) {
  std::vector<float> v(numel);
  for (int64_t i = 0; i < numel; ++i) {
    v[i] = static_cast<float>((weight_index * 7 + i) % 97) / 8.0f - 6.0f;
  }
  return v;
}

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

class LoaderTest : public ::testing::Test {
 protected:
  // Writes config.json and returns the expected weights with their values.
  std::map<std::string, std::vector<float>> WriteConfig(const Json& config) {
    testing::WriteBytes(dir_.path() / "config.json", config.dump());
    auto parsed = ParseModelConfig(config.dump(), "config.json");
    EXPECT_TRUE(parsed.ok()) << parsed.status();
    std::map<std::string, std::vector<float>> values;
    int index = 0;
    for (const auto& [name, shape] : ExpectedWeightShapes(*parsed)) {
      values[name] = ValuesFor(index++, Numel(shape));
      shapes_[name] = shape;
    }
    return values;
  }

  // One file with every weight, in `dtype` ("F32" or "BF16").
  SafetensorsBuilder Builder(const std::map<std::string, std::vector<float>>& values,
                             const std::string& dtype = "F32") {
    SafetensorsBuilder b;
    for (const auto& [name, v] : values) {
      b.Add(name, dtype, shapes_.at(name),
            dtype == "F32" ? testing::RawBytes(v) : testing::Bf16Bytes(v));
    }
    return b;
  }

  void ExpectLoaded(const LoadedModel& model,
                    const std::map<std::string, std::vector<float>>& values, at::ScalarType dtype) {
    ASSERT_EQ(model.weights.size(), values.size());
    int64_t total = 0;
    for (const auto& [name, v] : values) {
      const at::Tensor& t = model.weights.at(name);
      EXPECT_EQ(t.scalar_type(), dtype) << name;
      EXPECT_EQ(t.sizes().vec(), shapes_.at(name)) << name;
      const at::Tensor f = t.to(at::kFloat).contiguous();
      std::vector<float> got(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
      EXPECT_EQ(got, v) << name;
      total += t.numel();
    }
    EXPECT_EQ(model.parameter_count, total);
  }

  absl::Status LoadError() {
    auto model = LoadModel(dir_.path(), at::kFloat, at::kCPU);
    EXPECT_FALSE(model.ok());
    return model.status();
  }

  ScopedTempDir dir_;
  std::map<std::string, std::vector<int64_t>> shapes_;
};

TEST_F(LoaderTest, SingleFileF32) {
  const auto values = WriteConfig(TinyConfig("LlamaForCausalLM", "llama"));
  Builder(values).PadHeader(8, 0).Write(dir_.path() / "model.safetensors");
  auto model = LoadModel(dir_.path(), at::kFloat, at::kCPU);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->config.hidden_size, 8);
  // Tensors own their memory: the file is unmapped by now and the values still read back.
  ExpectLoaded(*model, values, at::kFloat);
  EXPECT_EQ(values.size(), 12u);  // embed, norm, lm_head + 9 per layer.
}

TEST_F(LoaderTest, Bf16FileToFloat32) {
  const auto values = WriteConfig(TinyConfig("LlamaForCausalLM", "llama"));
  Builder(values, "BF16").PadHeader(8, 0).Write(dir_.path() / "model.safetensors");
  auto model = LoadModel(dir_.path(), at::kFloat, at::kCPU);
  ASSERT_TRUE(model.ok()) << model.status();
  ExpectLoaded(*model, values, at::kFloat);
}

TEST_F(LoaderTest, F32FileToBf16) {
  const auto values = WriteConfig(TinyConfig("LlamaForCausalLM", "llama"));
  Builder(values).Write(dir_.path() / "model.safetensors");
  auto model = LoadModel(dir_.path(), at::kBFloat16, at::kCPU);
  ASSERT_TRUE(model.ok()) << model.status();
  ExpectLoaded(*model, values, at::kBFloat16);
}

TEST_F(LoaderTest, MisalignedDataSectionStillLoads) {
  const auto values = WriteConfig(TinyConfig("LlamaForCausalLM", "llama"));
  Builder(values).PadHeader(8, 1).Write(dir_.path() / "model.safetensors");
  auto model = LoadModel(dir_.path(), at::kFloat, at::kCPU);
  ASSERT_TRUE(model.ok()) << model.status();
  ExpectLoaded(*model, values, at::kFloat);
}

TEST_F(LoaderTest, Qwen2BiasesAndQwen3QkNorm) {
  for (const auto& [arch, type] :
       {std::pair{"Qwen2ForCausalLM", "qwen2"}, std::pair{"Qwen3ForCausalLM", "qwen3"}}) {
    shapes_.clear();
    const auto values = WriteConfig(TinyConfig(arch, type));
    Builder(values).Write(dir_.path() / "model.safetensors");
    auto model = LoadModel(dir_.path(), at::kFloat, at::kCPU);
    ASSERT_TRUE(model.ok()) << arch << ": " << model.status();
    ExpectLoaded(*model, values, at::kFloat);
    const std::string extra = std::string(type) == "qwen2"
                                  ? "model.layers.0.self_attn.v_proj.bias"
                                  : "model.layers.0.self_attn.k_norm.weight";
    EXPECT_EQ(model->weights.count(extra), 1u) << arch;
  }
}

TEST_F(LoaderTest, ShardedIndex) {
  const auto values = WriteConfig(TinyConfig("LlamaForCausalLM", "llama"));
  SafetensorsBuilder shard1, shard2;
  Json weight_map = Json::object();
  int i = 0;
  for (const auto& [name, v] : values) {
    const bool first = i++ % 2 == 0;
    (first ? shard1 : shard2).AddF32(name, shapes_.at(name), v);
    weight_map[name] =
        first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  shard1.Write(dir_.path() / "model-00001-of-00002.safetensors");
  shard2.Write(dir_.path() / "model-00002-of-00002.safetensors");
  const Json index = {{"metadata", {{"total_size", 1234}}}, {"weight_map", weight_map}};
  testing::WriteBytes(dir_.path() / "model.safetensors.index.json", index.dump());

  auto model = LoadModel(dir_.path(), at::kFloat, at::kCPU);
  ASSERT_TRUE(model.ok()) << model.status();
  ExpectLoaded(*model, values, at::kFloat);
}

TEST_F(LoaderTest, ShardMissingIndexedWeight) {
  const auto values = WriteConfig(TinyConfig("LlamaForCausalLM", "llama"));
  Json weight_map = Json::object();
  SafetensorsBuilder shard;
  for (const auto& [name, v] : values) {
    weight_map[name] = "shard.safetensors";
    if (name != "model.norm.weight") shard.AddF32(name, shapes_.at(name), v);
  }
  shard.Write(dir_.path() / "shard.safetensors");
  testing::WriteBytes(dir_.path() / "model.safetensors.index.json",
                      Json{{"weight_map", weight_map}}.dump());
  EXPECT_THAT(LoadError().ToString(),
              AllOf(HasSubstr("'model.norm.weight'"), HasSubstr("shard.safetensors"),
                    HasSubstr("missing from this shard")));
}

TEST_F(LoaderTest, ShardTensorNotInIndexAndBadShardName) {
  const auto values = WriteConfig(TinyConfig("LlamaForCausalLM", "llama"));
  Json weight_map = Json::object();
  for (const auto& [name, v] : values) weight_map[name] = "shard.safetensors";
  Builder(values).AddF32("stray", {1}, {1.0f}).Write(dir_.path() / "shard.safetensors");
  testing::WriteBytes(dir_.path() / "model.safetensors.index.json",
                      Json{{"weight_map", weight_map}}.dump());
  EXPECT_THAT(LoadError().ToString(),
              AllOf(HasSubstr("'stray'"), HasSubstr("not listed in weight_map")));

  weight_map["model.norm.weight"] = "../elsewhere.safetensors";
  testing::WriteBytes(dir_.path() / "model.safetensors.index.json",
                      Json{{"weight_map", weight_map}}.dump());
  EXPECT_THAT(LoadError().ToString(),
              AllOf(HasSubstr("'model.norm.weight'"), HasSubstr("not a plain file name")));
}

TEST_F(LoaderTest, CorruptShardIsReported) {
  WriteConfig(TinyConfig("LlamaForCausalLM", "llama"));
  testing::WriteBytes(dir_.path() / "s.safetensors", "xx");
  testing::WriteBytes(dir_.path() / "model.safetensors.index.json",
                      R"({"weight_map": {"model.norm.weight": "s.safetensors"}})");
  EXPECT_THAT(LoadError().ToString(), AllOf(HasSubstr("s.safetensors"), HasSubstr("truncated")));
}

TEST_F(LoaderTest, MissingWeightNamed) {
  auto values = WriteConfig(TinyConfig("LlamaForCausalLM", "llama"));
  values.erase("model.layers.0.mlp.up_proj.weight");
  Builder(values).Write(dir_.path() / "model.safetensors");
  EXPECT_THAT(
      LoadError().ToString(),
      AllOf(HasSubstr("missing weight 'model.layers.0.mlp.up_proj.weight'"), HasSubstr("[16, 8]")));
}

TEST_F(LoaderTest, WrongShapeNamesBothShapes) {
  const auto values = WriteConfig(TinyConfig("LlamaForCausalLM", "llama"));
  shapes_["model.layers.0.mlp.down_proj.weight"] = {16, 8};  // Transposed.
  Builder(values).Write(dir_.path() / "model.safetensors");
  EXPECT_THAT(LoadError().ToString(), AllOf(HasSubstr("'model.layers.0.mlp.down_proj.weight'"),
                                            HasSubstr("[16, 8]"), HasSubstr("[8, 16]")));
}

TEST_F(LoaderTest, ControlCharactersInNamesAreNeutralized) {
  const auto values = WriteConfig(TinyConfig("LlamaForCausalLM", "llama"));
  Builder(values).AddF32("evil\nname", {1}, {1.0f}).Write(dir_.path() / "model.safetensors");
  const absl::Status s = LoadError();
  EXPECT_THAT(s.ToString(), HasSubstr("unexpected weight 'evil?name'"));
}

TEST_F(LoaderTest, UnexpectedWeightNamed) {
  const auto values = WriteConfig(TinyConfig("LlamaForCausalLM", "llama"));
  Builder(values)
      .AddF32("model.layers.0.mlp.extra.weight", {2}, {1, 2})
      .Write(dir_.path() / "model.safetensors");
  EXPECT_THAT(LoadError().ToString(),
              AllOf(HasSubstr("unexpected weight 'model.layers.0.mlp.extra.weight'")));
}

TEST_F(LoaderTest, TiedLmHeadAndInvFreqIgnored) {
  Json config = TinyConfig("LlamaForCausalLM", "llama");
  config["tie_word_embeddings"] = true;
  const auto values = WriteConfig(config);
  ASSERT_EQ(values.count("lm_head.weight"), 0u);
  Builder(values)
      .AddF32("lm_head.weight", {12, 8}, std::vector<float>(96, 1.0f))
      .AddF32("model.layers.0.self_attn.rotary_emb.inv_freq", {2}, {1.0f, 0.5f})
      .Write(dir_.path() / "model.safetensors");
  auto model = LoadModel(dir_.path(), at::kFloat, at::kCPU);
  ASSERT_TRUE(model.ok()) << model.status();
  ExpectLoaded(*model, values, at::kFloat);
  EXPECT_EQ(model->weights.count("lm_head.weight"), 0u);
}

TEST_F(LoaderTest, IntegerWeightRejected) {
  const auto values = WriteConfig(TinyConfig("LlamaForCausalLM", "llama"));
  SafetensorsBuilder b;
  for (const auto& [name, v] : values) {
    if (name == "model.norm.weight") {
      b.Add(name, "I8", {8}, std::string(8, '\1'));
    } else {
      b.AddF32(name, shapes_.at(name), v);
    }
  }
  b.Write(dir_.path() / "model.safetensors");
  EXPECT_THAT(LoadError().ToString(), AllOf(HasSubstr("'model.norm.weight'"), HasSubstr("I8")));
}

TEST_F(LoaderTest, MissingFilesAreNotFound) {
  EXPECT_EQ(LoadError().code(), absl::StatusCode::kNotFound);  // No config.json.
  WriteConfig(TinyConfig("LlamaForCausalLM", "llama"));
  const absl::Status s = LoadError();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.ToString(), HasSubstr("model.safetensors"));
}

TEST_F(LoaderTest, TorchErrorsBecomeStatus) {
  const auto values = WriteConfig(TinyConfig("LlamaForCausalLM", "llama"));
  Builder(values).Write(dir_.path() / "model.safetensors");
  // A non-floating target dtype is refused up front.
  EXPECT_EQ(LoadModel(dir_.path(), at::kInt, at::kCPU).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A device this build cannot reach must surface as a Status, not an exception.
  auto model = LoadModel(dir_.path(), at::kFloat, c10::Device(c10::DeviceType::XLA, 0));
  EXPECT_EQ(model.status().code(), absl::StatusCode::kInternal);
  // LibTorch's multi-page dispatcher dump is cut to its first line.
  EXPECT_THAT(model.status().ToString(), AllOf(HasSubstr("LibTorch error"), HasSubstr("XLA")));
  EXPECT_EQ(model.status().message().find('\n'), absl::string_view::npos);
}

}  // namespace
}  // namespace twinkle::engine
