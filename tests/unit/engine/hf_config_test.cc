#include "core/engine/model/hf_config.h"

#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/unit/engine/model_test_util.h"

namespace twinkle::engine {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using Json = nlohmann::json;

// Abbreviated copies of real configs (Llama-3.2-1B, Qwen2.5-0.5B, Qwen3-0.6B as written
// by transformers 5).
Json Llama32() {
  return Json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "max_position_embeddings": 131072, "tie_word_embeddings": true,
    "attention_bias": false, "mlp_bias": false, "hidden_act": "silu",
    "torch_dtype": "bfloat16"})");
}
Json Qwen25() {
  return Json::parse(R"({
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "rope_scaling": null, "max_position_embeddings": 32768,
    "tie_word_embeddings": true, "use_sliding_window": false, "sliding_window": 32768,
    "max_window_layers": 21, "hidden_act": "silu", "torch_dtype": "bfloat16"})");
}
Json Qwen3V5() {
  return Json::parse(R"({
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-06, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000},
    "max_position_embeddings": 40960, "tie_word_embeddings": true, "attention_bias": false,
    "dtype": "bfloat16", "hidden_act": "silu", "use_sliding_window": false,
    "sliding_window": null})");
}

absl::StatusOr<ModelConfig> Parse(const Json& j) {
  return ParseModelConfig(j.dump(), "/m/config.json");
}

TEST(HfConfigTest, Llama32WithLlama3RopeScaling) {
  auto c = Parse(Llama32());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, "LlamaForCausalLM");
  EXPECT_EQ(c->model_type, "llama");
  EXPECT_EQ(c->vocab_size, 128256);
  EXPECT_EQ(c->hidden_size, 2048);
  EXPECT_EQ(c->intermediate_size, 8192);
  EXPECT_EQ(c->num_hidden_layers, 16);
  EXPECT_EQ(c->num_attention_heads, 32);
  EXPECT_EQ(c->num_key_value_heads, 8);
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kLlama3);
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 32.0);
  EXPECT_DOUBLE_EQ(c->rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c->rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(c->max_position_embeddings, 131072);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_FALSE(c->o_proj_bias);
  EXPECT_FALSE(c->qk_norm);
  EXPECT_EQ(c->torch_dtype, "bfloat16");
}

TEST(HfConfigTest, LlamaDefaultsForKvHeadsHeadDimAndTie) {
  Json j = Llama32();
  j.erase("num_key_value_heads");
  j["head_dim"] = nullptr;
  j.erase("tie_word_embeddings");
  j.erase("rope_scaling");
  auto c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_key_value_heads, 32);
  EXPECT_EQ(c->head_dim, 2048 / 32);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kNone);
}

TEST(HfConfigTest, Qwen2HasQkvBiasButNoOProjBias) {
  auto c = Parse(Qwen25());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_TRUE(c->attention_bias);
  EXPECT_FALSE(c->o_proj_bias);
  EXPECT_DOUBLE_EQ(c->rope_theta, 1e6);
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kNone);
  const auto shapes = ExpectedWeightShapes(*c);
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.q_proj.bias"), (std::vector<int64_t>{896}));
  EXPECT_EQ(shapes.at("model.layers.23.self_attn.k_proj.bias"), (std::vector<int64_t>{128}));
  EXPECT_EQ(shapes.count("model.layers.0.self_attn.o_proj.bias"), 0u);
  EXPECT_EQ(shapes.count("lm_head.weight"), 0u);  // Tied.
}

TEST(HfConfigTest, Qwen3Transformers5RopeParametersAndDtype) {
  auto c = Parse(Qwen3V5());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 128);  // Explicit, not hidden/heads (64).
  EXPECT_DOUBLE_EQ(c->rope_theta, 1e6);
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kNone);
  EXPECT_TRUE(c->qk_norm);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_EQ(c->torch_dtype, "bfloat16");
  const auto shapes = ExpectedWeightShapes(*c);
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.q_proj.weight"),
            (std::vector<int64_t>{16 * 128, 1024}));
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.o_proj.weight"),
            (std::vector<int64_t>{1024, 16 * 128}));
  EXPECT_EQ(shapes.at("model.layers.27.self_attn.k_norm.weight"), (std::vector<int64_t>{128}));
}

TEST(HfConfigTest, Transformers5Llama3RopeParameters) {
  Json j = Llama32();
  j.erase("rope_theta");
  j.erase("rope_scaling");
  j["rope_parameters"] = Json::parse(R"({"rope_type": "llama3", "rope_theta": 500000.0,
      "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192})");
  auto c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_DOUBLE_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kLlama3);
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 8.0);
}

TEST(HfConfigTest, ThetaOnlyRopeParametersDoesNotMaskRopeScaling) {
  Json j = Llama32();
  j.erase("rope_theta");
  j["rope_parameters"] = Json::parse(R"({"rope_theta": 250000.0})");
  auto c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_DOUBLE_EQ(c->rope_theta, 250000.0);
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kLlama3);
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 32.0);
}

TEST(HfConfigTest, LegacyLinearRopeScalingType) {
  Json j = Llama32();
  j["rope_scaling"] = Json::parse(R"({"type": "linear", "factor": 2.0})");
  auto c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kLinear);
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 2.0);
}

TEST(HfConfigTest, AttentionBiasOnLlamaCoversOProj) {
  Json j = Llama32();
  j["attention_bias"] = true;
  auto c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->attention_bias);
  EXPECT_TRUE(c->o_proj_bias);
  EXPECT_EQ(ExpectedWeightShapes(*c).at("model.layers.0.self_attn.o_proj.bias"),
            (std::vector<int64_t>{2048}));
}

