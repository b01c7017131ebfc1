#include "server/tinker/url_signer.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "server/auth/secret_file.h"

namespace twinkle::tinker {

absl::StatusOr<std::unique_ptr<UrlSigner>> UrlSigner::Create(const std::string& secret_hex,
                                                             const std::string& key_file) {
  absl::StatusOr<std::string> secret = LoadOrCreateSecret(secret_hex, "storage.url_signing_secret", key_file);
  if (!secret.ok()) return secret.status();
  return std::make_unique<UrlSigner>(*std::move(secret));
}

std::string UrlSigner::Message(absl::string_view tenant, absl::string_view run_id, absl::string_view checkpoint_id,
                               absl::string_view file, int64_t expires_unix) {
  return absl::StrCat("twinkle-weights-v1\n", tenant, "\n", run_id, "\n", checkpoint_id, "\n", file, "\n",
                      expires_unix);
}

std::string UrlSigner::Sign(absl::string_view message) const {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), secret_.data(), static_cast<int>(secret_.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), out, &len);
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(out), len));
}

bool UrlSigner::Verify(absl::string_view message, absl::string_view signature_hex) const {
  const std::string expected = Sign(message);
  if (signature_hex.size() != expected.size()) return false;
  return CRYPTO_memcmp(expected.data(), signature_hex.data(), expected.size()) == 0;
}

}  // namespace twinkle::tinker
