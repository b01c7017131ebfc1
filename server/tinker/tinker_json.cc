#include "server/tinker/tinker_json.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace twinkle::tinker {
namespace {

using Json = nlohmann::json;

const Json* Find(const Json& body, const char* key) {
  if (!body.is_object()) return nullptr;
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

template <typename T>
std::vector<T> Read(const std::string& bytes) {
  std::vector<T> out(bytes.size() / sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));
  return out;
}

size_t ItemSize(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32:
    case v1::DTYPE_INT32:
      return 4;
    case v1::DTYPE_INT64:
      return 8;
    case v1::DTYPE_BFLOAT16:
      return 2;
    default:
      return 0;
  }
}

absl::StatusOr<std::vector<double>> Decode(const std::string& bytes, v1::DType dtype, const std::string& field) {
  const size_t item = ItemSize(dtype);
  if (item == 0) return absl::InvalidArgumentError(absl::StrCat(field, ": unsupported dtype ", dtype));
  if (bytes.size() % item != 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", bytes.size(), " bytes are not a whole number of ",
                                                   item, "-byte elements"));
  }
  std::vector<double> out;
  out.reserve(bytes.size() / item);
  switch (dtype) {
    case v1::DTYPE_FLOAT32:
      for (float v : Read<float>(bytes)) out.push_back(v);
      break;
    case v1::DTYPE_INT32:
      for (int32_t v : Read<int32_t>(bytes)) out.push_back(v);
      break;
    case v1::DTYPE_INT64:
      for (int64_t v : Read<int64_t>(bytes)) out.push_back(static_cast<double>(v));
      break;
    case v1::DTYPE_BFLOAT16:
      for (uint16_t v : Read<uint16_t>(bytes)) {
        const uint32_t bits = static_cast<uint32_t>(v) << 16;
        float f;
        std::memcpy(&f, &bits, sizeof(f));
        out.push_back(f);
      }
      break;
    default:
      break;
  }
  return out;
}

constexpr size_t kMaxDenseElements = size_t{1} << 26;

// Shapes as declared by the tensors (absent or empty: 1-D).
using Shapes = std::map<std::string, std::vector<int64_t>>;

absl::StatusOr<training::TokenDatum> BuildDatum(std::vector<int64_t> tokens,
                                                std::map<std::string, std::vector<double>> inputs,
                                                const Shapes& shapes, const std::string& field) {
  training::TokenDatum d;
  d.input_tokens = std::move(tokens);
  auto targets = inputs.find("target_tokens");
  if (targets == inputs.end()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".loss_fn_inputs.target_tokens: missing"));
  }
  // Soft targets (the cookbook's top-k distillation): target_tokens [N, K], and inputs of the
  // same shape (weights); 1-D inputs stay per position.
  const int64_t n = static_cast<int64_t>(d.input_tokens.size());
  for (const auto& [name, shape] : shapes) {
    if (shape.size() > 2 || (shape.size() == 2 && shape[0] != n)) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".loss_fn_inputs.", name, ": shape [",
                                                     absl::StrJoin(shape, ", "), "] is neither [", n, "] nor [", n,
                                                     ", K] (one row per model_input token)"));
    }
  }
  if (auto ts = shapes.find("target_tokens"); ts != shapes.end() && ts->second.size() == 2) {
    const int64_t k = ts->second[1];
    if (k < 1 || k > kMaxTargetWidth) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".loss_fn_inputs.target_tokens: K = ", k,
                                                     " targets per position must be in [1, ", kMaxTargetWidth, "]"));
    }
    d.target_width = k;
    for (const auto& [name, shape] : shapes) {
      if (shape.size() == 2 && shape[1] != k) {
        return absl::InvalidArgumentError(absl::StrCat(field, ".loss_fn_inputs.", name, ": shape [", shape[0], ", ",
                                                       shape[1], "] differs from target_tokens' [", n, ", ", k, "]"));
      }
    }
  } else {
    for (const auto& [name, shape] : shapes) {
      if (shape.size() == 2) {
        return absl::InvalidArgumentError(absl::StrCat(field, ".loss_fn_inputs.", name,
                                                       ": 2-D, but target_tokens is 1-D (soft targets need both [N, K])"));
      }
    }
  }
  for (double v : targets->second) {
    if (v != std::floor(v) || !std::isfinite(v)) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".loss_fn_inputs.target_tokens: not integers"));
    }
    // Converting a double outside int64's range is undefined behaviour, not a big token id.
    if (!(std::fabs(v) < 0x1p63)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".loss_fn_inputs.target_tokens: ", v, " is not a token id"));
    }
    d.target_tokens.push_back(static_cast<int64_t>(v));
  }
  inputs.erase(targets);
  for (auto& [name, values] : inputs) {
    d.inputs[name] = std::vector<float>(values.begin(), values.end());
  }
  return d;
}

}  // namespace

