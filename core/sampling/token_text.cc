#include "core/sampling/token_text.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "core/tokenizer/tokenizer.h"

namespace twinkle::sampling {
namespace {

std::string SentencePieceBytes(const std::string& token) {
  // <0xNN>: one raw byte (byte fallback).
  if (token.size() == 6 && token.rfind("<0x", 0) == 0 && token[5] == '>') {
    return std::string(1, static_cast<char>(std::stoi(token.substr(3, 2), nullptr, 16)));
  }
  std::string out;
  static const std::string kSpace = "\xE2\x96\x81";  // U+2581
  for (size_t i = 0; i < token.size();) {
    if (token.compare(i, kSpace.size(), kSpace) == 0) {
      out.push_back(' ');
      i += kSpace.size();
    } else {
      out.push_back(token[i++]);
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<TokenText> TokenText::FromTokenizerJson(const std::string& tokenizer_json) {
  // Byte-level BPE (Qwen, Llama 3, GPT-2): the server's tokenizer says what each id stands for,
  // so stop strings see exactly the bytes the OpenAI routes decode.
  absl::StatusOr<std::unique_ptr<tokenizer::Tokenizer>> tok = tokenizer::Tokenizer::FromJson(tokenizer_json);
  if (tok.ok()) {
    TokenText text;
    text.bytes_.resize(static_cast<size_t>((*tok)->vocab_size()));
    for (int32_t id = 0; id < (*tok)->vocab_size(); ++id) text.bytes_[id] = (*tok)->TokenBytes(id);
    return text;
  }
  nlohmann::json j = nlohmann::json::parse(tokenizer_json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return absl::InvalidArgumentError("tokenizer.json: not a JSON object");
  // A byte-level file the tokenizer refused: its reason (the unsupported part) is the answer.
  for (const char* key : {"decoder", "pre_tokenizer"}) {
    if (auto p = j.find(key); p != j.end() && p->is_object() && p->dump().find("\"ByteLevel\"") != std::string::npos) {
      return tok.status();
    }
  }
  // SentencePiece-style vocabularies (Llama 2, Mistral), which the tokenizer does not load.
  const nlohmann::json* vocab = nullptr;
  if (auto m = j.find("model"); m != j.end() && m->is_object()) {
    if (auto v = m->find("vocab"); v != m->end() && v->is_object()) vocab = &*v;
  }
  if (vocab == nullptr) return absl::InvalidArgumentError("tokenizer.json: no model.vocab object (not a BPE vocabulary)");
  TokenText text;
  auto put = [&text](int64_t id, std::string bytes) {
    if (id < 0 || id > (1 << 24)) return;
    if (static_cast<size_t>(id) >= text.bytes_.size()) text.bytes_.resize(id + 1);
    text.bytes_[id] = std::move(bytes);
  };
  for (const auto& [token, id] : vocab->items()) {
    if (!id.is_number_integer()) return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: vocab['", token, "'] is not an id"));
    put(id.get<int64_t>(), SentencePieceBytes(token));
  }
  if (auto added = j.find("added_tokens"); added != j.end() && added->is_array()) {
    for (const nlohmann::json& t : *added) {
      if (t.is_object() && t.contains("id") && t["id"].is_number_integer() && t.contains("content") &&
          t["content"].is_string()) {
        put(t["id"].get<int64_t>(), t["content"].get<std::string>());
      }
    }
  }
  return text;
}

std::string TokenText::Decode(const std::vector<int64_t>& tokens) const {
  std::string out;
  for (int64_t t : tokens) {
    if (t >= 0 && static_cast<size_t>(t) < bytes_.size()) out += bytes_[t];
  }
  return out;
}

std::optional<size_t> TokenText::TokensThroughFirstStop(const std::vector<int64_t>& tokens,
                                                        const std::vector<std::string>& stops) const {
  size_t longest = 0;
  for (const std::string& s : stops) longest = std::max(longest, s.size());
  if (longest == 0) return std::nullopt;
  std::string text;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const size_t before = text.size();
    if (tokens[i] >= 0 && static_cast<size_t>(tokens[i]) < bytes_.size()) text += bytes_[tokens[i]];
    // Only a match that ends inside this token's bytes is new.
    const size_t from = before >= longest ? before - longest + 1 : 0;
    for (const std::string& s : stops) {
      if (!s.empty() && text.find(s, from) != std::string::npos) return i + 1;
    }
  }
  return std::nullopt;
}

}  // namespace twinkle::sampling
