#include "server/auth/secret_file.h"

#include <fcntl.h>
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

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace twinkle {
namespace {

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

absl::StatusOr<std::string> LoadOrCreateSecret(const std::string& configured_hex, absl::string_view config_field,
                                               const std::string& key_file) {
  if (!configured_hex.empty()) {
    const bool hex = configured_hex.size() % 2 == 0 &&
                     std::all_of(configured_hex.begin(), configured_hex.end(),
                                 [](unsigned char c) { return std::isxdigit(c); });
    std::string bytes = hex ? absl::HexStringToBytes(configured_hex) : std::string();
    if (bytes.size() < kMinSecretBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(config_field, ": must be hex of at least ", kMinSecretBytes, " bytes"));
    }
    return bytes;
  }
  std::error_code ec;
  if (std::filesystem::exists(key_file, ec)) {
    std::ifstream in(key_file, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), {});
    if (bytes.size() < kMinSecretBytes) {
      return absl::FailedPreconditionError(
          absl::StrCat(key_file, ": a signing key must hold at least ", kMinSecretBytes, " bytes"));
    }
    return bytes;
  }
  std::string bytes(kMinSecretBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(bytes.data()), static_cast<int>(bytes.size())) != 1) {
    return absl::InternalError(absl::StrCat("RAND_bytes failed generating ", key_file));
  }
  if (absl::Status s = WriteKeyFile(key_file, bytes); !s.ok()) return s;
  return bytes;
}

}  // namespace twinkle