bool NestedDeeperThan(absl::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return true;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return false;
}

absl::StatusOr<Json> ParseJsonBody(absl::string_view body) {
  if (body.empty()) return Json::object();
  if (NestedDeeperThan(body, kMaxJsonDepth)) {
    return absl::InvalidArgumentError(absl::StrCat("body: JSON nested deeper than ", kMaxJsonDepth, " levels"));
  }
  Json j = Json::parse(body.begin(), body.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) return absl::InvalidArgumentError("body: expected a JSON object");
  return j;
}

absl::StatusOr<std::string> GetString(const Json& body, const char* key) {
  const Json* v = Find(body, key);
  if (v == nullptr) return absl::InvalidArgumentError(absl::StrCat(key, ": missing"));
  if (!v->is_string()) return absl::InvalidArgumentError(absl::StrCat(key, ": expected a string"));
  return v->get<std::string>();
}

absl::StatusOr<std::string> GetString(const Json& body, const char* key, const std::string& fallback) {
  if (Find(body, key) == nullptr) return fallback;
  return GetString(body, key);
}

absl::StatusOr<int64_t> GetInt(const Json& body, const char* key, int64_t fallback) {
  const Json* v = Find(body, key);
  if (v == nullptr) return fallback;
  if (v->is_number_integer()) return v->get<int64_t>();
  if (v->is_number_unsigned()) return static_cast<int64_t>(v->get<uint64_t>());
  if (v->is_number_float()) {
    const double d = v->get<double>();
    if (d == std::floor(d) && std::fabs(d) < 9e18) return static_cast<int64_t>(d);
  }
  int64_t parsed = 0;
  if (v->is_string() && absl::SimpleAtoi(v->get<std::string>(), &parsed)) return parsed;
  return absl::InvalidArgumentError(absl::StrCat(key, ": expected an integer"));
}

absl::StatusOr<double> GetDouble(const Json& body, const char* key, double fallback) {
  const Json* v = Find(body, key);
  if (v == nullptr) return fallback;
  if (v->is_number()) {
    const double d = v->get<double>();
    if (!std::isfinite(d)) return absl::InvalidArgumentError(absl::StrCat(key, ": not finite"));
    return d;
  }
  return absl::InvalidArgumentError(absl::StrCat(key, ": expected a number"));
}

absl::StatusOr<bool> GetBool(const Json& body, const char* key, bool fallback) {
  const Json* v = Find(body, key);
  if (v == nullptr) return fallback;
  if (v->is_boolean()) return v->get<bool>();
  return absl::InvalidArgumentError(absl::StrCat(key, ": expected true or false"));
}

Json FiniteOrNull(const std::vector<float>& values) {
  Json a = Json::array();
  for (float v : values) a.push_back(std::isfinite(v) ? Json(v) : Json(nullptr));
  return a;
}

