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
    {"Qwen3_5ForCausalLM", "qwen3_5_text"},
    // The text model is read from text_config (model_type qwen3_5_text); vision is skipped.
    {"Qwen3_5ForConditionalGeneration", "qwen3_5"},
    {"Qwen3MoeForCausalLM", "qwen3_moe"},
    {"Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"},
    {"Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe"},
};

// The Qwen3.5 text families (dense and MoE): hybrid layers, (1 + w) norms, gated attention.
bool IsQwen3_5Text(const std::string& model_type) {
  return model_type == "qwen3_5_text" || model_type == "qwen3_5_moe_text";
}
constexpr char kSupportedList[] =
    "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3_5ForCausalLM, "
    "Qwen3_5ForConditionalGeneration, Qwen3MoeForCausalLM, Qwen3_5MoeForCausalLM, "
    "Qwen3_5MoeForConditionalGeneration";

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
// `tp` prefixes key paths in errors ("text_config." when root is the nested text config).
absl::Status ParseRope(const ConfigReader& r, const Json& root, const std::string& tp,
                       ModelConfig* config) {
  const Json* params = ConfigReader::Find(root, "rope_parameters");
  const Json* scaling = ConfigReader::Find(root, "rope_scaling");
  for (const auto& [key, obj] :
       {std::pair{"rope_parameters", params}, std::pair{"rope_scaling", scaling}}) {
    if (obj != nullptr && !obj->is_object()) {
      return r.Error(tp + key, absl::StrCat("expected an object, got ", obj->type_name()));
    }
  }
  auto has_type = [](const Json* obj) {
    return obj != nullptr && (ConfigReader::Find(*obj, "rope_type") != nullptr ||
                              ConfigReader::Find(*obj, "type") != nullptr);
  };

  HF_RETURN_IF_ERROR(r.Double(root, tp, "rope_theta", false, &config->rope_theta));
  if (params != nullptr) {
    HF_RETURN_IF_ERROR(
        r.Double(*params, tp + "rope_parameters.", "rope_theta", false, &config->rope_theta));
  }
  // Partial rotary embedding is implemented for Qwen3.5 (transformers defaults it to 0.25
  // there); the dense family's modeling code rotates every dim, so anything else is refused
  // rather than silently rotated in full.
  const bool qwen3_5 = IsQwen3_5Text(config->model_type);
  double partial = qwen3_5 ? 0.25 : 1.0;
  HF_RETURN_IF_ERROR(r.Double(root, tp, "partial_rotary_factor", false, &partial));
  if (params != nullptr) {
    HF_RETURN_IF_ERROR(
        r.Double(*params, tp + "rope_parameters.", "partial_rotary_factor", false, &partial));
  }
  if (!qwen3_5 && partial != 1.0) {
    return r.Error(tp + "partial_rotary_factor", "only 1.0 is supported for this family");
  }
  if (partial > 1.0) return r.Error(tp + "partial_rotary_factor", "must be in (0, 1]");
  config->partial_rotary_factor = partial;
  const int64_t rotary = config->rotary_dim();
  if (rotary < 2 || rotary % 2 != 0) {
    return r.Error(tp + "partial_rotary_factor",
                   absl::StrCat("rotates ", rotary, " dims of head_dim ", config->head_dim,
                                "; needs an even number >= 2"));
  }

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
  const std::string prefix = tp + key + ".";

  // "type" is the pre-4.45 spelling of "rope_type".
  std::string type;
  const char* type_key = ConfigReader::Find(*rope, "rope_type") != nullptr ? "rope_type" : "type";
  HF_RETURN_IF_ERROR(r.String(*rope, prefix, type_key, false, &type));
  if (type.empty()) {
    // rope_parameters always exists in transformers 5 and may hold only rope_theta.
    if (key == "rope_scaling") return r.Error(prefix + "rope_type", "required but missing");
    type = "default";
  }
  // Qwen3.5's multimodal RoPE: for text tokens the temporal, height and width positions are
  // all the token's position, so every mrope section rotates by the same angle and the
  // sections change nothing; the engine takes text only. Checked for shape, then ignored.
  if (const Json* sections = ConfigReader::Find(*rope, "mrope_section"); sections != nullptr) {
    if (!qwen3_5) return r.Error(prefix + "mrope_section", "only supported for Qwen3.5");
    if (!sections->is_array()) return r.Error(prefix + "mrope_section", "expected an array");
    for (const Json& v : *sections) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0) {
        return r.Error(prefix + "mrope_section", "expected non-negative integers");
      }
    }
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
  if (qwen3_5 && s.type != RopeScalingType::kNone) {
    return r.Error(prefix + type_key, "Qwen3.5 supports only the default RoPE type");
  }
  return absl::OkStatus();
}

