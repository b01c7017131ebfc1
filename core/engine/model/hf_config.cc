#include "core/engine/model/hf_config.h"

#include <cstdint>
#include <fstream>
#include <limits>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace twinkle::engine {
namespace {

using Json = nlohmann::json;

// Sizes above int32 range are certainly corrupt, and capping them keeps every product of
// two of them (the weight shapes) inside int64.
constexpr int64_t kMaxDimension = std::numeric_limits<int32_t>::max();
// config.json is a few KB; anything this large is not a config.
constexpr std::uintmax_t kMaxConfigBytes = 16u << 20;

struct Architecture {
  const char* name;
  const char* model_type;
};
constexpr Architecture kSupported[] = {
    {"LlamaForCausalLM", "llama"},
    {"Qwen2ForCausalLM", "qwen2"},
    {"Qwen3ForCausalLM", "qwen3"},
};

// Walks one config object and builds errors that name the file and the dotted key path, so
// a user can find the line to fix without reading our source.
class ConfigReader {
 public:
  explicit ConfigReader(std::string_view file) : file_(file) {}

  absl::Status Error(absl::string_view key, absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(file_, ": key '", key, "': ", what));
  }

  // Returns the member or nullptr when it is absent or JSON null (transformers writes null
  // for "use the default", e.g. "head_dim": null).
  static const Json* Find(const Json& obj, absl::string_view key) {
    auto it = obj.find(std::string(key));
    if (it == obj.end() || it->is_null()) return nullptr;
    return &*it;
  }

  absl::Status Int(const Json& obj, absl::string_view prefix, absl::string_view key, bool required,
                   int64_t* out) const {
    const std::string path = absl::StrCat(prefix, key);
    const Json* v = Find(obj, key);
    if (v == nullptr) {
      return required ? Error(path, "required but missing") : absl::OkStatus();
    }
    // Floats are rejected even when integral: a size written as 4096.0 means the file was
    // not produced by transformers and deserves a look.
    if (!v->is_number_integer()) {
      return Error(path, absl::StrCat("expected an integer, got ",
                                      v->is_number() ? v->dump() : v->type_name()));
    }
    if (v->is_number_unsigned()) {
      if (v->get<uint64_t>() > static_cast<uint64_t>(kMaxDimension)) {
        return Error(path, absl::StrCat("value ", v->dump(), " is out of range"));
      }
    }
    const int64_t value = v->get<int64_t>();
    if (value <= 0 || value > kMaxDimension) {
      return Error(path, absl::StrCat("expected a positive integer, got ", value));
    }
    *out = value;
    return absl::OkStatus();
  }

  absl::Status Double(const Json& obj, absl::string_view prefix, absl::string_view key,
                      bool required, double* out) const {
    const std::string path = absl::StrCat(prefix, key);
    const Json* v = Find(obj, key);
    if (v == nullptr) {
      return required ? Error(path, "required but missing") : absl::OkStatus();
    }
    if (!v->is_number()) {
      return Error(path, absl::StrCat("expected a number, got ", v->type_name()));
    }
    const double value = v->get<double>();
    if (!(value > 0.0) || value == std::numeric_limits<double>::infinity()) {
      return Error(path, absl::StrCat("expected a positive number, got ", v->dump()));
    }
    *out = value;
    return absl::OkStatus();
  }

  absl::Status Bool(const Json& obj, absl::string_view key, bool* out) const {
    const Json* v = Find(obj, key);
    if (v == nullptr) return absl::OkStatus();
    if (!v->is_boolean()) {
      return Error(key, absl::StrCat("expected a boolean, got ", v->type_name()));
    }
    *out = v->get<bool>();
    return absl::OkStatus();
  }

  absl::Status String(const Json& obj, absl::string_view prefix, absl::string_view key,
                      bool required, std::string* out) const {
    const std::string path = absl::StrCat(prefix, key);
    const Json* v = Find(obj, key);
    if (v == nullptr) {
      return required ? Error(path, "required but missing") : absl::OkStatus();
    }
    if (!v->is_string()) {
      return Error(path, absl::StrCat("expected a string, got ", v->type_name()));
    }
    *out = v->get<std::string>();
    return absl::OkStatus();
  }

