#include "core/storage/filesystem.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <system_error>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"

namespace twinkle::storage {
namespace {

std::string ErrnoText(int error_number) {
  char buf[256];
  // GNU strerror_r returns the message (maybe not in buf); XSI returns an int.
  auto result = strerror_r(error_number, buf, sizeof(buf));
  if constexpr (std::is_same_v<decltype(result), char*>) {
    return std::string(result);
  } else {
    if (result != 0) return absl::StrCat("errno ", error_number);
    return std::string(buf);
  }
}

absl::Status PathError(int error_number, absl::string_view op, const fs::path& path) {
  return ErrnoStatus(error_number, op, path.string());
}

class PosixWritableFile final : public WritableFile {
 public:
  PosixWritableFile(int fd, fs::path path) : fd_(fd), path_(std::move(path)) {}
  ~PosixWritableFile() override { (void)Close(); }

  absl::Status Append(absl::string_view data) override {
    if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat("write ", path_.string(), ": file is closed"));
    const char* p = data.data();
    size_t left = data.size();
    while (left > 0) {
      ssize_t n = ::write(fd_, p, left);
      if (n < 0) {
        if (errno == EINTR) continue;
        return PathError(errno, "write", path_);
      }
      p += n;
      left -= static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

  absl::Status Sync() override {
    if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat("fsync ", path_.string(), ": file is closed"));
    while (::fsync(fd_) != 0) {
      if (errno == EINTR) continue;
      return PathError(errno, "fsync", path_);
    }
    return absl::OkStatus();
  }

  absl::Status Close() override {
    if (fd_ < 0) return absl::OkStatus();
    int fd = std::exchange(fd_, -1);
    // Linux closes the descriptor even when close() reports EINTR: never retry.
    if (::close(fd) != 0 && errno != EINTR) return PathError(errno, "close", path_);
    return absl::OkStatus();
  }

 private:
  int fd_;
  fs::path path_;
};

class PosixFileSystem final : public FileSystem {
 public:
  absl::StatusOr<std::unique_ptr<WritableFile>> OpenForWrite(const fs::path& path) override {
    int fd;
    do {
      fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return PathError(errno, "open", path);
    return std::unique_ptr<WritableFile>(new PosixWritableFile(fd, path));
  }

  absl::StatusOr<std::string> ReadFile(const fs::path& path) override {
    int fd;
    do {
      fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return PathError(errno, "open", path);
    std::string out;
    struct stat st;
    if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0) {
      out.reserve(static_cast<size_t>(st.st_size));
    }
    char buf[1 << 16];
    while (true) {
      ssize_t n = ::read(fd, buf, sizeof(buf));
      if (n < 0) {
        if (errno == EINTR) continue;
        int err = errno;
        ::close(fd);
        return PathError(err, "read", path);
      }
      if (n == 0) break;
      out.append(buf, static_cast<size_t>(n));
    }
    ::close(fd);
    return out;
  }

  absl::Status Rename(const fs::path& from, const fs::path& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) {
      return ErrnoStatus(errno, "rename", absl::StrCat(from.string(), " -> ", to.string()));
    }
    return absl::OkStatus();
  }

