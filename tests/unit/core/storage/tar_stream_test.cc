// The streamed archive, read back by GNU tar (the reference), its length and SHA-256 checked
// against the bytes as a whole, its chunks bounded, and files that differ from their record
// refused.
#include "core/storage/tar_stream.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "core/storage/checkpoint_dir.h"
#include "tests/unit/core/storage/temp_dir.h"

namespace twinkle::storage {
namespace {

using ::testing::HasSubstr;
using testing::Slurp;
using testing::Snapshot;
using testing::Spit;
using testing::TempDir;

std::string Bytes(size_t n, unsigned seed) {
  std::string out(n, '\0');
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<char>((i * 131 + seed * 7 + (i >> 9)) & 0xFF);
  return out;
}

StreamedFile Recorded(const std::filesystem::path& dir, const std::string& name, const std::string& bytes) {
  Spit(dir / name, bytes);
  return {name, dir / name, static_cast<int64_t>(bytes.size()), Sha256Hex(bytes)};
}

TEST(TarStreamTest, GnuTarExtractsExactlyTheFilesAndTheLengthAndChecksumAreKnown) {
  TempDir src, out;
  // A large file (several chunks, not a multiple of 512), a small one, and an empty marker.
  const std::string big = Bytes(3 * kStreamChunkBytes + 7, 1), small = "{\"r\": 8}\n";
  std::vector<StreamedFile> members = {Recorded(src.path(), "adapter_model.safetensors", big),
                                       Recorded(src.path(), "adapter_config.json", small),
                                       StreamedFile{"checkpoint_complete", "", 0, ""}};
  std::string tar;
  size_t largest_chunk = 0, chunks = 0;
  absl::StatusOr<std::string> sha = StreamTar(members, 1'700'000'000, [&](absl::string_view chunk) {
    largest_chunk = std::max(largest_chunk, chunk.size());
    ++chunks;
    tar.append(chunk.data(), chunk.size());
    return absl::OkStatus();
  });
  ASSERT_TRUE(sha.ok()) << sha.status();
  EXPECT_EQ(static_cast<int64_t>(tar.size()), TarSize(members));
  EXPECT_EQ(*sha, Sha256Hex(tar));
  EXPECT_LE(largest_chunk, kStreamChunkBytes);
  EXPECT_GE(chunks, 4u);
  Spit(out.path() / "a.tar", tar);
  const std::string cmd = "tar -xf '" + (out.path() / "a.tar").string() + "' -C '" + out.path().string() + "'";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::filesystem::remove(out.path() / "a.tar");
  EXPECT_EQ(Snapshot(out.path()), (std::map<std::string, std::string>{
                                      {"adapter_model.safetensors", big},
                                      {"adapter_config.json", small},
                                      {"checkpoint_complete", ""}}));
  // Member order and types as listed by tar itself.
  const std::string list = (out.path() / "list.txt").string();
  Spit(out.path() / "a.tar", tar);
  ASSERT_EQ(std::system(("tar -tf '" + (out.path() / "a.tar").string() + "' > '" + list + "'").c_str()), 0);
  EXPECT_EQ(Slurp(list), "adapter_model.safetensors\nadapter_config.json\ncheckpoint_complete\n");
}

TEST(TarStreamTest, OneFileStreamsAsItIsInBoundedChunks) {
  TempDir src;
  const std::string bytes = Bytes(2 * kStreamChunkBytes + 1, 2);
  std::string got;
  size_t largest = 0;
  absl::StatusOr<std::string> sha = StreamFile(Recorded(src.path(), "f", bytes), [&](absl::string_view c) {
    largest = std::max(largest, c.size());
    got.append(c.data(), c.size());
    return absl::OkStatus();
  });
  ASSERT_TRUE(sha.ok()) << sha.status();
  EXPECT_EQ(got, bytes);
  EXPECT_EQ(*sha, Sha256Hex(bytes));
  EXPECT_LE(largest, kStreamChunkBytes);
}

TEST(TarStreamTest, AFileThatDiffersFromItsRecordFailsTheStream) {
  TempDir src;
  StreamedFile f = Recorded(src.path(), "w", Bytes(5000, 3));
  auto sink = [](absl::string_view) { return absl::OkStatus(); };
  Spit(f.path, Bytes(5000, 4));  // same size, other bytes
  absl::StatusOr<std::string> changed = StreamTar({f}, 0, sink);
  EXPECT_TRUE(absl::IsDataLoss(changed.status())) << changed.status();
  EXPECT_THAT(changed.status().message(), HasSubstr("file w"));
  Spit(f.path, Bytes(5001, 3));  // longer
  EXPECT_TRUE(absl::IsDataLoss(StreamFile(f, sink).status()));
  Spit(f.path, Bytes(4999, 3));  // shorter
  EXPECT_TRUE(absl::IsDataLoss(StreamFile(f, sink).status()));
  std::filesystem::remove(f.path);
  EXPECT_TRUE(absl::IsNotFound(StreamFile(f, sink).status()));
}

TEST(TarStreamTest, NamesMustFitTheHeaderAndTheSinksErrorStopsTheStream) {
  TempDir src;
  StreamedFile ok = Recorded(src.path(), "x", "abc");
  StreamedFile at_limit = ok, over = ok;
  at_limit.name = std::string(kMaxTarNameBytes, 'n');
  over.name = std::string(kMaxTarNameBytes + 1, 'n');
  auto sink = [](absl::string_view) { return absl::OkStatus(); };
  EXPECT_TRUE(StreamTar({at_limit}, 0, sink).ok());
  absl::StatusOr<std::string> refused = StreamTar({ok, over}, 0, sink);
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status())) << refused.status();
  int calls = 0;
  absl::StatusOr<std::string> stopped = StreamTar({ok}, 0, [&](absl::string_view) {
    ++calls;
    return absl::CancelledError("client gone");
  });
  EXPECT_TRUE(absl::IsCancelled(stopped.status()));
  EXPECT_EQ(calls, 1);
}

}  // namespace
}  // namespace twinkle::storage