// Qwen3-MoE's experts and which layers have them.
absl::Status ParseMoe(const ConfigReader& r, const Json& text, const std::string& tp,
                      ModelConfig* c) {
  const char* experts_key =
      ConfigReader::Find(text, "num_experts") != nullptr ? "num_experts" : "num_local_experts";
  HF_RETURN_IF_ERROR(r.Int(text, tp, experts_key, true, &c->num_experts));
  HF_RETURN_IF_ERROR(r.Int(text, tp, "num_experts_per_tok", true, &c->experts_per_token));
  HF_RETURN_IF_ERROR(r.Int(text, tp, "moe_intermediate_size", true, &c->moe_intermediate_size));
  if (c->experts_per_token > c->num_experts) {
    return r.Error(tp + "num_experts_per_tok",
                   absl::StrCat(c->experts_per_token, " exceeds ", experts_key, " ",
                                c->num_experts));
  }
  if (c->model_type == "qwen3_5_moe_text") {
    // Qwen3.5-MoE: every layer sparse, top-k always renormalised, a gated shared expert.
    c->norm_topk_prob = true;
    HF_RETURN_IF_ERROR(r.Int(text, tp, "shared_expert_intermediate_size", true,
                             &c->shared_expert_intermediate_size));
    c->moe_layers.assign(static_cast<size_t>(c->num_hidden_layers), true);
    return absl::OkStatus();
  }
  HF_RETURN_IF_ERROR(r.Bool(text, "norm_topk_prob", &c->norm_topk_prob));
  int64_t sparse_step = 1;
  HF_RETURN_IF_ERROR(r.Int(text, tp, "decoder_sparse_step", false, &sparse_step));
  std::vector<bool> dense_only(static_cast<size_t>(c->num_hidden_layers), false);
  if (const Json* only = ConfigReader::Find(text, "mlp_only_layers"); only != nullptr) {
    if (!only->is_array()) return r.Error(tp + "mlp_only_layers", "expected an array");
    for (const Json& v : *only) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 ||
          v.get<int64_t>() >= c->num_hidden_layers) {
        return r.Error(tp + "mlp_only_layers",
                       absl::StrCat("expected layer indices in [0, ", c->num_hidden_layers, ")"));
      }
      dense_only[v.get<size_t>()] = true;
    }
  }
  for (int64_t i = 0; i < c->num_hidden_layers; ++i) {
    c->moe_layers.push_back(!dense_only[static_cast<size_t>(i)] && (i + 1) % sparse_step == 0);
  }
  return absl::OkStatus();
}

