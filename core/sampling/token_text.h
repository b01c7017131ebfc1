#pragma once
// The bytes each token id stands for, read from an HF tokenizer.json, so the coordinator can
// match stop strings on generated text. Two vocabulary styles:
//  - byte-level BPE (GPT-2, Llama 3, Qwen): core/tokenizer's Tokenizer::TokenBytes, the same
//    bytes the OpenAI routes decode;
//  - SentencePiece-style (Llama 2, Mistral), which that tokenizer does not load: U+2581 is a
//    space and <0xNN> a raw byte; added tokens decode to their literal content.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace twinkle::sampling {

class TokenText {
 public:
  // Parses `tokenizer_json` (the file's contents). InvalidArgument naming what is wrong.
  static absl::StatusOr<TokenText> FromTokenizerJson(const std::string& tokenizer_json);

  // The concatenated bytes of `tokens` (unknown ids decode to nothing).
  std::string Decode(const std::vector<int64_t>& tokens) const;

  // The number of leading tokens after which the decoded text first contains one of
  // `stops`, or nullopt when it never does.
  std::optional<size_t> TokensThroughFirstStop(const std::vector<int64_t>& tokens,
                                               const std::vector<std::string>& stops) const;

  size_t size() const { return bytes_.size(); }

 private:
  std::vector<std::string> bytes_;  // by token id
};

}  // namespace twinkle::sampling
