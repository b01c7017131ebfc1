#include "core/storage/filesystem.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/unit/core/storage/temp_dir.h"

namespace twinkle::storage {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using testing::Slurp;
using testing::TempDir;

absl::Status WriteAll(FileSystem& fs, const fs::path& p, const std::string& bytes) {
  auto f = fs.OpenForWrite(p);
  if (!f.ok()) return f.status();
  if (auto s = (*f)->Append(bytes); !s.ok()) return s;
  if (auto s = (*f)->Sync(); !s.ok()) return s;
  return (*f)->Close();
}

mode_t Mode(const fs::path& p) {
  struct stat st {};
  EXPECT_EQ(::stat(p.c_str(), &st), 0) << p;
  return st.st_mode & 07777;
}

TEST(RealFileSystemTest, WriteReadRenameListSizeRemove) {
  TempDir tmp;
  FileSystem& fs = RealFileSystem();
  const fs::path dir = tmp.path() / "a" / "b" / "c";
  ASSERT_TRUE(fs.CreateDirs(dir).ok());
  ASSERT_TRUE(fs.CreateDirs(dir).ok()) << "mkdir -p of an existing dir is fine";
  EXPECT_EQ(Mode(tmp.path() / "a"), 0700u);
  EXPECT_EQ(Mode(dir), 0700u);

  std::string big(300000, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 7 + 3);
  ASSERT_TRUE(WriteAll(fs, dir / "f", big).ok());
  EXPECT_EQ(Mode(dir / "f"), 0600u);
  EXPECT_EQ(*fs.ReadFile(dir / "f"), big);
  EXPECT_EQ(*fs.FileSize(dir / "f"), static_cast<int64_t>(big.size()));

  // Truncates on reopen.
  ASSERT_TRUE(WriteAll(fs, dir / "f", "xy").ok());
  EXPECT_EQ(*fs.ReadFile(dir / "f"), "xy");

  ASSERT_TRUE(fs.Rename(dir / "f", dir / "g").ok());
  EXPECT_FALSE(fs.Exists(dir / "f"));
  EXPECT_TRUE(fs.Exists(dir / "g"));
  ASSERT_TRUE(WriteAll(fs, dir / "e", "").ok());
  ASSERT_TRUE(fs.CreateDirs(dir / "sub").ok());
  EXPECT_THAT(*fs.ListDir(dir), ElementsAre("e", "g", "sub"));
  EXPECT_TRUE(fs.SyncDir(dir).ok());

  ASSERT_TRUE(fs.RemoveAll(tmp.path() / "a").ok());
  EXPECT_FALSE(fs.Exists(tmp.path() / "a"));
  EXPECT_TRUE(fs.RemoveAll(tmp.path() / "a").ok()) << "absent is not an error";
  EXPECT_THAT(*fs.ListDir(tmp.path()), IsEmpty());
}

TEST(RealFileSystemTest, CloseIsIdempotent) {
  TempDir tmp;
  auto f = RealFileSystem().OpenForWrite(tmp.path() / "x");
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE((*f)->Append("abc").ok());
  EXPECT_TRUE((*f)->Close().ok());
  EXPECT_TRUE((*f)->Close().ok());
  EXPECT_FALSE((*f)->Append("more").ok());
  EXPECT_EQ(Slurp(tmp.path() / "x"), "abc");
}

TEST(RealFileSystemTest, ErrorsNameOpPathAndErrno) {
  TempDir tmp;
  FileSystem& fs = RealFileSystem();
  const fs::path missing = tmp.path() / "nope" / "f";

  auto open = fs.OpenForWrite(missing);
  ASSERT_FALSE(open.ok());
  EXPECT_TRUE(absl::IsNotFound(open.status()));
  EXPECT_EQ(open.status().message(), "open " + missing.string() + ": " + std::strerror(ENOENT));

  auto read = fs.ReadFile(missing);
  EXPECT_TRUE(absl::IsNotFound(read.status()));
  EXPECT_THAT(std::string(read.status().message()), HasSubstr(missing.string()));

  absl::Status rename = fs.Rename(missing, tmp.path() / "g");
  EXPECT_TRUE(absl::IsNotFound(rename));
  EXPECT_EQ(rename.message(), "rename " + missing.string() + " -> " + (tmp.path() / "g").string() +
                                  ": " + std::strerror(ENOENT));

  EXPECT_TRUE(absl::IsNotFound(fs.SyncDir(missing)));
  EXPECT_TRUE(absl::IsNotFound(fs.ListDir(missing).status()));
  EXPECT_TRUE(absl::IsNotFound(fs.FileSize(missing).status()));

  // mkdir through a regular file.
  ASSERT_TRUE(WriteAll(fs, tmp.path() / "file", "x").ok());
  absl::Status mk = fs.CreateDirs(tmp.path() / "file" / "sub");
  EXPECT_FALSE(mk.ok());
  EXPECT_THAT(std::string(mk.message()), HasSubstr("mkdir " + (tmp.path() / "file").string()));
}

TEST(ErrnoStatusTest, CodesAndMessage) {
  EXPECT_TRUE(absl::IsResourceExhausted(ErrnoStatus(ENOSPC, "write", "/p")));
  EXPECT_TRUE(absl::IsResourceExhausted(ErrnoStatus(EDQUOT, "write", "/p")));
  EXPECT_TRUE(absl::IsNotFound(ErrnoStatus(ENOENT, "open", "/p")));
  EXPECT_TRUE(absl::IsPermissionDenied(ErrnoStatus(EACCES, "open", "/p")));
  EXPECT_TRUE(absl::IsPermissionDenied(ErrnoStatus(EROFS, "open", "/p")));
  EXPECT_TRUE(absl::IsAlreadyExists(ErrnoStatus(ENOTEMPTY, "rename", "/p")));
  EXPECT_TRUE(absl::IsInternal(ErrnoStatus(EIO, "fsync", "/p")));
  EXPECT_EQ(ErrnoStatus(ENOSPC, "fsync", "/data/x.safetensors").message(),
            std::string("fsync /data/x.safetensors: ") + std::strerror(ENOSPC));
}

TEST(FaultInjectingFileSystemTest, ParseOp) {
  EXPECT_EQ(*FaultInjectingFileSystem::ParseOp("open"), FaultInjectingFileSystem::Op::kOpen);
  EXPECT_EQ(*FaultInjectingFileSystem::ParseOp("write"), FaultInjectingFileSystem::Op::kWrite);
  EXPECT_EQ(*FaultInjectingFileSystem::ParseOp("fsync"), FaultInjectingFileSystem::Op::kSync);
  EXPECT_EQ(*FaultInjectingFileSystem::ParseOp("rename"), FaultInjectingFileSystem::Op::kRename);
  auto bad = FaultInjectingFileSystem::ParseOp("sync");
  EXPECT_TRUE(absl::IsInvalidArgument(bad.status()));
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("sync"));
}

