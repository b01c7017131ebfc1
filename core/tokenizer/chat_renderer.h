#pragma once
// Chat rendering: OpenAI-style messages → the prompt text a model family was trained on.
// Named renderers, written in C++ (no Jinja runtime), each token-equal to transformers'
// apply_chat_template with that family's own template:
//   "qwen3"    Qwen3 ChatML (<|im_start|>role\n…<|im_end|>), thinking on or off, tools
//   "qwen3_5"  Qwen3.5's variant of the same
//   "llama3"   Llama 3 (<|start_header_id|>role<|end_header_id|>\n\n…<|eot_id|>)
//   "chatml"   the generic ChatML renderer, used only when the config asks for it
//
// An empty reasoning_content counts as absent (the templates then look for <think> in the
// content); ToolCall::arguments_json must be a JSON object for the families that expand it.

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace twinkle::tokenizer {

struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments_json;  // the function's arguments as a JSON object text
};

struct ChatMessage {
  std::string role;  // "system" | "user" | "assistant" | "tool"
  std::string content;
  std::string reasoning_content;  // assistant thinking, for templates that render it
  std::vector<ToolCall> tool_calls;  // assistant
  std::string tool_call_id;  // tool
};

struct RenderOptions {
  bool add_generation_prompt = true;
  bool enable_thinking = true;  // families with a thinking switch (Qwen3, Qwen3.5)
  std::string tools_json;  // OpenAI "tools" array as JSON text; empty = none
  // Assistant prefill: the final message is left open for the model to continue (transformers'
  // continue_final_message). Exclusive with add_generation_prompt.
  bool continue_final_message = false;
};

class ChatRenderer {
 public:
  virtual ~ChatRenderer() = default;
  virtual std::string_view name() const = 0;
  // InvalidArgument naming the message index and what is wrong (unknown role, tool calls on
  // a family without tools, ...).
  virtual absl::StatusOr<std::string> Render(absl::Span<const ChatMessage> messages,
                                             const RenderOptions& options) const = 0;
};

// By name (above); NotFound listing the known names otherwise.
absl::StatusOr<std::unique_ptr<ChatRenderer>> MakeChatRenderer(std::string_view name);

// The renderer name whose family template `chat_template` is (compared modulo whitespace), or
// "" when it is none of them.
std::string_view RecognizeChatTemplate(std::string_view chat_template);

// Picks the renderer for a model directory from its config.json model_type and its chat
// template (chat_template.jinja or tokenizer_config.json's chat_template). FailedPrecondition
// naming the model type when no renderer is known for it and `fallback` is empty; otherwise
// MakeChatRenderer(fallback).
absl::StatusOr<std::unique_ptr<ChatRenderer>> ChatRendererForModel(const std::string& model_dir,
                                                                   std::string_view fallback);

}  // namespace twinkle::tokenizer
