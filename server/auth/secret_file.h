#pragma once
// Server secrets (HMAC keys): configured as hex, or generated once and kept in a key file
// under the data directory, so what they sign (download URLs, JWTs) survives a restart.

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace twinkle {

// The smallest secret accepted, in bytes.
inline constexpr size_t kMinSecretBytes = 32;

// `configured_hex` non-empty: those bytes (InvalidArgument naming `config_field` unless it is
// hex of at least kMinSecretBytes). Else `key_file`: read when present (FailedPrecondition if
// it holds fewer than kMinSecretBytes), else created with kMinSecretBytes random bytes
// (mode 0600, written to a temp file, fsynced, renamed). Secrets never appear in a status.
absl::StatusOr<std::string> LoadOrCreateSecret(const std::string& configured_hex, absl::string_view config_field,
                                               const std::string& key_file);

}  // namespace twinkle
