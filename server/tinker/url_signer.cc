#include "server/tinker/url_signer.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace twinkle::tinker {
namespace {

constexpr size_t kSecretBytes = 32;

absl::Status WriteKeyFile(const std::string& path, const std::string& bytes) {
  const std::string tmp = absl::StrCat(path, ".tmp");
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return absl::FailedPreconditionError(absl::StrCat("creating ", tmp, ": ", std::strerror(errno)));
  const bool ok = ::write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size()) && ::fsync(fd) == 0;
  ::close(fd);
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    return absl::FailedPreconditionError(absl::StrCat("writing ", path, ": ", std::strerror(errno)));
  }
  const std::string dir = std::filesystem::path(path).parent_path().string();
  if (const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<UrlSigner>> UrlSigner::Create(const std::string& secret_hex,
                                                             const std::string& key_file) {
  if (!secret_hex.empty()) {
    const bool hex = secret_hex.size() % 2 == 0 &&
                     std::all_of(secret_hex.begin(), secret_hex.end(), [](unsigned char c) { return std::isxdigit(c); });
    std::string bytes = hex ? absl::HexStringToBytes(secret_hex) : std::string();
    if (bytes.size() < kSecretBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("storage.url_signing_secret: must be hex of at least ", kSecretBytes, " bytes"));
    }
    return std::make_unique<UrlSigner>(std::move(bytes));
  }
  std::error_code ec;
  if (std::filesystem::exists(key_file, ec)) {
    std::ifstream in(key_file, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), {});
    if (bytes.size() < kSecretBytes) {
      return absl::FailedPreconditionError(
          absl::StrCat(key_file, ": the URL signing key must hold at least ", kSecretBytes, " bytes"));
    }
    return std::make_unique<UrlSigner>(std::move(bytes));
  }
  std::string bytes(kSecretBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(bytes.data()), static_cast<int>(bytes.size())) != 1) {
    return absl::InternalError("RAND_bytes failed generating the URL signing key");
  }
  if (absl::Status s = WriteKeyFile(key_file, bytes); !s.ok()) return s;
  return std::make_unique<UrlSigner>(std::move(bytes));
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
