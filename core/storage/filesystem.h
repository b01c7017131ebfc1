#pragma once
// The filesystem as checkpoint and registry code sees it: a small interface, so that tests
// (and the server's test hooks) can make any single operation fail — ENOSPC or EIO at open,
// write, fsync or rename — without root, special mounts or a full disk.
//
// Paths are absolute or relative std::filesystem paths; every error names the operation, the
// path and the errno text ("fsync /data/.../adapter_model.safetensors: No space left on
// device"; rename names both paths: "rename /a -> /b: ..."). Operation words: open, read,
// write, fsync (files and directories), close, rename, mkdir, remove, list, stat.
//
// Status codes follow errno (ErrnoStatus): ENOSPC, EDQUOT -> ResourceExhausted;
// ENOENT -> NotFound; EACCES, EPERM, EROFS -> PermissionDenied; EEXIST, ENOTEMPTY ->
// AlreadyExists; anything else (EIO, ...) -> Internal.

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace twinkle::storage {

namespace fs = std::filesystem;

// The error for a failed `op` on `subject` (a path, or "from -> to"): the message is
// "<op> <subject>: <strerror(error_number)>", the code as listed above.
absl::Status ErrnoStatus(int error_number, absl::string_view op, absl::string_view subject);

// A file open for writing (created or truncated).
class WritableFile {
 public:
  virtual ~WritableFile() = default;
  virtual absl::Status Append(absl::string_view data) = 0;
  virtual absl::Status Sync() = 0;   // fsync
  virtual absl::Status Close() = 0;  // idempotent; the destructor closes too (errors lost)
};

class FileSystem {
 public:
  virtual ~FileSystem() = default;
  virtual absl::StatusOr<std::unique_ptr<WritableFile>> OpenForWrite(const fs::path& path) = 0;
  virtual absl::StatusOr<std::string> ReadFile(const fs::path& path) = 0;
  // rename(2): atomic within one filesystem; replaces an existing file, or an empty dir.
  virtual absl::Status Rename(const fs::path& from, const fs::path& to) = 0;
  // fsync of a directory, so that entries created or renamed in it are durable.
  virtual absl::Status SyncDir(const fs::path& dir) = 0;
  virtual absl::Status CreateDirs(const fs::path& dir) = 0;  // mkdir -p, mode 0700
  virtual absl::Status RemoveAll(const fs::path& path) = 0;  // no error if absent; no symlink followed
  // Entry names (not "." or ".."), sorted.
  virtual absl::StatusOr<std::vector<std::string>> ListDir(const fs::path& dir) = 0;
  virtual bool Exists(const fs::path& path) = 0;  // lstat: a dangling symlink exists
  virtual absl::StatusOr<int64_t> FileSize(const fs::path& path) = 0;
};

// The real thing (POSIX open/write/fsync/rename).
FileSystem& RealFileSystem();

// mkdir -p that survives a crash: each directory it creates is fsynced into its parent
// (deepest last), so a new run or checkpoint folder cannot vanish after power loss while
// what was written inside it stays referenced. Directories that already existed are left
// alone (nothing is synced for them).
absl::Status CreateDirsDurably(FileSystem& fs, const fs::path& dir);

// Wraps another FileSystem and fails chosen operations. Thread-safe.
class FaultInjectingFileSystem final : public FileSystem {
 public:
  enum class Op { kOpen, kWrite, kSync, kRename };
  explicit FaultInjectingFileSystem(FileSystem& base) : base_(base) {}

  // The `nth` (1-based) next call of `op` fails with `error_number` (ENOSPC, EIO, ...), then
  // the fault is spent. Only one fault is armed at a time; arming replaces it.
  // kOpen counts OpenForWrite; kWrite counts WritableFile::Append; kSync counts both
  // WritableFile::Sync and SyncDir; kRename counts Rename. A failing call does nothing else
  // (no bytes written, nothing renamed) and returns ErrnoStatus(error_number, op, path).
  void Arm(Op op, int error_number, int nth = 1);
  void Disarm();
  // Parses "open" | "write" | "fsync" | "rename".
  static absl::StatusOr<Op> ParseOp(absl::string_view name);

  absl::StatusOr<std::unique_ptr<WritableFile>> OpenForWrite(const fs::path& path) override;
  absl::StatusOr<std::string> ReadFile(const fs::path& path) override { return base_.ReadFile(path); }
  absl::Status Rename(const fs::path& from, const fs::path& to) override;
  absl::Status SyncDir(const fs::path& dir) override;
  absl::Status CreateDirs(const fs::path& dir) override { return base_.CreateDirs(dir); }
  absl::Status RemoveAll(const fs::path& path) override { return base_.RemoveAll(path); }
  absl::StatusOr<std::vector<std::string>> ListDir(const fs::path& dir) override { return base_.ListDir(dir); }
  bool Exists(const fs::path& path) override { return base_.Exists(path); }
  absl::StatusOr<int64_t> FileSize(const fs::path& path) override { return base_.FileSize(path); }

  // Called by the files this filesystem opened: fails when the armed fault hits.
  absl::Status MaybeFail(Op op, const fs::path& path);

 private:
  // Counts one call of `op`; returns the errno to fail it with, or 0.
  int TakeFault(Op op);

  FileSystem& base_;
  absl::Mutex mu_;
  bool armed_ ABSL_GUARDED_BY(mu_) = false;
  Op op_ ABSL_GUARDED_BY(mu_) = Op::kOpen;
  int errno_ ABSL_GUARDED_BY(mu_) = 0;
  int remaining_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace twinkle::storage