TEST(FaultInjectingFileSystemTest, FailsExactlyTheNthCallOnce) {
  TempDir tmp;
  FaultInjectingFileSystem fs(RealFileSystem());
  using Op = FaultInjectingFileSystem::Op;

  fs.Arm(Op::kOpen, ENOSPC, 3);
  EXPECT_TRUE(fs.OpenForWrite(tmp.path() / "1").ok());
  EXPECT_TRUE(fs.OpenForWrite(tmp.path() / "2").ok());
  auto third = fs.OpenForWrite(tmp.path() / "3");
  ASSERT_FALSE(third.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(third.status()));
  EXPECT_EQ(third.status().message(),
            "open " + (tmp.path() / "3").string() + ": " + std::strerror(ENOSPC));
  EXPECT_FALSE(fs.Exists(tmp.path() / "3")) << "a failed open creates nothing";
  EXPECT_TRUE(fs.OpenForWrite(tmp.path() / "4").ok()) << "the fault is spent";

  // Other ops do not count towards the armed one.
  fs.Arm(Op::kWrite, EIO, 2);
  auto f = fs.OpenForWrite(tmp.path() / "w");
  ASSERT_TRUE(f.ok());
  EXPECT_TRUE((*f)->Sync().ok());
  EXPECT_TRUE((*f)->Append("a").ok());
  absl::Status w = (*f)->Append("b");
  EXPECT_TRUE(absl::IsInternal(w));
  EXPECT_EQ(w.message(), "write " + (tmp.path() / "w").string() + ": " + std::strerror(EIO));
  EXPECT_TRUE((*f)->Append("c").ok());
  EXPECT_TRUE((*f)->Close().ok());
  EXPECT_EQ(Slurp(tmp.path() / "w"), "ac");

  // fsync counts file and directory syncs alike.
  fs.Arm(Op::kSync, ENOSPC, 2);
  auto g = fs.OpenForWrite(tmp.path() / "s");
  ASSERT_TRUE(g.ok());
  EXPECT_TRUE((*g)->Sync().ok());
  absl::Status ds = fs.SyncDir(tmp.path());
  EXPECT_TRUE(absl::IsResourceExhausted(ds));
  EXPECT_EQ(ds.message(), "fsync " + tmp.path().string() + ": " + std::strerror(ENOSPC));
  EXPECT_TRUE(fs.SyncDir(tmp.path()).ok());

  fs.Arm(Op::kRename, EIO);
  absl::Status r = fs.Rename(tmp.path() / "s", tmp.path() / "t");
  EXPECT_TRUE(absl::IsInternal(r));
  EXPECT_EQ(r.message(), "rename " + (tmp.path() / "s").string() + " -> " + (tmp.path() / "t").string() +
                             ": " + std::strerror(EIO));
  EXPECT_TRUE(fs.Exists(tmp.path() / "s")) << "a failed rename renames nothing";
  EXPECT_TRUE(fs.Rename(tmp.path() / "s", tmp.path() / "t").ok());

  // Disarm and re-arm.
  fs.Arm(Op::kOpen, EIO);
  fs.Disarm();
  EXPECT_TRUE(fs.OpenForWrite(tmp.path() / "5").ok());
  fs.Arm(Op::kOpen, EIO);
  fs.Arm(Op::kRename, EIO);  // replaces the open fault
  EXPECT_TRUE(fs.OpenForWrite(tmp.path() / "6").ok());
  EXPECT_FALSE(fs.Rename(tmp.path() / "6", tmp.path() / "7").ok());
}

}  // namespace
}  // namespace twinkle::storage