 private:
  std::string file_;
};

// Local to this file (undefined at the end) so it cannot clash with a project-wide macro.
#define HF_RETURN_IF_ERROR(expr)       \
  do {                                 \
    absl::Status _status = (expr);     \
    if (!_status.ok()) return _status; \
  } while (false)

// RoPE settings live in `rope_scaling` (+ top-level `rope_theta`) up to transformers 4 and
// in `rope_parameters` (which also carries rope_theta) from transformers 5 on.
absl::Status ParseRope(const ConfigReader& r, const Json& root, ModelConfig* config) {
  const Json* params = ConfigReader::Find(root, "rope_parameters");
  const Json* scaling = ConfigReader::Find(root, "rope_scaling");
  for (const auto& [key, obj] :
       {std::pair{"rope_parameters", params}, std::pair{"rope_scaling", scaling}}) {
    if (obj != nullptr && !obj->is_object()) {
      return r.Error(key, absl::StrCat("expected an object, got ", obj->type_name()));
    }
  }
  auto has_type = [](const Json* obj) {
    return obj != nullptr && (ConfigReader::Find(*obj, "rope_type") != nullptr ||
                              ConfigReader::Find(*obj, "type") != nullptr);
  };

  HF_RETURN_IF_ERROR(r.Double(root, "", "rope_theta", false, &config->rope_theta));
  if (params != nullptr) {
    HF_RETURN_IF_ERROR(
        r.Double(*params, "rope_parameters.", "rope_theta", false, &config->rope_theta));
  }
  // Partial rotary embedding is not implemented; refuse rather than rotate every dim.
  double partial = 1.0;
  HF_RETURN_IF_ERROR(r.Double(root, "", "partial_rotary_factor", false, &partial));
  if (params != nullptr) {
    HF_RETURN_IF_ERROR(
        r.Double(*params, "rope_parameters.", "partial_rotary_factor", false, &partial));
  }
  if (partial != 1.0) return r.Error("partial_rotary_factor", "only 1.0 is supported");

  // The scaling type comes from rope_parameters when it names one. A rope_parameters that
  // holds only rope_theta must not mask a typed rope_scaling next to it (that would drop
  // llama3 scaling silently).
  const Json* rope = params;
  std::string key = "rope_parameters";
  if (!has_type(params) && scaling != nullptr) {
    rope = scaling;
    key = "rope_scaling";
  }
  if (rope == nullptr) return absl::OkStatus();
  const std::string prefix = key + ".";

  // "type" is the pre-4.45 spelling of "rope_type".
  std::string type;
  const char* type_key = ConfigReader::Find(*rope, "rope_type") != nullptr ? "rope_type" : "type";
  HF_RETURN_IF_ERROR(r.String(*rope, prefix, type_key, false, &type));
  if (type.empty()) {
    // rope_parameters always exists in transformers 5 and may hold only rope_theta.
    if (key == "rope_scaling") return r.Error(prefix + "rope_type", "required but missing");
    type = "default";
  }

  RopeScaling& s = config->rope_scaling;
  if (type == "default") {
    s.type = RopeScalingType::kNone;
  } else if (type == "linear") {
    s.type = RopeScalingType::kLinear;
    HF_RETURN_IF_ERROR(r.Double(*rope, prefix, "factor", true, &s.factor));
  } else if (type == "llama3") {
    s.type = RopeScalingType::kLlama3;
    HF_RETURN_IF_ERROR(r.Double(*rope, prefix, "factor", true, &s.factor));
    HF_RETURN_IF_ERROR(r.Double(*rope, prefix, "low_freq_factor", true, &s.low_freq_factor));
    HF_RETURN_IF_ERROR(r.Double(*rope, prefix, "high_freq_factor", true, &s.high_freq_factor));
    HF_RETURN_IF_ERROR(r.Int(*rope, prefix, "original_max_position_embeddings", true,
                             &s.original_max_position_embeddings));
    if (s.high_freq_factor <= s.low_freq_factor) {
      return r.Error(prefix + "high_freq_factor", "must be greater than low_freq_factor");
    }
  } else {
    return r.Error(prefix + type_key, absl::StrCat("unsupported RoPE type '", type,
                                                   "' (supported: default, linear, llama3)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text,
                                             std::string_view name_for_errors) {
  // absl may be built with its own string_view, which StrCat does not take from std.
  const std::string file(name_for_errors);
  const ConfigReader r(file);
  Json root;
  try {
    root = Json::parse(json_text);
  } catch (const Json::parse_error& e) {
    // e.what() carries the line and column, which is what a user needs to fix the file.
    return absl::InvalidArgumentError(absl::StrCat(file, ": not valid JSON: ", e.what()));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": expected a JSON object, got ", root.type_name()));
  }

  ModelConfig c;
  const Json* archs = ConfigReader::Find(root, "architectures");
  if (archs == nullptr) return r.Error("architectures", "required but missing");
  if (!archs->is_array() || archs->empty() || !(*archs)[0].is_string()) {
    return r.Error("architectures", "expected a non-empty array of strings");
  }
  c.architecture = (*archs)[0].get<std::string>();
  const Architecture* arch = nullptr;
  for (const Architecture& a : kSupported) {
    if (c.architecture == a.name) arch = &a;
  }
  if (arch == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": unsupported architecture '", c.architecture,
                     "' (supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)"));
  }
  HF_RETURN_IF_ERROR(r.String(root, "", "model_type", true, &c.model_type));
  if (c.model_type != arch->model_type) {
    return r.Error("model_type",
                   absl::StrCat("'", c.model_type, "' does not match architecture ", c.architecture,
                                " (expected '", arch->model_type, "')"));
  }

  HF_RETURN_IF_ERROR(r.Int(root, "", "vocab_size", true, &c.vocab_size));
  HF_RETURN_IF_ERROR(r.Int(root, "", "hidden_size", true, &c.hidden_size));
  HF_RETURN_IF_ERROR(r.Int(root, "", "intermediate_size", true, &c.intermediate_size));
  HF_RETURN_IF_ERROR(r.Int(root, "", "num_hidden_layers", true, &c.num_hidden_layers));
  HF_RETURN_IF_ERROR(r.Int(root, "", "num_attention_heads", true, &c.num_attention_heads));
  c.num_key_value_heads = c.num_attention_heads;
  HF_RETURN_IF_ERROR(r.Int(root, "", "num_key_value_heads", false, &c.num_key_value_heads));
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return r.Error("num_key_value_heads",
                   absl::StrCat(c.num_key_value_heads, " does not divide num_attention_heads ",
                                c.num_attention_heads));
  }
  if (ConfigReader::Find(root, "head_dim") == nullptr &&
      c.hidden_size % c.num_attention_heads != 0) {
    return r.Error("num_attention_heads",
                   absl::StrCat(c.num_attention_heads, " does not divide hidden_size ",
                                c.hidden_size, " and head_dim is not given"));
  }
  c.head_dim = c.hidden_size / c.num_attention_heads;
  HF_RETURN_IF_ERROR(r.Int(root, "", "head_dim", false, &c.head_dim));
  HF_RETURN_IF_ERROR(r.Double(root, "", "rms_norm_eps", true, &c.rms_norm_eps));
  HF_RETURN_IF_ERROR(r.Int(root, "", "max_position_embeddings", true, &c.max_position_embeddings));
  HF_RETURN_IF_ERROR(ParseRope(r, root, &c));
  HF_RETURN_IF_ERROR(r.Bool(root, "tie_word_embeddings", &c.tie_word_embeddings));

  bool attention_bias = false;
  HF_RETURN_IF_ERROR(r.Bool(root, "attention_bias", &attention_bias));
  if (c.model_type == "qwen2") {
    // Qwen2 hard-codes bias on q/k/v and none on o_proj; its config has no switch.
    c.attention_bias = true;
    c.o_proj_bias = false;
  } else {
    c.attention_bias = attention_bias;
    c.o_proj_bias = attention_bias;
  }
  HF_RETURN_IF_ERROR(r.Bool(root, "mlp_bias", &c.mlp_bias));
  c.qk_norm = c.model_type == "qwen3";

  // Features of these families that the engine does not implement: fail loudly.
  std::string act = "silu";
  HF_RETURN_IF_ERROR(r.String(root, "", "hidden_act", false, &act));
  if (act != "silu") {
    return r.Error("hidden_act", absl::StrCat("unsupported activation '", act, "' (only silu)"));
  }
  bool sliding = false;
  HF_RETURN_IF_ERROR(r.Bool(root, "use_sliding_window", &sliding));
  if (sliding) return r.Error("use_sliding_window", "sliding-window attention is not supported");

  // transformers 5 renamed torch_dtype to dtype; accept either, prefer the new one.
  HF_RETURN_IF_ERROR(r.String(root, "", "torch_dtype", false, &c.torch_dtype));
  HF_RETURN_IF_ERROR(r.String(root, "", "dtype", false, &c.torch_dtype));
  return c;
}

