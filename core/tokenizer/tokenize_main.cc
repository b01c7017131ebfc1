// twinkle-tokenize: the C++ tokenizer behind a JSON-lines pipe, for the equality harness in
// tests/tokenizer (which compares it with HF tokenizers) and for looking at a tokenizer by hand.
//
//   twinkle-tokenize TOKENIZER_JSON
// Each stdin line is one request, each stdout line its answer:
//   {"encode": "text"}                          → {"ids": [...]}
//   {"decode": [ids], "skip_special": bool}     → {"text": "..."}
//   {"stream": [ids], "skip_special": bool}     → {"chunks": ["...", ...]} (Push per id, then Finish)
//   {"token_bytes": id}                         → {"hex": "..."}
//   {"render": {"renderer": "qwen3", "messages": [...], "tools": [...], "add_generation_prompt": b,
//               "enable_thinking": b, "continue_final_message": b}}
//                                               → {"text": "...", "ids": [...]} (ids: Encode(text))
//   {"pick": "MODEL_DIR", "fallback": "name"}   → {"renderer": "..."} (ChatRendererForModel)
// Any failure → {"error": "..."}; the tool keeps reading.

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "core/tokenizer/chat_renderer.h"
#include "core/tokenizer/tokenizer.h"

namespace {

using Json = nlohmann::ordered_json;  // keeps the tools' key order
using twinkle::tokenizer::ChatMessage;
using twinkle::tokenizer::RenderOptions;
using twinkle::tokenizer::StreamDecoder;
using twinkle::tokenizer::ToolCall;
using twinkle::tokenizer::Tokenizer;

Json Error(std::string_view message) { return Json{{"error", std::string(message)}}; }

Json Render(const Tokenizer& tok, const Json& r) {
  if (!r.is_object() || !r.contains("messages") || !r["messages"].is_array()) return Error("render: no messages array");
  std::vector<ChatMessage> messages;
  for (const Json& m : r["messages"]) {
    if (!m.is_object()) return Error("render: a message is not an object");
    ChatMessage msg;
    msg.role = m.value("role", "");
    if (m.contains("content") && m["content"].is_string()) msg.content = m["content"].get<std::string>();
    if (m.contains("reasoning_content") && m["reasoning_content"].is_string()) {
      msg.reasoning_content = m["reasoning_content"].get<std::string>();
    }
    msg.tool_call_id = m.value("tool_call_id", "");
    if (m.contains("tool_calls") && m["tool_calls"].is_array()) {
      for (const Json& c : m["tool_calls"]) {
        ToolCall call;
        call.id = c.value("id", "");
        const Json& f = c.contains("function") ? c["function"] : c;
        call.name = f.value("name", "");
        if (f.contains("arguments")) {
          call.arguments_json = f["arguments"].is_string() ? f["arguments"].get<std::string>() : f["arguments"].dump();
        }
        msg.tool_calls.push_back(std::move(call));
      }
    }
    messages.push_back(std::move(msg));
  }
  RenderOptions options;
  options.add_generation_prompt = r.value("add_generation_prompt", true);
  options.enable_thinking = r.value("enable_thinking", true);
  options.continue_final_message = r.value("continue_final_message", false);
  if (r.contains("tools") && !r["tools"].is_null()) options.tools_json = r["tools"].dump();
  auto renderer = twinkle::tokenizer::MakeChatRenderer(r.value("renderer", ""));
  if (!renderer.ok()) return Error(renderer.status().ToString());
  absl::StatusOr<std::string> text = (*renderer)->Render(messages, options);
  if (!text.ok()) return Error(text.status().ToString());
  absl::StatusOr<std::vector<int32_t>> ids = tok.Encode(*text);
  if (!ids.ok()) return Error(ids.status().ToString());
  return Json{{"text", *text}, {"ids", *ids}};
}

Json Handle(const Tokenizer& tok, const Json& req) {
  if (!req.is_object()) return Error("request is not a JSON object");
  const bool skip = req.value("skip_special", false);
  if (auto it = req.find("encode"); it != req.end()) {
    if (!it->is_string()) return Error("encode: not a string");
    absl::StatusOr<std::vector<int32_t>> ids = tok.Encode(it->get<std::string>());
    if (!ids.ok()) return Error(ids.status().ToString());
    return Json{{"ids", *ids}};
  }
  auto ids_of = [](const Json& j, std::vector<int32_t>& ids) {
    if (!j.is_array()) return false;
    for (const Json& v : j) {
      if (!v.is_number_integer()) return false;
      ids.push_back(v.get<int32_t>());
    }
    return true;
  };
  if (auto it = req.find("decode"); it != req.end()) {
    std::vector<int32_t> ids;
    if (!ids_of(*it, ids)) return Error("decode: not an array of ids");
    absl::StatusOr<std::string> text = tok.Decode(ids, skip);
    if (!text.ok()) return Error(text.status().ToString());
    return Json{{"text", *text}};
  }
  if (auto it = req.find("stream"); it != req.end()) {
    std::vector<int32_t> ids;
    if (!ids_of(*it, ids)) return Error("stream: not an array of ids");
    StreamDecoder decoder(tok, skip);
    Json chunks = Json::array();
    for (int32_t id : ids) chunks.push_back(decoder.Push(id));
    chunks.push_back(decoder.Finish());
    return Json{{"chunks", chunks}};
  }
  if (auto it = req.find("token_bytes"); it != req.end() && it->is_number_integer()) {
    static constexpr char kHex[] = "0123456789abcdef";
    std::string hex;
    for (unsigned char c : tok.TokenBytes(it->get<int32_t>())) {
      hex.push_back(kHex[c >> 4]);
      hex.push_back(kHex[c & 15]);
    }
    return Json{{"hex", hex}};
  }
  if (auto it = req.find("render"); it != req.end()) return Render(tok, *it);
  if (auto it = req.find("pick"); it != req.end() && it->is_string()) {
    auto renderer = twinkle::tokenizer::ChatRendererForModel(it->get<std::string>(), req.value("fallback", ""));
    if (!renderer.ok()) return Error(renderer.status().ToString());
    return Json{{"renderer", std::string((*renderer)->name())}};
  }
  return Error("unknown request (encode, decode, stream, token_bytes, render, pick)");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: twinkle-tokenize TOKENIZER_JSON  (JSON lines on stdin)\n");
    return 2;
  }
  std::ifstream in(argv[1], std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "twinkle-tokenize: cannot read %s\n", argv[1]);
    return 1;
  }
  std::stringstream contents;
  contents << in.rdbuf();
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromJson(contents.str());
  if (!tok.ok()) {
    std::fprintf(stderr, "twinkle-tokenize: %s\n", tok.status().ToString().c_str());
    return 1;
  }
  std::string line;
  while (std::getline(std::cin, line)) {
    Json req = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    Json answer = req.is_discarded() ? Error("not JSON") : Handle(**tok, req);
    std::cout << answer.dump(-1, ' ', false, Json::error_handler_t::replace) << '\n' << std::flush;
  }
  return 0;
}
