// libFuzzer entry point for the Tinker HTTP routes' JSON bodies: the body goes through
// ParseJsonBody (the depth guard, then nlohmann) and, when it is an object, through the
// decoders the routes apply to it (forward_backward's datums and loss, sample's prompt and
// sampling_params, create_model's lora_config, optim_step's adam_params, the scalar getters).
// Invariants: no crash or sanitizer report; a parsed body is an object nesting at most
// kMaxJsonDepth levels and dumps without throwing; a decoded datum never keeps target_tokens
// among its float inputs.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "server/tinker/tinker_json.h"

namespace {

using Json = nlohmann::json;
namespace tk = twinkle::tinker;

// Depth of a parsed tree, without recursion (the fuzzer's own check must not overflow).
int Depth(const Json& root) {
  int deepest = 0;
  std::vector<std::pair<const Json*, int>> stack = {{&root, 1}};
  while (!stack.empty()) {
    auto [j, d] = stack.back();
    stack.pop_back();
    if (!j->is_structured()) continue;
    deepest = std::max(deepest, d);
    for (const Json& child : *j) stack.emplace_back(&child, d + 1);
  }
  return deepest;
}

// The fields every route reads with the lenient getters.
void Scalars(const Json& body) {
  for (const char* key : {"session_id", "model_id", "path", "base_model", "request_id", "model_path",
                          "sampling_session_id", "tinker_path"}) {
    (void)tk::GetString(body, key);
    (void)tk::GetString(body, key, "fallback");
  }
  for (const char* key : {"seq_id", "model_seq_id", "num_samples", "sampling_session_seq_id", "max_tokens", "top_k",
                          "seed", "rank", "prompt_logprobs_last_n", "topk_prompt_logprobs"}) {
    (void)tk::GetInt(body, key, -1);
  }
  for (const char* key : {"temperature", "top_p", "learning_rate", "beta1", "beta2", "eps", "weight_decay"}) {
    (void)tk::GetDouble(body, key, 1.0);
  }
  for (const char* key : {"forward_only", "prompt_logprobs", "optimizer", "overwrite", "train_attn"}) {
    (void)tk::GetBool(body, key, false);
  }
}

void CheckDatum(const twinkle::training::TokenDatum& d) {
  for (const auto& [name, values] : d.inputs) {
    if (name == "target_tokens") std::abort();  // BuildDatum moves it into target_tokens
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<Json> body = tk::ParseJsonBody(text);
  if (!body.ok()) return 0;
  if (!body->is_object() || Depth(*body) > tk::kMaxJsonDepth) std::abort();
  // Error replies and outcomes are printed with dump(); it must not throw on any parsed value.
  (void)body->dump(-1, ' ', false, Json::error_handler_t::replace);

  Scalars(*body);
  for (const char* section : {"lora_config", "sampling_params", "adam_params", "optimizer_params"}) {
    if (body->contains(section)) Scalars((*body)[section]);
  }
  // forward_backward / forward (TinkerApi::ForwardBackwardJson).
  for (const char* key : {"forward_backward_input", "forward_input"}) {
    if (!body->contains(key) || !(*body)[key].is_object()) continue;
    const Json& input = (*body)[key];
    (void)tk::LossFromJson(input);
    if (!input.contains("data") || !input["data"].is_array()) continue;
    for (size_t i = 0; i < input["data"].size(); ++i) {
      absl::StatusOr<twinkle::training::TokenDatum> d = tk::DatumFromJson(input["data"][i], absl::StrCat("data[", i, "]"));
      if (d.ok()) CheckDatum(*d);
    }
  }
  // asample (DecodeSample, tinker_decode.cc).
  if (body->contains("prompt")) (void)tk::TokensFromModelInput((*body)["prompt"], "prompt");
  return 0;
}