TEST(HfConfigTest, UnsupportedArchitectureNamed) {
  Json j = Llama32();
  j["architectures"] = {"MistralForCausalLM"};
  auto c = Parse(j);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().ToString(),
              AllOf(HasSubstr("MistralForCausalLM"), HasSubstr("/m/config.json")));
}

TEST(HfConfigTest, MissingRequiredKeyNamed) {
  for (const char* key :
       {"architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
        "num_hidden_layers", "num_attention_heads", "rms_norm_eps", "max_position_embeddings"}) {
    Json j = Qwen25();
    j.erase(key);
    auto c = Parse(j);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << key;
    EXPECT_THAT(c.status().ToString(),
                AllOf(HasSubstr(std::string("'") + key + "'"), HasSubstr("/m/config.json")))
        << key;
  }
}

TEST(HfConfigTest, IllTypedKeysNamed) {
  const std::pair<const char*, Json> cases[] = {
      {"hidden_size", "896"},     {"hidden_size", 896.5},           {"num_hidden_layers", -1},
      {"vocab_size", 0},          {"rms_norm_eps", "1e-6"},         {"tie_word_embeddings", 1},
      {"model_type", 7},          {"num_key_value_heads", 3},       {"head_dim", true},
      {"rope_theta", false},      {"hidden_act", "gelu"},           {"use_sliding_window", true},
      {"vocab_size", 1ull << 40}, {"architectures", Json::array()},
  };
  for (const auto& [key, value] : cases) {
    Json j = Qwen25();
    j[key] = value;
    auto c = Parse(j);
    EXPECT_FALSE(c.ok()) << key << "=" << value.dump();
    EXPECT_THAT(c.status().ToString(), HasSubstr(std::string("'") + key + "'"))
        << key << "=" << value.dump();
  }
}

TEST(HfConfigTest, RopeErrorsNameNestedKey) {
  Json j = Llama32();
  j["rope_scaling"] = Json::parse(R"({"rope_type": "yarn", "factor": 4.0})");
  EXPECT_THAT(Parse(j).status().ToString(),
              AllOf(HasSubstr("'yarn'"), HasSubstr("rope_scaling.rope_type")));

  j["rope_scaling"] = Json::parse(R"({"rope_type": "llama3", "factor": 8.0})");
  EXPECT_THAT(Parse(j).status().ToString(), HasSubstr("rope_scaling.low_freq_factor"));

  j.erase("rope_scaling");
  j["rope_parameters"] = Json::parse(R"({"rope_type": "default", "rope_theta": "big"})");
  EXPECT_THAT(Parse(j).status().ToString(), HasSubstr("rope_parameters.rope_theta"));
}

TEST(HfConfigTest, ModelTypeMustMatchArchitecture) {
  Json j = Qwen25();
  j["model_type"] = "qwen3";
  EXPECT_THAT(Parse(j).status().ToString(),
              AllOf(HasSubstr("'model_type'"), HasSubstr("Qwen2ForCausalLM")));
}

TEST(HfConfigTest, NotJsonOrNotObject) {
  EXPECT_THAT(ParseModelConfig("{", "c.json").status().ToString(), HasSubstr("not valid JSON"));
  EXPECT_THAT(ParseModelConfig("[]", "c.json").status().ToString(),
              HasSubstr("expected a JSON object"));
}

TEST(HfConfigTest, ReadsFromDirectory) {
  testing::ScopedTempDir dir;
  EXPECT_EQ(ReadModelConfig(dir.path()).status().code(), absl::StatusCode::kNotFound);
  testing::WriteBytes(dir.path() / "config.json", Qwen3V5().dump(2));
  auto c = ReadModelConfig(dir.path());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, "Qwen3ForCausalLM");
  testing::WriteBytes(dir.path() / "config.json", "{\"architectures\": 3}");
  EXPECT_THAT(ReadModelConfig(dir.path()).status().ToString(),
              AllOf(HasSubstr("config.json"), HasSubstr("'architectures'")));
}

TEST(HfConfigTest, ExpectedWeightShapesFullList) {
  Json j = Llama32();
  j["num_hidden_layers"] = 2;
  j["tie_word_embeddings"] = false;
  auto c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  const auto shapes = ExpectedWeightShapes(*c);
  // embed + norm + lm_head + 9 per layer (4 attn, 3 mlp, 2 norms).
  EXPECT_EQ(shapes.size(), 3u + 2 * 9);
  EXPECT_EQ(shapes.at("model.embed_tokens.weight"), (std::vector<int64_t>{128256, 2048}));
  EXPECT_EQ(shapes.at("lm_head.weight"), (std::vector<int64_t>{128256, 2048}));
  EXPECT_EQ(shapes.at("model.layers.1.self_attn.v_proj.weight"),
            (std::vector<int64_t>{8 * 64, 2048}));
  EXPECT_EQ(shapes.at("model.layers.1.mlp.down_proj.weight"), (std::vector<int64_t>{2048, 8192}));
  EXPECT_EQ(shapes.at("model.layers.0.post_attention_layernorm.weight"),
            (std::vector<int64_t>{2048}));
  EXPECT_EQ(shapes.at("model.norm.weight"), (std::vector<int64_t>{2048}));
}

}  // namespace
}  // namespace twinkle::engine