absl::StatusOr<ModelConfig> ReadModelConfig(const std::filesystem::path& model_dir) {
  const std::filesystem::path file = model_dir / "config.json";
  std::error_code ec;
  const std::uintmax_t size = std::filesystem::file_size(file, ec);
  if (ec) {
    if (ec == std::errc::no_such_file_or_directory) {
      return absl::NotFoundError(absl::StrCat(file.string(), ": not found"));
    }
    return absl::InvalidArgumentError(absl::StrCat(file.string(), ": ", ec.message()));
  }
  if (size > kMaxConfigBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(file.string(), ": ", size, " bytes is too large for a config"));
  }
  std::ifstream in(file, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(file.string(), ": cannot open"));
  std::string text(static_cast<size_t>(size), '\0');
  in.read(text.data(), static_cast<std::streamsize>(size));
  if (in.gcount() != static_cast<std::streamsize>(size)) {
    return absl::InvalidArgumentError(absl::StrCat(file.string(), ": read failed"));
  }
  return ParseModelConfig(text, file.string());
}

std::map<std::string, std::vector<int64_t>> ExpectedWeightShapes(const ModelConfig& c) {
  std::map<std::string, std::vector<int64_t>> shapes;
  const int64_t h = c.hidden_size;
  const int64_t q_dim = c.num_attention_heads * c.head_dim;
  const int64_t kv_dim = c.num_key_value_heads * c.head_dim;
  const int64_t ffn = c.intermediate_size;

  shapes["model.embed_tokens.weight"] = {c.vocab_size, h};
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    shapes[p + "self_attn.q_proj.weight"] = {q_dim, h};
    shapes[p + "self_attn.k_proj.weight"] = {kv_dim, h};
    shapes[p + "self_attn.v_proj.weight"] = {kv_dim, h};
    shapes[p + "self_attn.o_proj.weight"] = {h, q_dim};
    if (c.attention_bias) {
      shapes[p + "self_attn.q_proj.bias"] = {q_dim};
      shapes[p + "self_attn.k_proj.bias"] = {kv_dim};
      shapes[p + "self_attn.v_proj.bias"] = {kv_dim};
    }
    if (c.o_proj_bias) shapes[p + "self_attn.o_proj.bias"] = {h};
    if (c.qk_norm) {
      shapes[p + "self_attn.q_norm.weight"] = {c.head_dim};
      shapes[p + "self_attn.k_norm.weight"] = {c.head_dim};
    }
    shapes[p + "mlp.gate_proj.weight"] = {ffn, h};
    shapes[p + "mlp.up_proj.weight"] = {ffn, h};
    shapes[p + "mlp.down_proj.weight"] = {h, ffn};
    if (c.mlp_bias) {
      shapes[p + "mlp.gate_proj.bias"] = {ffn};
      shapes[p + "mlp.up_proj.bias"] = {ffn};
      shapes[p + "mlp.down_proj.bias"] = {h};
    }
    shapes[p + "input_layernorm.weight"] = {h};
    shapes[p + "post_attention_layernorm.weight"] = {h};
  }
  shapes["model.norm.weight"] = {h};
  if (!c.tie_word_embeddings) shapes["lm_head.weight"] = {c.vocab_size, h};
  return shapes;
}

#undef HF_RETURN_IF_ERROR

}  // namespace twinkle::engine
