#pragma once
// Files on disk as a stream of bytes, read in chunks and never held whole: one file as it is,
// or several as an uncompressed POSIX ustar archive (hand-written headers: the format is 512-
// byte blocks, see POSIX pax "ustar Interchange Format"). The total length is known before
// the first byte (from the recorded sizes), and every file is checked against its recorded
// size and SHA-256 as it goes by.
//
// A file that differs from its record is only noticed once its bytes have been handed on:
// the stream then fails (DataLoss naming the file) and the caller must abort the transfer
// (a client checking the length or the checksum sees the failure).

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace twinkle::storage {

// One file to stream: its name in the archive, where it is (empty: an empty member, no file
// read; its size must be 0), its recorded size and SHA-256 (lower-case hex; empty = not
// checked).
struct StreamedFile {
  std::string name;
  std::filesystem::path path;
  int64_t size = 0;
  std::string sha256;
};

// Receives the bytes in order; an error stops the stream and is returned.
using ChunkSink = std::function<absl::Status(absl::string_view chunk)>;

// The most bytes handed to a sink at once.
inline constexpr size_t kStreamChunkBytes = size_t{1} << 20;

// A ustar member name is at most 100 bytes (no prefix field used); longer ones are refused.
inline constexpr size_t kMaxTarNameBytes = 100;

// The archive's length: per member a 512-byte header plus its data padded to 512, then two
// zero blocks.
int64_t TarSize(const std::vector<StreamedFile>& members);

// Streams the archive of `members` (in order, mode 0644, owner 0, modification time `mtime`
// in Unix seconds) through `sink`. Returns its SHA-256 (lower-case hex). InvalidArgument for
// a name that does not fit a ustar header; DataLoss for a file whose size or SHA-256 differs
// from its record; the sink's error when it fails.
absl::StatusOr<std::string> StreamTar(const std::vector<StreamedFile>& members, int64_t mtime,
                                      const ChunkSink& sink);

// Streams one file's bytes through `sink`, checked like an archive member. Returns its
// SHA-256.
absl::StatusOr<std::string> StreamFile(const StreamedFile& file, const ChunkSink& sink);

}  // namespace twinkle::storage
