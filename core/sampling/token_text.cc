#include "core/sampling/token_text.h"

#include <algorithm>
#include <array>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

namespace twinkle::sampling {
namespace {

// GPT-2's bytes_to_unicode, inverted: code point → byte (-1 where no byte maps there).
std::array<int, 512> ByteLevelInverse() {
  std::array<int, 512> inverse;
  inverse.fill(-1);
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    inverse[printable ? b : next++] = b;
  }
  return inverse;
}

// Decodes one UTF-8 code point at `i`, advancing it; -1 on malformed input.
int32_t NextCodePoint(const std::string& s, size_t& i) {
  const auto c = static_cast<unsigned char>(s[i]);
  int len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
  if (len == 0 || i + len > s.size()) {
    ++i;
    return -1;
  }
  int32_t cp = len == 1 ? c : c & (0x7F >> len);
  for (int k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += len;
  return cp;
}

std::string ByteLevelBytes(const std::string& token, const std::array<int, 512>& inverse) {
  std::string out;
  for (size_t i = 0; i < token.size();) {
    const int32_t cp = NextCodePoint(token, i);
    if (cp >= 0 && cp < 512 && inverse[cp] >= 0) out.push_back(static_cast<char>(inverse[cp]));
  }
  return out;
}

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
  nlohmann::json j = nlohmann::json::parse(tokenizer_json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return absl::InvalidArgumentError("tokenizer.json: not a JSON object");
  const nlohmann::json* vocab = nullptr;
  if (auto m = j.find("model"); m != j.end() && m->is_object()) {
    if (auto v = m->find("vocab"); v != m->end() && v->is_object()) vocab = &*v;
  }
  if (vocab == nullptr) return absl::InvalidArgumentError("tokenizer.json: no model.vocab object (not a BPE vocabulary)");
  bool byte_level = false;
  if (auto d = j.find("decoder"); d != j.end() && d->is_object()) {
    byte_level = d->value("type", "") == "ByteLevel";
  }
  if (auto p = j.find("pre_tokenizer"); !byte_level && p != j.end() && p->is_object()) {
    byte_level = p->dump().find("\"ByteLevel\"") != std::string::npos;
  }
  const std::array<int, 512> inverse = ByteLevelInverse();
  TokenText text;
  auto put = [&text](int64_t id, std::string bytes) {
    if (id < 0 || id > (1 << 24)) return;
    if (static_cast<size_t>(id) >= text.bytes_.size()) text.bytes_.resize(id + 1);
    text.bytes_[id] = std::move(bytes);
  };
  for (const auto& [token, id] : vocab->items()) {
    if (!id.is_number_integer()) return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: vocab['", token, "'] is not an id"));
    put(id.get<int64_t>(), byte_level ? ByteLevelBytes(token, inverse) : SentencePieceBytes(token));
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