// Qwen3.5's layer pattern and Gated DeltaNet sizes, from the text config `text`.
absl::Status ParseHybrid(const ConfigReader& r, const Json& text, const std::string& tp,
                         ModelConfig* c) {
  c->attn_output_gate = true;
  c->zero_centered_norm = true;
  c->linear_conv_kernel = 4;
  c->linear_key_head_dim = 128;
  c->linear_value_head_dim = 128;
  c->linear_num_key_heads = 16;
  c->linear_num_value_heads = 32;
  HF_RETURN_IF_ERROR(r.Int(text, tp, "linear_conv_kernel_dim", false, &c->linear_conv_kernel));
  HF_RETURN_IF_ERROR(r.Int(text, tp, "linear_key_head_dim", false, &c->linear_key_head_dim));
  HF_RETURN_IF_ERROR(r.Int(text, tp, "linear_value_head_dim", false, &c->linear_value_head_dim));
  HF_RETURN_IF_ERROR(r.Int(text, tp, "linear_num_key_heads", false, &c->linear_num_key_heads));
  HF_RETURN_IF_ERROR(
      r.Int(text, tp, "linear_num_value_heads", false, &c->linear_num_value_heads));
  if (c->linear_num_value_heads % c->linear_num_key_heads != 0) {
    return r.Error(tp + "linear_num_key_heads",
                   absl::StrCat(c->linear_num_key_heads, " does not divide linear_num_value_heads ",
                                c->linear_num_value_heads));
  }
  const Json* types = ConfigReader::Find(text, "layer_types");
  if (types != nullptr) {
    if (!types->is_array() || static_cast<int64_t>(types->size()) != c->num_hidden_layers) {
      return r.Error(tp + "layer_types",
                     absl::StrCat("expected an array of num_hidden_layers (", c->num_hidden_layers,
                                  ") strings"));
    }
    for (const Json& t : *types) {
      const std::string name = t.is_string() ? t.get<std::string>() : "";
      if (name != "linear_attention" && name != "full_attention") {
        return r.Error(tp + "layer_types",
                       absl::StrCat("unsupported layer type ", t.dump(),
                                    " (supported: linear_attention, full_attention)"));
      }
      c->linear_layers.push_back(name == "linear_attention");
    }
  } else {
    int64_t interval = 4;
    HF_RETURN_IF_ERROR(r.Int(text, tp, "full_attention_interval", false, &interval));
    for (int64_t i = 0; i < c->num_hidden_layers; ++i) {
      c->linear_layers.push_back((i + 1) % interval != 0);
    }
  }
  // hybrid() means "has a layer list": keep it even when every layer is full attention.
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
    return absl::InvalidArgumentError(absl::StrCat(file, ": unsupported architecture '",
                                                   c.architecture, "' (supported: ",
                                                   kSupportedList, ")"));
  }
  HF_RETURN_IF_ERROR(r.String(root, "", "model_type", true, &c.model_type));
  if (c.model_type != arch->model_type) {
    return r.Error("model_type",
                   absl::StrCat("'", c.model_type, "' does not match architecture ", c.architecture,
                                " (expected '", arch->model_type, "')"));
  }
  // A ConditionalGeneration checkpoint: the language model's settings are in text_config,
  // its weights under model.language_model.*; the vision tower is not loaded.
  const Json* text_root = &root;
  std::string tp;  // key path prefix of the text settings, for errors
  if (c.model_type == "qwen3_5" || c.model_type == "qwen3_5_moe") {
    const std::string expected = c.model_type + "_text";
    text_root = ConfigReader::Find(root, "text_config");
    if (text_root == nullptr) return r.Error("text_config", "required but missing");
    if (!text_root->is_object()) return r.Error("text_config", "expected an object");
    tp = "text_config.";
    HF_RETURN_IF_ERROR(r.String(*text_root, tp, "model_type", true, &c.model_type));
    if (c.model_type != expected) {
      return r.Error(tp + "model_type",
                     absl::StrCat("'", c.model_type, "' (expected '", expected, "')"));
    }
    c.text_prefix = "model.language_model.";
    c.has_vision = true;
  }
  const Json& text = *text_root;

  HF_RETURN_IF_ERROR(r.Int(text, tp, "vocab_size", true, &c.vocab_size));
  HF_RETURN_IF_ERROR(r.Int(text, tp, "hidden_size", true, &c.hidden_size));
  // Qwen3.5-MoE has experts in every layer and no dense MLP width.
  HF_RETURN_IF_ERROR(r.Int(text, tp, "intermediate_size", c.model_type != "qwen3_5_moe_text",
                           &c.intermediate_size));
  HF_RETURN_IF_ERROR(r.Int(text, tp, "num_hidden_layers", true, &c.num_hidden_layers));
  HF_RETURN_IF_ERROR(r.Int(text, tp, "num_attention_heads", true, &c.num_attention_heads));
  c.num_key_value_heads = c.num_attention_heads;
  HF_RETURN_IF_ERROR(r.Int(text, tp, "num_key_value_heads", false, &c.num_key_value_heads));
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return r.Error(tp + "num_key_value_heads",
                   absl::StrCat(c.num_key_value_heads, " does not divide num_attention_heads ",
                                c.num_attention_heads));
  }
  if (ConfigReader::Find(text, "head_dim") == nullptr &&
      c.hidden_size % c.num_attention_heads != 0) {
    return r.Error(tp + "num_attention_heads",
                   absl::StrCat(c.num_attention_heads, " does not divide hidden_size ",
                                c.hidden_size, " and head_dim is not given"));
  }
  c.head_dim = c.hidden_size / c.num_attention_heads;
  HF_RETURN_IF_ERROR(r.Int(text, tp, "head_dim", false, &c.head_dim));
  HF_RETURN_IF_ERROR(r.Double(text, tp, "rms_norm_eps", true, &c.rms_norm_eps));
  HF_RETURN_IF_ERROR(r.Int(text, tp, "max_position_embeddings", true, &c.max_position_embeddings));
  HF_RETURN_IF_ERROR(ParseRope(r, text, tp, &c));
  HF_RETURN_IF_ERROR(r.Bool(text, "tie_word_embeddings", &c.tie_word_embeddings));

  bool attention_bias = false;
  HF_RETURN_IF_ERROR(r.Bool(text, "attention_bias", &attention_bias));
  if (c.model_type == "qwen2") {
    // Qwen2 hard-codes bias on q/k/v and none on o_proj; its config has no switch.
    c.attention_bias = true;
    c.o_proj_bias = false;
  } else {
    c.attention_bias = attention_bias;
    c.o_proj_bias = attention_bias;
  }
  HF_RETURN_IF_ERROR(r.Bool(text, "mlp_bias", &c.mlp_bias));
  c.qk_norm = c.model_type == "qwen3" || IsQwen3_5Text(c.model_type) ||
              c.model_type == "qwen3_moe";
  if (IsQwen3_5Text(c.model_type)) HF_RETURN_IF_ERROR(ParseHybrid(r, text, tp, &c));
  if (c.model_type == "qwen3_moe" || c.model_type == "qwen3_5_moe_text") {
    HF_RETURN_IF_ERROR(ParseMoe(r, text, tp, &c));
  }
  if (c.has_vision) {
    // The ConditionalGeneration model ties lm_head by its top-level flag; a text_config
    // that says otherwise would leave the engine unsure which head transformers uses.
    bool top_tie = c.tie_word_embeddings;
    HF_RETURN_IF_ERROR(r.Bool(root, "tie_word_embeddings", &top_tie));
    if (ConfigReader::Find(root, "tie_word_embeddings") != nullptr &&
        ConfigReader::Find(text, "tie_word_embeddings") != nullptr &&
        top_tie != c.tie_word_embeddings) {
      return r.Error("tie_word_embeddings", "disagrees with text_config.tie_word_embeddings");
    }
    c.tie_word_embeddings = top_tie;
  }

  // Features of these families that the engine does not implement: fail loudly.
  std::string act = "silu";
  HF_RETURN_IF_ERROR(r.String(text, tp, "hidden_act", false, &act));
  if (act != "silu") {
    return r.Error(tp + "hidden_act", absl::StrCat("unsupported activation '", act, "' (only silu)"));
  }
  bool sliding = false;
  HF_RETURN_IF_ERROR(r.Bool(text, "use_sliding_window", &sliding));
  if (sliding) return r.Error(tp + "use_sliding_window", "sliding-window attention is not supported");

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