absl::StatusOr<std::vector<double>> TensorValues(const v1::Tensor& tensor, const std::string& field,
                                                 size_t max_elements) {
  if (tensor.has_sparse_csr()) {
    if (tensor.shape_size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": a sparse (CSR) tensor needs a 2-D shape"));
    }
    const int64_t rows = tensor.shape(0), cols = tensor.shape(1);
    // Checked before densifying: a 132-byte tensor can declare a shape of 2^26 elements.
    const double elements = static_cast<double>(rows) * static_cast<double>(cols);
    if (rows < 0 || cols < 0 || elements > static_cast<double>(std::min(max_elements, kMaxDenseElements))) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": sparse tensor of shape [", rows, ", ", cols, "] is larger than the ", max_elements,
          " elements a loss_fn_input may hold (kMaxTargetWidth per model_input token)"));
    }
    absl::StatusOr<std::vector<double>> values = Decode(tensor.sparse_csr().values(), tensor.dtype(), field);
    if (!values.ok()) return values.status();
    const std::vector<int64_t> crow = Read<int64_t>(tensor.sparse_csr().crow_indices());
    const std::vector<int64_t> col = Read<int64_t>(tensor.sparse_csr().col_indices());
    // rows is compared as a size: rows + 1 overflows int64 when cols is 0 and rows the maximum.
    if (crow.size() != static_cast<size_t>(rows) + 1 || col.size() != values->size() ||
        crow.back() != static_cast<int64_t>(values->size())) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": inconsistent CSR indices"));
    }
    // Every row's range must lie inside the values before any is read: checking row r against
    // row r + 1 alone let crow [0, 100, 2] read 100 col_indices of 2.
    if (crow[0] < 0) return absl::InvalidArgumentError(absl::StrCat(field, ": bad crow_indices"));
    for (size_t r = 0; r + 1 < crow.size(); ++r) {
      if (crow[r] > crow[r + 1]) return absl::InvalidArgumentError(absl::StrCat(field, ": bad crow_indices"));
    }
    std::vector<double> dense(static_cast<size_t>(rows * cols), 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t k = crow[r]; k < crow[r + 1]; ++k) {
        if (col[k] < 0 || col[k] >= cols) return absl::InvalidArgumentError(absl::StrCat(field, ": bad col_indices"));
        dense[r * cols + col[k]] = (*values)[k];
      }
    }
    return dense;
  }
  absl::StatusOr<std::vector<double>> values = Decode(tensor.dense(), tensor.dtype(), field);
  if (!values.ok()) return values.status();
  if (tensor.shape_size() > 0) {
    double n = 1;
    for (int64_t d : tensor.shape()) n *= static_cast<double>(d);
    if (n != static_cast<double>(values->size())) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": shape holds ", n, " elements, data ", values->size()));
    }
  }
  return values;
}

absl::StatusOr<training::TokenDatum> DatumFromProto(const v1::Datum& datum, const std::string& field) {
  std::vector<int64_t> tokens;
  for (int i = 0; i < datum.model_input_size(); ++i) {
    const v1::Chunk& c = datum.model_input(i);
    if (!c.has_encoded_text()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".model_input.chunks[", i, "]: only encoded_text chunks are supported (text models)"));
    }
    const std::string& bytes = c.encoded_text().tokens();
    if (bytes.size() % 4 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".model_input.chunks[", i, "]: tokens are not int32"));
    }
    for (int32_t t : Read<int32_t>(bytes)) tokens.push_back(t);
  }
  std::map<std::string, std::vector<double>> inputs;
  Shapes shapes;
  for (const auto& [name, tensor] : datum.loss_fn_inputs()) {
    absl::StatusOr<std::vector<double>> values =
        TensorValues(tensor, absl::StrCat(field, ".loss_fn_inputs.", name), tokens.size() * kMaxTargetWidth);
    if (!values.ok()) return values.status();
    inputs[name] = *std::move(values);
    shapes[name] = std::vector<int64_t>(tensor.shape().begin(), tensor.shape().end());
  }
  return BuildDatum(std::move(tokens), std::move(inputs), shapes, field);
}

absl::StatusOr<std::vector<int64_t>> TokensFromModelInput(const Json& model_input, const std::string& field) {
  const Json* chunks = Find(model_input, "chunks");
  if (chunks == nullptr || !chunks->is_array()) return absl::InvalidArgumentError(absl::StrCat(field, ".chunks: missing"));
  std::vector<int64_t> tokens;
  for (size_t i = 0; i < chunks->size(); ++i) {
    const Json& c = (*chunks)[i];
    const std::string type = c.is_object() && c.contains("type") && c["type"].is_string() ? c["type"].get<std::string>()
                                                                                           : "encoded_text";
    const Json* t = Find(c, "tokens");
    if (type != "encoded_text" || t == nullptr || !t->is_array()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".chunks[", i, "]: only encoded_text chunks are supported (text models)"));
    }
    for (const Json& v : *t) {
      if (!v.is_number_integer()) return absl::InvalidArgumentError(absl::StrCat(field, ".chunks[", i, "].tokens: not integers"));
      tokens.push_back(v.get<int64_t>());
    }
  }
  return tokens;
}

