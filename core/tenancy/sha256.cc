#include "core/tenancy/sha256.h"

#include <openssl/evp.h>

#include <cstdlib>

namespace twinkle::tenancy {

Sha256Digest Sha256(absl::string_view data) {
  Sha256Digest digest{};
  unsigned int size = 0;
  // EVP_Digest only fails on allocation failure; a wrong digest would be a silent auth bypass
  // or lock-out, so treat failure as fatal.
  if (EVP_Digest(data.data(), data.size(), digest.data(), &size, EVP_sha256(), nullptr) != 1 ||
      size != digest.size()) {
    std::abort();
  }
  return digest;
}

std::string Sha256Hex(absl::string_view data) {
  static constexpr char kHex[] = "0123456789abcdef";
  const Sha256Digest digest = Sha256(data);
  std::string out;
  out.reserve(2 * digest.size());
  for (uint8_t b : digest) {
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 0xf]);
  }
  return out;
}

std::optional<Sha256Digest> ParseSha256Hex(absl::string_view hex) {
  if (hex.size() != 64) return std::nullopt;
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  Sha256Digest digest{};
  for (size_t i = 0; i < digest.size(); ++i) {
    const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    digest[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return digest;
}

}  // namespace twinkle::tenancy
