#include "core/tokenizer/chat_renderer.h"

#include <array>
#include <charconv>
#include <cstdio>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/tokenizer/utf8.h"

namespace twinkle::tokenizer {
namespace {

using OJson = nlohmann::ordered_json;

absl::string_view AV(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// Appends string-likes (std::string_view, which Debian's absl::StrAppend does not take).
template <typename... Args>
void Cat(std::string& out, const Args&... args) {
  (out.append(std::string_view(args)), ...);
}

// ---- Python string semantics the templates rely on (Jinja's trim is str.strip()) -------------

// Python's str.isspace().
bool IsPySpace(int32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

// The start of the code point that ends just before byte `end` (valid UTF-8).
size_t PrevStart(std::string_view s, size_t end) {
  size_t i = end - 1;
  while (i > 0 && utf8::IsContinuation(static_cast<unsigned char>(s[i]))) --i;
  return i;
}

// str.lstrip()/rstrip()/strip() with no argument (Unicode whitespace), or with `chars` (every
// character in it; the templates only pass ASCII).
std::string_view PyLStrip(std::string_view s, std::string_view chars = {}) {
  size_t i = 0;
  while (i < s.size()) {
    size_t j = i;
    const int32_t cp = utf8::DecodeAt(s, j);
    const bool strip = chars.empty() ? IsPySpace(cp) : (cp < 0x80 && chars.find(static_cast<char>(cp)) != std::string_view::npos);
    if (!strip) break;
    i = j;
  }
  return s.substr(i);
}
std::string_view PyRStrip(std::string_view s, std::string_view chars = {}) {
  size_t end = s.size();
  while (end > 0) {
    const size_t start = PrevStart(s, end);
    size_t j = start;
    const int32_t cp = utf8::DecodeAt(s, j);
    const bool strip = chars.empty() ? IsPySpace(cp) : (cp < 0x80 && chars.find(static_cast<char>(cp)) != std::string_view::npos);
    if (!strip) break;
    end = start;
  }
  return s.substr(0, end);
}
std::string_view PyStrip(std::string_view s, std::string_view chars = {}) { return PyRStrip(PyLStrip(s, chars), chars); }

// s.split(sep)[0] and s.split(sep)[-1].
std::string_view BeforeFirst(std::string_view s, std::string_view sep) {
  const size_t at = s.find(sep);
  return at == std::string_view::npos ? s : s.substr(0, at);
}
std::string_view AfterLast(std::string_view s, std::string_view sep) {
  const size_t at = s.rfind(sep);
  return at == std::string_view::npos ? s : s.substr(at + sep.size());
}

bool StartsWith(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }
bool EndsWith(std::string_view s, std::string_view p) { return s.size() >= p.size() && s.substr(s.size() - p.size()) == p; }

// ---- Python's json.dumps (transformers' tojson: ensure_ascii=False, key order kept) ----------

// Python's float repr: the shortest round-trip digits, exponent form below 1e-4 and from 1e16.
std::string PyFloat(double v) {
  if (v == 0) return std::signbit(v) ? "-0.0" : "0.0";
  std::array<char, 64> buf{};
  auto [end, ec] = std::to_chars(buf.data(), buf.data() + buf.size(), v, std::chars_format::scientific);
  std::string sci(buf.data(), end);  // e.g. "-1.2345e+02"
  const size_t e = sci.find('e');
  const int exponent = std::stoi(sci.substr(e + 1));
  std::string mantissa = sci.substr(0, e);
  const bool negative = mantissa[0] == '-';
  if (negative) mantissa.erase(0, 1);
  std::string digits;
  for (char c : mantissa) {
    if (c != '.') digits.push_back(c);
  }
  std::string out = negative ? "-" : "";
  if (exponent < -4 || exponent >= 16) {
    out += digits.substr(0, 1);
    if (digits.size() > 1) Cat(out, ".", digits.substr(1));
    char exp[8];
    std::snprintf(exp, sizeof(exp), "e%c%02d", exponent < 0 ? '-' : '+', exponent < 0 ? -exponent : exponent);
    return out + exp;
  }
  if (exponent < 0) {
    return out + "0." + std::string(static_cast<size_t>(-exponent - 1), '0') + digits;
  }
  const size_t int_len = static_cast<size_t>(exponent) + 1;
  if (digits.size() <= int_len) return out + digits + std::string(int_len - digits.size(), '0') + ".0";
  return out + digits.substr(0, int_len) + "." + digits.substr(int_len);
}

void PyJsonString(std::string_view s, std::string& out) {
  out.push_back('"');
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char esc[8];
          std::snprintf(esc, sizeof(esc), "\\u%04x", static_cast<unsigned char>(c));
          out += esc;
        } else {
          out.push_back(c);
        }
    }
  }
  out.push_back('"');
}

void PyJson(const OJson& v, int indent, int depth, std::string& out) {
  auto newline = [&](int d) {
    out.push_back('\n');
    out.append(static_cast<size_t>(indent * d), ' ');
  };
  switch (v.type()) {
    case OJson::value_t::null: out += "null"; return;
    case OJson::value_t::boolean: out += v.get<bool>() ? "true" : "false"; return;
    case OJson::value_t::number_integer: out += std::to_string(v.get<int64_t>()); return;
    case OJson::value_t::number_unsigned: out += std::to_string(v.get<uint64_t>()); return;
    case OJson::value_t::number_float: out += PyFloat(v.get<double>()); return;
    case OJson::value_t::string: PyJsonString(v.get_ref<const std::string&>(), out); return;
    case OJson::value_t::array: {
      if (v.empty()) {
        out += "[]";
        return;
      }
      out.push_back('[');
      bool first = true;
      for (const OJson& item : v) {
        if (!first) out += indent > 0 ? "," : ", ";
        first = false;
        if (indent > 0) newline(depth + 1);
        PyJson(item, indent, depth + 1, out);
      }
      if (indent > 0) newline(depth);
      out.push_back(']');
      return;
    }
    case OJson::value_t::object: {
      if (v.empty()) {
        out += "{}";
        return;
      }
      out.push_back('{');
      bool first = true;
      for (const auto& [key, item] : v.items()) {
        if (!first) out += indent > 0 ? "," : ", ";
        first = false;
        if (indent > 0) newline(depth + 1);
        PyJsonString(key, out);
        out += ": ";
        PyJson(item, indent, depth + 1, out);
      }
      if (indent > 0) newline(depth);
      out.push_back('}');
      return;
    }
    default: out += "null"; return;
  }
}

std::string ToJson(const OJson& v, int indent = 0) {
  std::string out;
  PyJson(v, indent, 0, out);
  return out;
}

// Jinja's `| string` on a JSON value (Python str()).
std::string PyStr(const OJson& v) {
  switch (v.type()) {
    case OJson::value_t::null: return "None";
    case OJson::value_t::boolean: return v.get<bool>() ? "True" : "False";
    case OJson::value_t::string: return v.get<std::string>();
    default: return ToJson(v);
  }
}

// ---- Shared checks ----------------------------------------------------------------------------

absl::Status MessageError(size_t index, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("messages[", index, "]: ", AV(what)));
}

