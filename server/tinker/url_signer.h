#pragma once
// Signed, expiring, tenant-bound download URLs for checkpoint files (external_weights_urls).
//
// A URL is  /twinkle/weights/<tenant>/<run_id>/<kind dir>/<name>/<file>?expires=<unix s>&sig=<hex>
// and sig = HMAC-SHA256(secret, "twinkle-weights-v1\n" tenant \n run_id \n checkpoint_id \n
// file \n expires) in lower-case hex. Verification recomputes it and compares in constant
// time (CRYPTO_memcmp), so changing any part (another tenant, another file, a later expiry)
// fails. The secret is storage.url_signing_secret (hex, at least 32 bytes) or, when unset, 32
// random bytes generated once and kept in <data_dir>/url_signing.key (mode 0600), so URLs
// stay valid across a restart. Signatures are never logged.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace twinkle::tinker {

class UrlSigner {
 public:
  // `secret_hex` non-empty: that secret (InvalidArgument unless it is hex of >= 32 bytes).
  // Else the key file: read when present (FailedPrecondition if it is not 32+ bytes), else
  // created with fresh random bytes (written to a temp file, fsynced, renamed).
  static absl::StatusOr<std::unique_ptr<UrlSigner>> Create(const std::string& secret_hex,
                                                           const std::string& key_file);
  explicit UrlSigner(std::string secret) : secret_(std::move(secret)) {}

  // The canonical message of one file URL.
  static std::string Message(absl::string_view tenant, absl::string_view run_id, absl::string_view checkpoint_id,
                             absl::string_view file, int64_t expires_unix);
  std::string Sign(absl::string_view message) const;  // lower-case hex
  bool Verify(absl::string_view message, absl::string_view signature_hex) const;

 private:
  const std::string secret_;
};

}  // namespace twinkle::tinker
