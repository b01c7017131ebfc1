#pragma once
// Decoding the Tinker SDK's request bodies: lenient JSON field access (unknown keys ignored,
// null = absent, integers also as decimal strings: protobuf's JSON form of int64), and the
// datums and loss settings of forward_backward in both protobuf and JSON form. Errors are
// InvalidArgument naming the field as the SDK spells it.

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/training/types.h"
#include "tinker/v1/tinker_public.pb.h"

namespace twinkle::tinker {

namespace v1 = ::tinker::v1;  // the generated wire messages

// JSON nested deeper than this is refused before it is parsed: nlohmann's tree is freed and
// printed recursively, so a body of 300k '[' would exhaust the stack. Tinker's deepest
// legitimate body (a datum's loss_fn_inputs in a forward_backward) nests 7 levels.
inline constexpr int kMaxJsonDepth = 64;

// The most targets per position a datum's 2-D (soft) target_tokens [N, K] may carry
// (docs/config.md); the cookbook's top-k distillation sends K = 20.
inline constexpr int64_t kMaxTargetWidth = 64;

// Whether `text` opens more than `max_depth` arrays/objects at once (brackets inside strings
// do not count). Linear, no allocation.
bool NestedDeeperThan(absl::string_view text, int max_depth);

// An HTTP request body as every JSON route takes it: empty = {}, otherwise a JSON object
// nested at most kMaxJsonDepth levels; anything else is InvalidArgument.
absl::StatusOr<nlohmann::json> ParseJsonBody(absl::string_view body);

// Required string (no default) or optional with a default.
absl::StatusOr<std::string> GetString(const nlohmann::json& body, const char* key);
absl::StatusOr<std::string> GetString(const nlohmann::json& body, const char* key, const std::string& fallback);
absl::StatusOr<int64_t> GetInt(const nlohmann::json& body, const char* key, int64_t fallback);
absl::StatusOr<double> GetDouble(const nlohmann::json& body, const char* key, double fallback);
absl::StatusOr<bool> GetBool(const nlohmann::json& body, const char* key, bool fallback);

// Values as a JSON array, non-finite ones as null (orjson rejects NaN / Infinity).
nlohmann::json FiniteOrNull(const std::vector<float>& values);

// Tensor → flat values (dense or CSR; float32, bfloat16, int64 or int32). A CSR tensor whose
// shape holds more than `max_elements` is refused before it is densified.
absl::StatusOr<std::vector<double>> TensorValues(const v1::Tensor& tensor, const std::string& field,
                                                 size_t max_elements);

// A datum: model_input tokens (encoded_text chunks only) and loss_fn_inputs;
// target_tokens becomes the targets, every other input a float per position. target_tokens
// of shape [N, K] (K <= kMaxTargetWidth) are soft targets: inputs may then be [N, K] too.
absl::StatusOr<training::TokenDatum> DatumFromProto(const v1::Datum& datum, const std::string& field);
absl::StatusOr<training::TokenDatum> DatumFromJson(const nlohmann::json& datum, const std::string& field);

// loss_fn and loss_fn_config (v2 preferred: numbers and strings).
absl::StatusOr<training::LossOverride> LossFromProto(const v1::ForwardBackwardRequest& request);
absl::StatusOr<training::LossOverride> LossFromJson(const nlohmann::json& input);

// ModelInput JSON ({"chunks": [...]}) → token ids.
absl::StatusOr<std::vector<int64_t>> TokensFromModelInput(const nlohmann::json& model_input, const std::string& field);

}  // namespace twinkle::tinker