absl::Status CheckMessages(absl::Span<const ChatMessage> messages) {
  if (messages.empty()) return absl::InvalidArgumentError("no messages");
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role != "system" && m.role != "user" && m.role != "assistant" && m.role != "tool") {
      return MessageError(i, absl::StrCat("unknown role '", m.role, "' (system, user, assistant, tool)"));
    }
    if (!m.tool_calls.empty() && m.role != "assistant") return MessageError(i, "tool_calls on a non-assistant message");
    for (const std::string* text : {&m.content, &m.reasoning_content}) {
      if (!utf8::IsValid(*text)) return MessageError(i, "content is not valid UTF-8");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<OJson>> ParseTools(const std::string& tools_json, bool* present) {
  *present = false;
  std::vector<OJson> tools;
  if (tools_json.empty()) return tools;
  OJson parsed = OJson::parse(tools_json, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded() || !parsed.is_array()) return absl::InvalidArgumentError("tools: not a JSON array");
  *present = true;
  for (OJson& t : parsed) tools.push_back(std::move(t));
  return tools;
}

absl::StatusOr<OJson> ParseArguments(size_t index, const ToolCall& call) {
  OJson args = OJson::parse(call.arguments_json.empty() ? std::string("{}") : call.arguments_json, nullptr, false);
  if (args.is_discarded() || !args.is_object()) {
    return MessageError(index, absl::StrCat("tool call '", AV(call.name), "': arguments are not a JSON object"));
  }
  return args;
}

// ---- Renderers --------------------------------------------------------------------------------

class RendererBase : public ChatRenderer {
 public:
  absl::StatusOr<std::string> Render(absl::Span<const ChatMessage> messages, const RenderOptions& options) const final {
    if (absl::Status s = CheckMessages(messages); !s.ok()) return s;
    if (!options.continue_final_message) return RenderAll(messages, options);
    // Assistant prefill as transformers does it (continue_final_message): render with a tag
    // after the final message's content, then cut the text at the tag.
    if (options.add_generation_prompt) {
      return absl::InvalidArgumentError("continue_final_message and add_generation_prompt are exclusive");
    }
    static constexpr std::string_view kTag = "CONTINUE_FINAL_MESSAGE_TAG ";
    std::vector<ChatMessage> tagged(messages.begin(), messages.end());
    tagged.back().content += kTag;
    absl::StatusOr<std::string> rendered = RenderAll(tagged, options);
    if (!rendered.ok()) return rendered;
    const std::string_view tag = PyRStrip(kTag);
    const size_t at = rendered->rfind(tag);
    if (at == std::string::npos || rendered->find(PyStrip(messages.back().content)) == std::string::npos) {
      return absl::InvalidArgumentError("continue_final_message: the final message does not appear in the rendered chat");
    }
    if (std::string_view(*rendered).substr(at, kTag.size()) == kTag) return rendered->substr(0, at);
    return std::string(PyRStrip(std::string_view(*rendered).substr(0, at)));
  }

 protected:
  virtual absl::StatusOr<std::string> RenderAll(absl::Span<const ChatMessage> messages,
                                                const RenderOptions& options) const = 0;
};

// models/tiny-qwen3's template and llama.cpp's ChatML: role and content, nothing else.
class ChatmlRenderer final : public RendererBase {
 public:
  std::string_view name() const override { return "chatml"; }

 protected:
  absl::StatusOr<std::string> RenderAll(absl::Span<const ChatMessage> messages, const RenderOptions& options) const override {
    if (!options.tools_json.empty()) return absl::InvalidArgumentError("tools: the chatml renderer has no tool format");
    std::string out;
    for (size_t i = 0; i < messages.size(); ++i) {
      if (!messages[i].tool_calls.empty()) return MessageError(i, "tool_calls: the chatml renderer has no tool format");
      Cat(out, "<|im_start|>", messages[i].role, "\n", messages[i].content, "<|im_end|>\n");
    }
    if (options.add_generation_prompt) out += "<|im_start|>assistant\n";
    return out;
  }
};

// Index of the last real user query (not a wrapped tool response), as Qwen's templates find it;
// nullopt when there is none.
std::optional<size_t> LastQueryIndex(absl::Span<const ChatMessage> messages, bool trim) {
  for (size_t k = messages.size(); k-- > 0;) {
    if (messages[k].role != "user") continue;
    const std::string_view c = trim ? PyStrip(messages[k].content) : std::string_view(messages[k].content);
    if (!(StartsWith(c, "<tool_response>") && EndsWith(c, "</tool_response>"))) return k;
  }
  return std::nullopt;
}

// Qwen/Qwen3-* tokenizer_config.json chat_template.
// Qwen3 and Qwen3.5 templates: an assistant turn's reasoning is its reasoning_content, or else
// the text before "</think>" in its content, which then keeps only what follows.
std::string_view SplitReasoning(const ChatMessage& m, std::string_view& content) {
  if (!m.reasoning_content.empty()) return m.reasoning_content;
  if (content.find("</think>") == std::string_view::npos) return {};
  const std::string_view reasoning =
      PyLStrip(AfterLast(PyRStrip(BeforeFirst(content, "</think>"), "\n"), "<think>"), "\n");
  content = PyLStrip(AfterLast(content, "</think>"), "\n");
  return reasoning;
}

// Qwen3 and Qwen3.5 templates: a run of tool results is one user turn of <tool_response>
// blocks. The Qwen3 template also opens that turn when the conversation starts with a tool
// result (`open_at_start`); Qwen3.5's does not.
void AppendToolResponse(absl::Span<const ChatMessage> messages, size_t i, std::string_view content,
                        bool open_at_start, std::string& out) {
  const bool first_of_run = i == 0 ? open_at_start : messages[i - 1].role != "tool";
  if (first_of_run) out += "<|im_start|>user";
  Cat(out, "\n<tool_response>\n", content, "\n</tool_response>");
  if (i + 1 == messages.size() || messages[i + 1].role != "tool") out += "<|im_end|>\n";
}

class Qwen3Renderer final : public RendererBase {
 public:
  std::string_view name() const override { return "qwen3"; }

 protected:
  absl::StatusOr<std::string> RenderAll(absl::Span<const ChatMessage> messages, const RenderOptions& options) const override {
    bool tools_present = false;
    absl::StatusOr<std::vector<OJson>> tools = ParseTools(options.tools_json, &tools_present);
    if (!tools.ok()) return tools.status();
    std::string out;
    if (!tools->empty()) {
      out += "<|im_start|>system\n";
      if (messages[0].role == "system") Cat(out, messages[0].content, "\n\n");
      out += "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
             "function signatures within <tools></tools> XML tags:\n<tools>";
      for (const OJson& t : *tools) Cat(out, "\n", ToJson(t));
      out += "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
             "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
             "<args-json-object>}\n</tool_call><|im_end|>\n";
    } else if (messages[0].role == "system") {
      Cat(out, "<|im_start|>system\n", messages[0].content, "<|im_end|>\n");
    }
    const size_t last_query = LastQueryIndex(messages, /*trim=*/false).value_or(messages.size() - 1);
    for (size_t i = 0; i < messages.size(); ++i) {
      const ChatMessage& m = messages[i];
      const bool last = i + 1 == messages.size();
      std::string_view content = m.content;
      if (m.role == "user" || (m.role == "system" && i > 0)) {
        Cat(out, "<|im_start|>", m.role, "\n", content, "<|im_end|>\n");
      } else if (m.role == "assistant") {
        const std::string_view reasoning = SplitReasoning(m, content);
        if (i > last_query && (last || !reasoning.empty())) {
          Cat(out, "<|im_start|>assistant\n<think>\n", PyStrip(reasoning, "\n"), "\n</think>\n\n",
                          PyLStrip(content, "\n"));
        } else {
          Cat(out, "<|im_start|>assistant\n", content);
        }
        for (size_t j = 0; j < m.tool_calls.size(); ++j) {
          const ToolCall& call = m.tool_calls[j];
          if ((j == 0 && !content.empty()) || j > 0) out += "\n";
          Cat(out, "<tool_call>\n{\"name\": \"", call.name, "\", \"arguments\": ", call.arguments_json,
                          "}\n</tool_call>");
        }
        out += "<|im_end|>\n";
      } else if (m.role == "tool") {
        AppendToolResponse(messages, i, content, /*open_at_start=*/true, out);
      }
    }
    if (options.add_generation_prompt) {
      out += "<|im_start|>assistant\n";
      if (!options.enable_thinking) out += "<think>\n\n</think>\n\n";
    }
    return out;
  }
};

// Qwen/Qwen3.5-* chat_template.jinja (tools as <function=…><parameter=…> blocks).
class Qwen35Renderer final : public RendererBase {
 public:
  std::string_view name() const override { return "qwen3_5"; }

 protected:
  absl::StatusOr<std::string> RenderAll(absl::Span<const ChatMessage> messages, const RenderOptions& options) const override {
    bool tools_present = false;
    absl::StatusOr<std::vector<OJson>> tools = ParseTools(options.tools_json, &tools_present);
    if (!tools.ok()) return tools.status();
    std::string out;
    if (!tools->empty()) {
      out += "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>";
      for (const OJson& t : *tools) Cat(out, "\n", ToJson(t));
      out += "\n</tools>";
      out += "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n"
             "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
             "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple "
             "lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow "
             "the specified format: an inner <function=...></function> block must be nested within "
             "<tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional "
             "reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If "
             "there is no function call available, answer the question like normal with your current knowledge and "
             "do not tell the user about function calls\n</IMPORTANT>";
      if (messages[0].role == "system") {
        const std::string_view c = PyStrip(messages[0].content);
        if (!c.empty()) Cat(out, "\n\n", c);
      }
      out += "<|im_end|>\n";
    } else if (messages[0].role == "system") {
      Cat(out, "<|im_start|>system\n", PyStrip(messages[0].content), "<|im_end|>\n");
    }
    const std::optional<size_t> last_query = LastQueryIndex(messages, /*trim=*/true);
    if (!last_query) return absl::InvalidArgumentError("no user query in the messages (the qwen3_5 template requires one)");
    for (size_t i = 0; i < messages.size(); ++i) {
      const ChatMessage& m = messages[i];
      std::string_view content = PyStrip(m.content);
      if (m.role == "system") {
        if (i > 0) return MessageError(i, "a system message must be the first (qwen3_5)");
      } else if (m.role == "user") {
        Cat(out, "<|im_start|>user\n", content, "<|im_end|>\n");
      } else if (m.role == "assistant") {
        const std::string_view reasoning = PyStrip(SplitReasoning(m, content));
        if (i > *last_query) {
          Cat(out, "<|im_start|>assistant\n<think>\n", reasoning, "\n</think>\n\n", content);
        } else {
          Cat(out, "<|im_start|>assistant\n", content);
        }
        for (size_t j = 0; j < m.tool_calls.size(); ++j) {
          const ToolCall& call = m.tool_calls[j];
          absl::StatusOr<OJson> args = ParseArguments(i, call);
          if (!args.ok()) return args.status();
          if (j > 0) {
            out += "\n<tool_call>\n<function=";
          } else if (!PyStrip(content).empty()) {
            out += "\n\n<tool_call>\n<function=";
          } else {
            out += "<tool_call>\n<function=";
          }
          Cat(out, call.name, ">\n");
          for (const auto& [key, value] : args->items()) {
            const std::string text = value.is_object() || value.is_array() ? ToJson(value) : PyStr(value);
            Cat(out, "<parameter=", key, ">\n", text, "\n</parameter>\n");
          }
          out += "</function>\n</tool_call>";
        }
        out += "<|im_end|>\n";
      } else if (m.role == "tool") {
        AppendToolResponse(messages, i, content, /*open_at_start=*/false, out);
      }
    }
    if (options.add_generation_prompt) {
      out += "<|im_start|>assistant\n";
      out += options.enable_thinking ? "<think>\n" : "<think>\n\n</think>\n\n";
    }
    return out;
  }
};

// meta-llama/Llama-3.1-*-Instruct (and 3.3) tokenizer_config.json chat_template: custom tools in
// the first user message (tools_in_user_message's default), one JSON tool call per assistant
// turn, tool results as ipython messages.
class Llama3Renderer final : public RendererBase {
 public:
  std::string_view name() const override { return "llama3"; }

 protected:
  absl::StatusOr<std::string> RenderAll(absl::Span<const ChatMessage> all, const RenderOptions& options) const override {
    bool tools_present = false;
    absl::StatusOr<std::vector<OJson>> tools = ParseTools(options.tools_json, &tools_present);
    if (!tools.ok()) return tools.status();
    std::string out = "<|begin_of_text|>";
    absl::Span<const ChatMessage> messages = all;
    size_t offset = 0;  // index of messages[0] in `all`
    std::string_view system_message;
    if (messages[0].role == "system") {
      system_message = PyStrip(messages[0].content);
      messages = messages.subspan(1);
      offset = 1;
    }
    out += "<|start_header_id|>system<|end_header_id|>\n\n";
    if (tools_present) out += "Environment: ipython\n";
    out += "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n";
    Cat(out, system_message, "<|eot_id|>");
    if (tools_present) {
      if (messages.empty()) return absl::InvalidArgumentError("tools need a first user message to go in (llama3)");
      const std::string_view first = PyStrip(messages[0].content);
      messages = messages.subspan(1);
      ++offset;
      out += "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON "
             "for a function call with its proper arguments that best answers the given prompt.\n\nRespond in the "
             "format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.Do not use "
             "variables.\n\n";
      for (const OJson& t : *tools) Cat(out, ToJson(t, 4), "\n\n");
      Cat(out, first, "<|eot_id|>");
    }
    for (size_t k = 0; k < messages.size(); ++k) {
      const ChatMessage& m = messages[k];
      if (m.role != "tool" && m.tool_calls.empty()) {
        Cat(out, "<|start_header_id|>", m.role, "<|end_header_id|>\n\n", PyStrip(m.content), "<|eot_id|>");
      } else if (!m.tool_calls.empty()) {
        if (m.tool_calls.size() != 1) return MessageError(k + offset, "llama3 takes one tool call per assistant message");
        absl::StatusOr<OJson> args = ParseArguments(k + offset, m.tool_calls[0]);
        if (!args.ok()) return args.status();
        Cat(out, "<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"", m.tool_calls[0].name,
                        "\", \"parameters\": ", ToJson(*args), "}<|eot_id|>");
      } else {
        // A string is iterable to Jinja, so the template writes it through tojson.
        Cat(out, "<|start_header_id|>ipython<|end_header_id|>\n\n", ToJson(OJson(m.content)), "<|eot_id|>");
      }
    }
    if (options.add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
    return out;
  }
};

// meta-llama/Meta-Llama-3-*-Instruct (3.0): headers and trimmed contents, no tools.
class Llama30Renderer final : public RendererBase {
 public:
  std::string_view name() const override { return "llama3_0"; }

 protected:
  absl::StatusOr<std::string> RenderAll(absl::Span<const ChatMessage> messages, const RenderOptions& options) const override {
    if (!options.tools_json.empty()) return absl::InvalidArgumentError("tools: the llama3_0 template has no tool format");
    std::string out = "<|begin_of_text|>";
    for (size_t i = 0; i < messages.size(); ++i) {
      if (!messages[i].tool_calls.empty()) return MessageError(i, "tool_calls: the llama3_0 template has no tool format");
      Cat(out, "<|start_header_id|>", messages[i].role, "<|end_header_id|>\n\n", PyStrip(messages[i].content), "<|eot_id|>");
    }
    if (options.add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
    return out;
  }
};

constexpr std::string_view kNames = "qwen3, qwen3_5, llama3, llama3_0, chatml";

}  // namespace

absl::StatusOr<std::unique_ptr<ChatRenderer>> MakeChatRenderer(std::string_view name) {
  if (name == "qwen3") return std::make_unique<Qwen3Renderer>();
  if (name == "qwen3_5") return std::make_unique<Qwen35Renderer>();
  if (name == "llama3") return std::make_unique<Llama3Renderer>();
  if (name == "llama3_0") return std::make_unique<Llama30Renderer>();
  if (name == "chatml") return std::make_unique<ChatmlRenderer>();
  return absl::NotFoundError(absl::StrCat("no chat renderer '", AV(name), "' (known: ", AV(kNames), ")"));
}

}  // namespace twinkle::tokenizer
