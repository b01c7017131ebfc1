#pragma once
// UTF-8 helpers for the tokenizer: validation, code point decoding, and the lossy repair that
// Rust's String::from_utf8_lossy (HF's decode) applies: every maximal ill-formed subpart
// becomes one U+FFFD.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace twinkle::tokenizer::utf8 {

std::string Encode(char32_t cp);

// The code point at `i` (advancing `i` past it), or -1 for an ill-formed sequence (advancing
// past its maximal subpart, at least one byte).
int32_t DecodeAt(std::string_view s, size_t& i);

// The length a lead byte announces (1 for ASCII and for bytes that cannot lead).
size_t SequenceLength(unsigned char lead);
inline bool IsContinuation(unsigned char c) { return (c & 0xC0) == 0x80; }

// The offset of the first ill-formed byte, or npos.
size_t FirstInvalid(std::string_view s);
inline bool IsValid(std::string_view s) { return FirstInvalid(s) == std::string_view::npos; }

// `s` with every maximal ill-formed subpart replaced by U+FFFD.
std::string Repair(std::string_view s);

// The length of `s` without a trailing sequence that is well-formed so far but incomplete
// (what a stream holds back until the rest of the character arrives).
size_t CompletePrefix(std::string_view s);

}  // namespace twinkle::tokenizer::utf8
