// libFuzzer entry point for core/tokenizer on untrusted text, ids and chat messages. The first
// byte picks what the rest is:
//   0: text for Encode on a Qwen-style tokenizer (NFC, the Qwen split regex, added tokens with
//      every flag) and on a GPT-2-style one without a normalizer or lossy added tokens, where
//      Decode(Encode(text)) must give the text back (byte-level BPE is lossless);
//   1: ids (2 bytes each) for Decode and the StreamDecoder, whose concatenation must equal
//      Decode whenever Decode accepts the ids;
//   2: chat messages (NUL-separated contents, roles cycling) rendered by every renderer, whose
//      output must be valid UTF-8 and encode;
//   3: a tokenizer.json for FromJson.
// Invariants: no crash, no sanitizer report, no allocation beyond libFuzzer's limit.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tokenizer/chat_renderer.h"
#include "core/tokenizer/tokenizer.h"
#include "core/tokenizer/utf8.h"

namespace tk = twinkle::tokenizer;
using Json = nlohmann::json;

namespace {

// Every byte-level character as a token, a few merges, and added tokens.
Json MakeJson(bool qwen) {
  Json vocab = Json::object();
  int next = 256;
  int id = 0;
  std::vector<std::string> chars(256);
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    chars[b] = tk::utf8::Encode(static_cast<char32_t>(printable ? b : next++));
    vocab[chars[b]] = id++;
  }
  Json merges = Json::array();
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {chars[' '], "t"}, {"h", "e"}, {chars[' '] + "t", "he"}, {"i", "n"}, {"a", "n"}, {"in", "g"},
      {chars[' '], chars[' ']}, {chars[0xE4], chars[0xB8]}, {chars[0xE4] + chars[0xB8], chars[0xAD]}, {"1", "2"},
      {"12", "3"}};  // 中 is E4 B8 AD
  for (const auto& [a, b] : pairs) {
    if (!vocab.contains(a + b)) vocab[a + b] = id++;
    merges.push_back(Json::array({a, b}));
  }
  Json added = Json::array();
  auto add = [&](const std::string& content, bool special, Json flags) {
    Json t = {{"id", id++}, {"content", content}, {"special", special}};
    t.update(flags);
    added.push_back(t);
  };
  add("<|im_start|>", true, {{"normalized", false}});
  add("<|im_end|>", true, {{"normalized", false}});
  add("<think>", false, {{"normalized", false}});
  add("word", false, {{"single_word", true}, {"normalized", false}});
  if (qwen) {
    // No round trip through these: stripping tokens eat whitespace, and a non-ASCII added
    // token decodes through the byte map as HF's does ("é" is byte 0xE9 there).
    add("<mask>", true, {{"lstrip", true}, {"normalized", false}});
    add("[R]", false, {{"rstrip", true}, {"normalized", false}});
    add("caf\xC3\xA9", false, {{"normalized", true}});
  }
  Json pre = qwen ? Json{{"type", "Sequence"},
                         {"pretokenizers",
                          Json::array({{{"type", "Split"},
                                        {"pattern", {{"Regex", R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}}},
                                        {"behavior", "Isolated"}},
                                       {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}}
                  : Json{{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  return Json{{"normalizer", qwen ? Json{{"type", "NFC"}} : Json(nullptr)},
              {"pre_tokenizer", pre},
              {"decoder", {{"type", "ByteLevel"}}},
              {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}, {"ignore_merges", !qwen}}},
              {"added_tokens", added}};
}

const tk::Tokenizer& Get(bool qwen) {
  static const tk::Tokenizer* q = tk::Tokenizer::FromJson(MakeJson(true).dump()).value().release();
  static const tk::Tokenizer* g = tk::Tokenizer::FromJson(MakeJson(false).dump()).value().release();
  return qwen ? *q : *g;
}

void EncodeText(std::string_view text) {
  auto qwen_ids = Get(true).Encode(text);
  auto ids = Get(false).Encode(text);
  if (tk::utf8::IsValid(text) != ids.ok() || ids.ok() != qwen_ids.ok()) std::abort();
  if (!ids.ok()) return;
  auto back = Get(false).Decode(*ids, /*skip_special_tokens=*/false);
  if (!back.ok() || *back != text) std::abort();
}

void DecodeIds(const uint8_t* data, size_t size) {
  std::vector<int32_t> ids;
  for (size_t i = 0; i + 1 < size; i += 2) ids.push_back(static_cast<int32_t>(data[i] | (data[i + 1] << 8)) - 64);
  for (bool skip : {false, true}) {
    const tk::Tokenizer& tok = Get(skip);
    auto text = tok.Decode(ids, skip);
    if (!text.ok()) continue;
    if (!tk::utf8::IsValid(*text)) std::abort();
    tk::StreamDecoder stream(tok, skip);
    std::string joined;
    for (int32_t id : ids) joined += stream.Push(id);
    joined += stream.Finish();
    if (joined != *text) std::abort();
  }
}

void RenderMessages(std::string_view rest) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (size_t i = 0; i <= rest.size(); ++i) {
    if (i == rest.size() || rest[i] == '\0') {
      parts.emplace_back(rest.substr(start, i - start));
      start = i + 1;
    }
  }
  static const char* kRoles[] = {"system", "user", "assistant", "tool", "user", "assistant"};
  std::vector<tk::ChatMessage> messages;
  tk::RenderOptions options;
  for (size_t i = 0; i < parts.size() && i < 8; ++i) {
    tk::ChatMessage m;
    m.role = kRoles[i % 6];
    m.content = parts[i];
    if (m.role == "assistant" && !parts[i].empty() && parts[i][0] == '{') {
      m.tool_calls.push_back({.id = "c", .name = "f", .arguments_json = parts[i]});
    }
    messages.push_back(std::move(m));
  }
  if (parts.size() > 8) options.tools_json = parts[8];
  options.enable_thinking = rest.size() % 2 == 0;
  options.continue_final_message = rest.size() % 3 == 0;
  options.add_generation_prompt = !options.continue_final_message;
  for (const char* name : {"qwen3", "qwen3_5", "llama3", "llama3_0", "chatml"}) {
    auto renderer = tk::MakeChatRenderer(name);
    auto text = (*renderer)->Render(messages, options);
    if (!text.ok()) continue;
    if (!tk::utf8::IsValid(*text) || !Get(true).Encode(*text).ok()) std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data + 1), size - 1);
  switch (data[0] % 4) {
    case 0: EncodeText(rest); break;
    case 1: DecodeIds(data + 1, size - 1); break;
    case 2: RenderMessages(rest); break;
    default: (void)tk::Tokenizer::FromJson(rest); break;
  }
  return 0;
}
