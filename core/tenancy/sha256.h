#pragma once
// SHA-256 helpers (OpenSSL EVP). API keys are stored and compared only as digests.

#include <array>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace twinkle::tenancy {

using Sha256Digest = std::array<uint8_t, 32>;

Sha256Digest Sha256(absl::string_view data);

// Lower-case hex of SHA-256(data): what `printf %s "$KEY" | sha256sum` prints.
std::string Sha256Hex(absl::string_view data);

// Parses 64 hex digits (either case) into a digest; nullopt for anything else.
std::optional<Sha256Digest> ParseSha256Hex(absl::string_view hex);

}  // namespace twinkle::tenancy