std::map<std::string, std::vector<int64_t>> ExpectedWeightShapes(const ModelConfig& c,
                                                                 bool per_expert) {
  std::map<std::string, std::vector<int64_t>> shapes;
  const int64_t h = c.hidden_size;
  const int64_t q_dim = c.num_attention_heads * c.head_dim;
  const int64_t kv_dim = c.num_key_value_heads * c.head_dim;
  const int64_t ffn = c.intermediate_size;
  const std::string& m = c.text_prefix;  // "model." or "model.language_model."

  shapes[m + "embed_tokens.weight"] = {c.vocab_size, h};
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = absl::StrCat(m, "layers.", i, ".");
    if (c.is_linear_layer(i)) {
      const std::string la = p + "linear_attn.";
      const int64_t heads = c.linear_num_value_heads;
      shapes[la + "in_proj_qkv.weight"] = {c.linear_conv_dim(), h};
      shapes[la + "in_proj_z.weight"] = {c.linear_value_dim(), h};
      shapes[la + "in_proj_b.weight"] = {heads, h};
      shapes[la + "in_proj_a.weight"] = {heads, h};
      shapes[la + "conv1d.weight"] = {c.linear_conv_dim(), 1, c.linear_conv_kernel};
      shapes[la + "dt_bias"] = {heads};
      shapes[la + "A_log"] = {heads};
      shapes[la + "norm.weight"] = {c.linear_value_head_dim};
      shapes[la + "out_proj.weight"] = {h, c.linear_value_dim()};
    } else {
      // A gated q_proj emits [query | gate] per head.
      shapes[p + "self_attn.q_proj.weight"] = {c.attn_output_gate ? 2 * q_dim : q_dim, h};
      shapes[p + "self_attn.k_proj.weight"] = {kv_dim, h};
      shapes[p + "self_attn.v_proj.weight"] = {kv_dim, h};
      shapes[p + "self_attn.o_proj.weight"] = {h, q_dim};
      if (c.attention_bias) {
        shapes[p + "self_attn.q_proj.bias"] = {c.attn_output_gate ? 2 * q_dim : q_dim};
        shapes[p + "self_attn.k_proj.bias"] = {kv_dim};
        shapes[p + "self_attn.v_proj.bias"] = {kv_dim};
      }
      if (c.o_proj_bias) shapes[p + "self_attn.o_proj.bias"] = {h};
      if (c.qk_norm) {
        shapes[p + "self_attn.q_norm.weight"] = {c.head_dim};
        shapes[p + "self_attn.k_norm.weight"] = {c.head_dim};
      }
    }
    if (c.is_moe_layer(i)) {
      const int64_t experts = c.num_experts, width = c.moe_intermediate_size;
      shapes[p + "mlp.gate.weight"] = {experts, h};  // the router
      if (per_expert) {
        for (int64_t e = 0; e < experts; ++e) {
          const std::string x = absl::StrCat(p, "mlp.experts.", e, ".");
          shapes[x + "gate_proj.weight"] = {width, h};
          shapes[x + "up_proj.weight"] = {width, h};
          shapes[x + "down_proj.weight"] = {h, width};
        }
      } else {
        shapes[p + "mlp.experts.gate_up_proj"] = {experts, 2 * width, h};
        shapes[p + "mlp.experts.down_proj"] = {experts, h, width};
      }
      if (const int64_t shared = c.shared_expert_intermediate_size; shared > 0) {
        shapes[p + "mlp.shared_expert.gate_proj.weight"] = {shared, h};
        shapes[p + "mlp.shared_expert.up_proj.weight"] = {shared, h};
        shapes[p + "mlp.shared_expert.down_proj.weight"] = {h, shared};
        shapes[p + "mlp.shared_expert_gate.weight"] = {1, h};
      }
      shapes[p + "input_layernorm.weight"] = {h};
      shapes[p + "post_attention_layernorm.weight"] = {h};
      continue;
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
  shapes[m + "norm.weight"] = {h};
  if (!c.tie_word_embeddings) shapes["lm_head.weight"] = {c.vocab_size, h};
  return shapes;
}

#undef HF_RETURN_IF_ERROR

}  // namespace twinkle::engine
