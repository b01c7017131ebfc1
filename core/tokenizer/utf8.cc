#include "core/tokenizer/utf8.h"

namespace twinkle::tokenizer::utf8 {
namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";

// Scans the sequence at `i`: returns the number of bytes it spans (the whole sequence when
// well-formed, else its maximal subpart, at least 1) and sets `ok`, `truncated` (the subpart
// ran into the end of `s`) and `cp`.
size_t Scan(std::string_view s, size_t i, bool& ok, bool& truncated, int32_t& cp) {
  const auto lead = static_cast<unsigned char>(s[i]);
  truncated = false;
  if (lead < 0x80) {
    ok = true;
    cp = lead;
    return 1;
  }
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    n = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    n = 3;
    if (lead == 0xE0) lo = 0xA0;
    if (lead == 0xED) hi = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    n = 4;
    if (lead == 0xF0) lo = 0x90;
    if (lead == 0xF4) hi = 0x8F;
  } else {
    ok = false;
    return 1;
  }
  int32_t value = lead & (0x7F >> n);
  size_t k = 1;
  while (k < n) {
    if (i + k >= s.size()) {
      ok = false;
      truncated = true;
      return k;
    }
    const auto c = static_cast<unsigned char>(s[i + k]);
    const unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (c < l || c > h) {
      ok = false;
      return k;
    }
    value = (value << 6) | (c & 0x3F);
    ++k;
  }
  ok = true;
  cp = value;
  return n;
}

}  // namespace

std::string Encode(char32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return out;
}

int32_t DecodeAt(std::string_view s, size_t& i) {
  bool ok = false, truncated = false;
  int32_t cp = -1;
  i += Scan(s, i, ok, truncated, cp);
  return ok ? cp : -1;
}

size_t SequenceLength(unsigned char lead) {
  if (lead >= 0xC0 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF7) return 4;
  return 1;
}

size_t FirstInvalid(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    bool ok = false, truncated = false;
    int32_t cp = 0;
    const size_t n = Scan(s, i, ok, truncated, cp);
    if (!ok) return i;
    i += n;
  }
  return std::string_view::npos;
}

std::string Repair(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    bool ok = false, truncated = false;
    int32_t cp = 0;
    const size_t n = Scan(s, i, ok, truncated, cp);
    if (ok) {
      out.append(s.substr(i, n));
    } else {
      out.append(kReplacement);
    }
    i += n;
  }
  return out;
}

size_t CompletePrefix(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    bool ok = false, truncated = false;
    int32_t cp = 0;
    const size_t n = Scan(s, i, ok, truncated, cp);
    if (truncated) return i;
    i += n;
  }
  return s.size();
}

}  // namespace twinkle::tokenizer::utf8