  absl::Status SyncDir(const fs::path& dir) override {
    int fd;
    do {
      fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return PathError(errno, "open", dir);
    int rc;
    do {
      rc = ::fsync(fd);
    } while (rc != 0 && errno == EINTR);
    int err = errno;
    ::close(fd);
    if (rc != 0) return PathError(err, "fsync", dir);
    return absl::OkStatus();
  }

  absl::Status CreateDirs(const fs::path& dir) override {
    if (dir.empty()) return absl::OkStatus();
    fs::path prefix;
    for (const fs::path& part : dir) {
      prefix /= part;
      if (part.empty() || part == prefix.root_path()) continue;
      if (::mkdir(prefix.c_str(), 0700) == 0) continue;
      int err = errno;
      if (err == EEXIST) {
        struct stat st;
        if (::stat(prefix.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) continue;
        return PathError(ENOTDIR, "mkdir", prefix);
      }
      return PathError(err, "mkdir", prefix);
    }
    return absl::OkStatus();
  }

  absl::Status RemoveAll(const fs::path& path) override {
    std::error_code ec;
    fs::remove_all(path, ec);
    if (ec && ec.value() != ENOENT) return PathError(ec.value(), "remove", path);
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<std::string>> ListDir(const fs::path& dir) override {
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) return PathError(errno, "list", dir);
    std::vector<std::string> names;
    while (true) {
      errno = 0;
      struct dirent* e = ::readdir(d);
      if (e == nullptr) {
        int err = errno;
        ::closedir(d);
        if (err != 0) return PathError(err, "list", dir);
        break;
      }
      if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
      names.emplace_back(e->d_name);
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  bool Exists(const fs::path& path) override {
    struct stat st;
    return ::lstat(path.c_str(), &st) == 0;
  }

  absl::StatusOr<int64_t> FileSize(const fs::path& path) override {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) return PathError(errno, "stat", path);
    if (!S_ISREG(st.st_mode)) {
      return absl::FailedPreconditionError(absl::StrCat("stat ", path.string(), ": not a regular file"));
    }
    return static_cast<int64_t>(st.st_size);
  }
};

// Forwards to the wrapped file, asking the filesystem first whether to fail.
class FaultInjectingFile final : public WritableFile {
 public:
  FaultInjectingFile(FaultInjectingFileSystem& fs, std::unique_ptr<WritableFile> base, fs::path path)
      : fs_(fs), base_(std::move(base)), path_(std::move(path)) {}

  absl::Status Append(absl::string_view data) override {
    if (absl::Status s = fs_.MaybeFail(FaultInjectingFileSystem::Op::kWrite, path_); !s.ok()) return s;
    return base_->Append(data);
  }
  absl::Status Sync() override {
    if (absl::Status s = fs_.MaybeFail(FaultInjectingFileSystem::Op::kSync, path_); !s.ok()) return s;
    return base_->Sync();
  }
  absl::Status Close() override { return base_->Close(); }

 private:
  FaultInjectingFileSystem& fs_;
  std::unique_ptr<WritableFile> base_;
  fs::path path_;
};

const char* OpName(FaultInjectingFileSystem::Op op) {
  switch (op) {
    case FaultInjectingFileSystem::Op::kOpen: return "open";
    case FaultInjectingFileSystem::Op::kWrite: return "write";
    case FaultInjectingFileSystem::Op::kSync: return "fsync";
    case FaultInjectingFileSystem::Op::kRename: return "rename";
  }
  return "?";
}

}  // namespace

absl::Status ErrnoStatus(int error_number, absl::string_view op, absl::string_view subject) {
  std::string msg = absl::StrCat(std::string(op), " ", std::string(subject), ": ", ErrnoText(error_number));
  switch (error_number) {
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(msg);
    case ENOENT:
      return absl::NotFoundError(msg);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(msg);
    case EEXIST:
    case ENOTEMPTY:
      return absl::AlreadyExistsError(msg);
    default:
      return absl::InternalError(msg);
  }
}

absl::Status CreateDirsDurably(FileSystem& fs, const fs::path& dir) {
  // The components missing now, outermost first; created one by one, each synced into its
  // parent as soon as it exists.
  std::vector<fs::path> missing;
  for (fs::path p = dir; !p.empty() && p != p.root_path() && !fs.Exists(p); p = p.parent_path()) {
    missing.push_back(p);
  }
  if (absl::Status s = fs.CreateDirs(dir); !s.ok()) return s;
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    const fs::path parent = it->parent_path().empty() ? fs::path(".") : it->parent_path();
    if (absl::Status s = fs.SyncDir(parent); !s.ok()) return s;
  }
  return absl::OkStatus();
}

FileSystem& RealFileSystem() {
  static PosixFileSystem* fs = new PosixFileSystem();
  return *fs;
}

void FaultInjectingFileSystem::Arm(Op op, int error_number, int nth) {
  absl::MutexLock lock(&mu_);
  armed_ = nth >= 1;
  op_ = op;
  errno_ = error_number;
  remaining_ = nth;
}

void FaultInjectingFileSystem::Disarm() {
  absl::MutexLock lock(&mu_);
  armed_ = false;
}

absl::StatusOr<FaultInjectingFileSystem::Op> FaultInjectingFileSystem::ParseOp(absl::string_view name) {
  if (name == "open") return Op::kOpen;
  if (name == "write") return Op::kWrite;
  if (name == "fsync") return Op::kSync;
  if (name == "rename") return Op::kRename;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown filesystem operation '", std::string(name), "' (open, write, fsync, rename)"));
}

int FaultInjectingFileSystem::TakeFault(Op op) {
  absl::MutexLock lock(&mu_);
  if (!armed_ || op_ != op) return 0;
  if (--remaining_ > 0) return 0;
  armed_ = false;
  return errno_;
}

absl::Status FaultInjectingFileSystem::MaybeFail(Op op, const fs::path& path) {
  if (int err = TakeFault(op); err != 0) return ErrnoStatus(err, OpName(op), path.string());
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<WritableFile>> FaultInjectingFileSystem::OpenForWrite(const fs::path& path) {
  if (absl::Status s = MaybeFail(Op::kOpen, path); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<WritableFile>> file = base_.OpenForWrite(path);
  if (!file.ok()) return file.status();
  return std::unique_ptr<WritableFile>(new FaultInjectingFile(*this, *std::move(file), path));
}

absl::Status FaultInjectingFileSystem::Rename(const fs::path& from, const fs::path& to) {
  if (int err = TakeFault(Op::kRename); err != 0) {
    return ErrnoStatus(err, "rename", absl::StrCat(from.string(), " -> ", to.string()));
  }
  return base_.Rename(from, to);
}

absl::Status FaultInjectingFileSystem::SyncDir(const fs::path& dir) {
  if (absl::Status s = MaybeFail(Op::kSync, dir); !s.ok()) return s;
  return base_.SyncDir(dir);
}

}  // namespace twinkle::storage