absl::StatusOr<training::TokenDatum> DatumFromJson(const Json& datum, const std::string& field) {
  const Json* mi = Find(datum, "model_input");
  if (mi == nullptr) return absl::InvalidArgumentError(absl::StrCat(field, ".model_input: missing"));
  absl::StatusOr<std::vector<int64_t>> tokens = TokensFromModelInput(*mi, absl::StrCat(field, ".model_input"));
  if (!tokens.ok()) return tokens.status();
  std::map<std::string, std::vector<double>> inputs;
  Shapes shapes;
  const Json* lfi = Find(datum, "loss_fn_inputs");
  if (lfi != nullptr && lfi->is_object()) {
    for (const auto& [name, value] : lfi->items()) {
      if (const Json* shape = Find(value, "shape"); shape != nullptr && shape->is_array()) {
        for (const Json& v : *shape) {
          if (!v.is_number_integer()) {
            return absl::InvalidArgumentError(absl::StrCat(field, ".loss_fn_inputs.", name, ".shape: not integers"));
          }
          shapes[name].push_back(v.get<int64_t>());
        }
      }
      const Json* data = value.is_array() ? &value : Find(value, "data");
      if (data == nullptr || !data->is_array()) {
        return absl::InvalidArgumentError(absl::StrCat(field, ".loss_fn_inputs.", name, ": expected TensorData"));
      }
      std::vector<double> values;
      for (const Json& v : *data) {
        if (!v.is_number()) return absl::InvalidArgumentError(absl::StrCat(field, ".loss_fn_inputs.", name, ": not numbers"));
        values.push_back(v.get<double>());
      }
      inputs[name] = std::move(values);
    }
  }
  return BuildDatum(*std::move(tokens), std::move(inputs), shapes, field);
}

namespace {

// The longest string a loss config value may be: the engine's string options are short
// names ("mean", "sigmoid"); anything longer is refused here, before it is copied onward.
constexpr size_t kMaxLossConfigString = 256;

absl::Status CheckLossConfigString(const std::string& key, const std::string& value) {
  if (value.size() <= kMaxLossConfigString) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("loss_fn_config.", key, ": a string of ", value.size(),
                                                 " bytes exceeds the limit of ", kMaxLossConfigString));
}

}  // namespace

absl::StatusOr<training::LossOverride> LossFromProto(const v1::ForwardBackwardRequest& request) {
  training::LossOverride loss;
  loss.name = request.loss_fn().empty() ? "cross_entropy" : request.loss_fn();
  if (request.loss_fn_config_v2_size() > 0) {
    for (const auto& [key, value] : request.loss_fn_config_v2()) {
      if (value.has_text()) {
        if (absl::Status s = CheckLossConfigString(key, value.text()); !s.ok()) return s;
        loss.string_config[key] = value.text();
      } else {
        loss.config[key] = value.number();
      }
    }
  } else {
    for (const auto& [key, value] : request.loss_fn_config()) loss.config[key] = value;
  }
  for (const auto& [key, value] : loss.config) {
    if (!std::isfinite(value)) return absl::InvalidArgumentError(absl::StrCat("loss_fn_config.", key, ": not finite"));
  }
  return loss;
}

absl::StatusOr<training::LossOverride> LossFromJson(const Json& input) {
  training::LossOverride loss;
  absl::StatusOr<std::string> name = GetString(input, "loss_fn", "cross_entropy");
  if (!name.ok()) return name.status();
  loss.name = *name;
  const Json* config = Find(input, "loss_fn_config");
  if (config != nullptr && config->is_object()) {
    for (const auto& [key, value] : config->items()) {
      if (value.is_number()) {
        loss.config[key] = value.get<double>();
      } else if (value.is_string()) {
        if (absl::Status s = CheckLossConfigString(key, value.get_ref<const std::string&>()); !s.ok()) {
          return s;
        }
        loss.string_config[key] = value.get<std::string>();
      } else {
        return absl::InvalidArgumentError(absl::StrCat("loss_fn_config.", key, ": expected a number or a string"));
      }
    }
  }
  return loss;
}

}  // namespace twinkle::tinker
