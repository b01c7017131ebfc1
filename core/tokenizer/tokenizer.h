#pragma once
// The server-side tokenizer, read from a model directory's HF tokenizer.json: what the
// OpenAI-compatible routes use to turn text into token ids and generated ids back into text,
// and what stop strings are matched on. No Python, no tokenizers runtime.
//
// Byte-level BPE as Qwen and Llama 3 use it: the pre-tokenizer regex through PCRE2, NFC
// through utf8proc, merges by rank, added and special tokens (docs/tokenizer.md).
//
// Equality target: for every supported family, Encode(text) equals HF
// `tokenizers.Tokenizer.encode(text, add_special_tokens=False).ids` and Decode(ids) equals
// `tokenizer.decode(ids, skip_special_tokens=...)`, byte for byte.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace twinkle::tokenizer {

class Tokenizer {
 public:
  // Parses a tokenizer.json (the file's contents). InvalidArgument naming what is
  // unsupported (model type, normalizer, pre-tokenizer) or malformed.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(std::string_view tokenizer_json);
  // Reads `<model_dir>/tokenizer.json`; NotFound naming the path when absent.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromModelDir(const std::string& model_dir);
  virtual ~Tokenizer() = default;

  // Text → ids. Added tokens (special ones included) that occur in `text` are matched
  // literally first, as HF does; the rest goes through normalizer, pre-tokenizer and BPE.
  // Never adds BOS/EOS itself (add_special_tokens=False).
  virtual absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text) const = 0;

  // Ids → UTF-8 text. Ids outside the vocabulary are InvalidArgument naming the id.
  // Invalid UTF-8 in the decoded bytes becomes U+FFFD, as HF's decode does.
  virtual absl::StatusOr<std::string> Decode(absl::Span<const int32_t> ids,
                                             bool skip_special_tokens) const = 0;

  // The raw bytes a token id stands for (no UTF-8 repair); empty for an unknown id.
  virtual std::string TokenBytes(int32_t id) const = 0;

  virtual std::optional<int32_t> TokenToId(std::string_view token) const = 0;
  virtual bool IsSpecial(int32_t id) const = 0;
  virtual int32_t vocab_size() const = 0;  // largest id + 1, added tokens included
};

// Incremental decoding for streaming: Push returns only text that is complete UTF-8, holding
// back the bytes of a character split across tokens until its last byte arrives. The
// concatenation of every Push and Finish equals Tokenizer::Decode of all ids.
class StreamDecoder {
 public:
  StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens);
  std::string Push(int32_t id);
  std::string Finish();  // what is held back (repaired as Decode would)

 private:
  const Tokenizer& tokenizer_;
  bool skip_special_tokens_;
  std::string pending_;  // bytes of an incomplete UTF-8 sequence
};

}  // namespace twinkle::tokenizer
