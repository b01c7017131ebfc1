#include "core/storage/tar_stream.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "core/storage/filesystem.h"

namespace twinkle::storage {
namespace {

constexpr size_t kBlock = 512;

// Incremental SHA-256 (OpenSSL EVP).
class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new(), &EVP_MD_CTX_free) {
    // Only allocation failure makes these fail; a wrong digest would pass corrupt data.
    if (ctx_ == nullptr || EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr) != 1) std::abort();
  }
  void Update(absl::string_view bytes) {
    if (EVP_DigestUpdate(ctx_.get(), bytes.data(), bytes.size()) != 1) std::abort();
  }
  std::string Hex() {
    std::array<unsigned char, EVP_MAX_MD_SIZE> digest{};
    unsigned int size = 0;
    if (EVP_DigestFinal_ex(ctx_.get(), digest.data(), &size) != 1 || size != 32) std::abort();
    return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest.data()), size));
  }

 private:
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx_;
};

int64_t Padded(int64_t size) { return (size + kBlock - 1) / kBlock * kBlock; }

// A ustar header block for a regular file.
absl::StatusOr<std::string> Header(const StreamedFile& f, int64_t mtime) {
  if (f.name.empty() || f.name.size() > kMaxTarNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("archive member name '", f.name, "': 1 to ", kMaxTarNameBytes, " bytes"));
  }
  if (f.size < 0 || f.size >= (int64_t{1} << 33)) {  // 11 octal digits
    return absl::InvalidArgumentError(absl::StrCat("archive member ", f.name, ": size ", f.size, " out of range"));
  }
  std::string h(kBlock, '\0');
  std::memcpy(h.data(), f.name.data(), f.name.size());
  std::snprintf(h.data() + 100, 8, "%07o", 0644);
  std::snprintf(h.data() + 108, 8, "%07o", 0);
  std::snprintf(h.data() + 116, 8, "%07o", 0);
  std::snprintf(h.data() + 124, 12, "%011llo", static_cast<unsigned long long>(f.size));
  std::snprintf(h.data() + 136, 12, "%011llo",
                static_cast<unsigned long long>(std::clamp<int64_t>(mtime, 0, (int64_t{1} << 33) - 1)));
  std::memset(h.data() + 148, ' ', 8);  // the checksum counts its own field as spaces
  h[156] = '0';                          // a regular file
  std::memcpy(h.data() + 257, "ustar", 6);
  std::memcpy(h.data() + 263, "00", 2);
  unsigned sum = 0;
  for (unsigned char c : h) sum += c;
  std::snprintf(h.data() + 148, 8, "%06o", sum);
  h[155] = ' ';
  return h;
}

// Reads `f` in chunks into `sink` (and `archive`, when set, the archive's running hash),
// checking its size and SHA-256 against the record.
absl::Status Pump(const StreamedFile& f, const ChunkSink& sink, Sha256* archive, std::string* sha_out) {
  if (f.path.empty()) {  // an empty member, read from nowhere
    if (f.size != 0) return absl::InvalidArgumentError(absl::StrCat("member ", f.name, ": no path but size ", f.size));
    if (sha_out != nullptr) *sha_out = Sha256().Hex();
    return absl::OkStatus();
  }
  const int fd = ::open(f.path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return ErrnoStatus(errno, "open", f.path.string());
  std::unique_ptr<int, void (*)(int*)> closer(new int(fd), [](int* p) {
    ::close(*p);
    delete p;
  });
  Sha256 file_sha;
  std::string buffer(kStreamChunkBytes, '\0');
  int64_t total = 0;
  for (;;) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "read", f.path.string());
    }
    if (n == 0) break;
    total += n;
    if (total > f.size) break;  // longer than recorded: stop before handing on more
    const absl::string_view piece(buffer.data(), static_cast<size_t>(n));
    file_sha.Update(piece);
    if (archive != nullptr) archive->Update(piece);
    if (absl::Status s = sink(piece); !s.ok()) return s;
  }
  const std::string sha = file_sha.Hex();
  if (total != f.size || (!f.sha256.empty() && sha != f.sha256)) {
    return absl::DataLossError(absl::StrCat("file ", f.name, " does not match its recorded size and SHA-256"));
  }
  if (sha_out != nullptr) *sha_out = sha;
  return absl::OkStatus();
}

}  // namespace

int64_t TarSize(const std::vector<StreamedFile>& members) {
  int64_t size = 2 * kBlock;
  for (const StreamedFile& f : members) size += kBlock + Padded(f.size);
  return size;
}

absl::StatusOr<std::string> StreamTar(const std::vector<StreamedFile>& members, int64_t mtime,
                                      const ChunkSink& sink) {
  std::vector<std::string> headers;
  for (const StreamedFile& f : members) {  // every header is checked before the first byte
    absl::StatusOr<std::string> h = Header(f, mtime);
    if (!h.ok()) return h.status();
    headers.push_back(*std::move(h));
  }
  Sha256 sha;
  auto emit = [&](absl::string_view bytes) {
    sha.Update(bytes);
    return sink(bytes);
  };
  const std::string zeros(2 * kBlock, '\0');
  for (size_t i = 0; i < members.size(); ++i) {
    if (absl::Status s = emit(headers[i]); !s.ok()) return s;
    if (absl::Status s = Pump(members[i], sink, &sha, nullptr); !s.ok()) return s;
    const size_t pad = static_cast<size_t>(Padded(members[i].size) - members[i].size);
    if (pad > 0) {
      if (absl::Status s = emit(absl::string_view(zeros.data(), pad)); !s.ok()) return s;
    }
  }
  if (absl::Status s = emit(zeros); !s.ok()) return s;
  return sha.Hex();
}

absl::StatusOr<std::string> StreamFile(const StreamedFile& file, const ChunkSink& sink) {
  std::string sha;
  if (absl::Status s = Pump(file, sink, nullptr, &sha); !s.ok()) return s;
  return sha;
}

}  // namespace twinkle::storage
