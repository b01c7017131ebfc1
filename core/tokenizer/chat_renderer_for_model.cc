// ChatRendererForModel and RecognizeChatTemplate: which renderer a model directory gets.
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/tokenizer/chat_renderer.h"

namespace twinkle::tokenizer {
namespace {

struct KnownTemplate {
  std::string_view renderer;
  std::string_view text;
};

// core/tokenizer/templates/*.jinja, compiled in by CMake.
constexpr KnownTemplate kKnownTemplates[] = {
#include "core/tokenizer/chat_templates.inc"
};

absl::string_view AV(std::string_view s) { return absl::string_view(s.data(), s.size()); }

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(path);
  std::stringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

// The template without its whitespace: templates are compared modulo layout only.
std::string Squeeze(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c != ' ' && c != '\n' && c != '\t' && c != '\r') out.push_back(c);
  }
  return out;
}

}  // namespace

std::string_view RecognizeChatTemplate(std::string_view chat_template) {
  const std::string squeezed = Squeeze(chat_template);
  for (const KnownTemplate& known : kKnownTemplates) {
    if (Squeeze(known.text) == squeezed) return known.renderer;
  }
  return "";
}

absl::StatusOr<std::unique_ptr<ChatRenderer>> ChatRendererForModel(const std::string& model_dir,
                                                                   std::string_view fallback) {
  // The template: chat_template.jinja, else tokenizer_config.json's chat_template string.
  std::string chat_template;
  if (absl::StatusOr<std::string> t = ReadFile(model_dir + "/chat_template.jinja"); t.ok()) {
    chat_template = *std::move(t);
  } else if (absl::StatusOr<std::string> cfg = ReadFile(model_dir + "/tokenizer_config.json"); cfg.ok()) {
    nlohmann::json j = nlohmann::json::parse(*cfg, nullptr, false);
    if (j.is_object() && j.contains("chat_template") && j["chat_template"].is_string()) {
      chat_template = j["chat_template"].get<std::string>();
    }
  }
  std::string model_type;
  if (absl::StatusOr<std::string> cfg = ReadFile(model_dir + "/config.json"); cfg.ok()) {
    nlohmann::json j = nlohmann::json::parse(*cfg, nullptr, false);
    if (j.is_object() && j.contains("model_type") && j["model_type"].is_string()) {
      model_type = j["model_type"].get<std::string>();
    }
  }
  if (!chat_template.empty()) {
    // Only a family's own template: a variant (a fine-tune's edit) may render differently.
    const std::string_view name = RecognizeChatTemplate(chat_template);
    if (!name.empty()) return MakeChatRenderer(name);
  } else if (model_type == "qwen3" || model_type == "qwen3_moe") {
    return MakeChatRenderer("qwen3");
  } else if (model_type == "qwen3_5" || model_type == "qwen3_5_text" || model_type == "qwen3_5_moe" ||
             model_type == "qwen3_5_moe_text") {
    return MakeChatRenderer("qwen3_5");
  } else if (model_type == "llama") {
    return MakeChatRenderer("llama3");
  }
  if (!fallback.empty()) return MakeChatRenderer(fallback);
  return absl::FailedPreconditionError(absl::StrCat(
      AV(model_dir), ": no chat renderer for model_type '", AV(model_type), "' with ",
      chat_template.empty() ? "no chat template" : "an unrecognized chat template",
      " (known: qwen3, qwen3_5, llama3, llama3_0, chatml; a generic one can be configured as the fallback)"));
}

}  // namespace twinkle::tokenizer
