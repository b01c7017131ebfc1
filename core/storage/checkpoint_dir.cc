#include "core/storage/checkpoint_dir.h"

#include <openssl/evp.h>

#include <array>
#include <cstdlib>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/storage/names.h"

namespace twinkle::storage {
namespace {

constexpr char kTmpPrefix[] = ".tmp-";
constexpr char kOldPrefix[] = ".old-";

// 16 hex digits, never containing '-' (RecoverDir splits `.old-<name>-<random>` at the last '-').
std::string RandomSuffix() {
  thread_local std::mt19937_64 rng{(static_cast<uint64_t>(std::random_device{}()) << 32) ^
                                   std::random_device{}()};
  static constexpr char kHex[] = "0123456789abcdef";
  uint64_t v = rng();
  std::string out(16, '0');
  for (int i = 0; i < 16; ++i) out[i] = kHex[(v >> (4 * i)) & 0xF];
  return out;
}

absl::Status WithContext(const absl::Status& status, absl::string_view context) {
  return absl::Status(status.code(), absl::StrCat(std::string(context), ": ", std::string(status.message())));
}

absl::Status WriteOneFile(FileSystem& fs, const fs::path& path, absl::string_view bytes) {
  absl::StatusOr<std::unique_ptr<WritableFile>> file = fs.OpenForWrite(path);
  if (!file.ok()) return file.status();
  if (absl::Status s = (*file)->Append(bytes); !s.ok()) return s;
  if (absl::Status s = (*file)->Sync(); !s.ok()) return s;
  return (*file)->Close();
}

// Writes a streamed file, hashing it as it goes. Returns its size and SHA-256.
absl::StatusOr<std::pair<uint64_t, std::string>> WriteStreamedFile(FileSystem& fs, const fs::path& path,
                                                                   const FileContent& content) {
  absl::StatusOr<std::unique_ptr<WritableFile>> file = fs.OpenForWrite(path);
  if (!file.ok()) return file.status();
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> sha(EVP_MD_CTX_new(), &EVP_MD_CTX_free);
  if (sha == nullptr || EVP_DigestInit_ex(sha.get(), EVP_sha256(), nullptr) != 1) std::abort();
  uint64_t size = 0;
  const AppendFn append = [&](absl::string_view piece) -> absl::Status {
    if (EVP_DigestUpdate(sha.get(), piece.data(), piece.size()) != 1) std::abort();
    size += piece.size();
    return (*file)->Append(piece);
  };
  if (absl::Status s = content.stream(append); !s.ok()) return s;
  if (absl::Status s = (*file)->Sync(); !s.ok()) return s;
  if (absl::Status s = (*file)->Close(); !s.ok()) return s;
  std::array<unsigned char, EVP_MAX_MD_SIZE> digest{};
  unsigned int digest_size = 0;
  if (EVP_DigestFinal_ex(sha.get(), digest.data(), &digest_size) != 1 || digest_size != 32) std::abort();
  return std::make_pair(size, absl::BytesToHexString(absl::string_view(
                                  reinterpret_cast<const char*>(digest.data()), digest_size)));
}

absl::Status ValidateFileName(const std::string& name) {
  if (absl::Status s = ValidatePathName(name, "checkpoint file name"); !s.ok()) return s;
  if (name == kMetadataFile) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint file name '", name, "' is reserved for the checkpoint's metadata"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string Sha256Hex(absl::string_view bytes) {
  std::array<unsigned char, EVP_MAX_MD_SIZE> digest{};
  unsigned int size = 0;
  if (EVP_Digest(bytes.data(), bytes.size(), digest.data(), &size, EVP_sha256(), nullptr) != 1 ||
      size != 32) {
    // Only allocation failure makes EVP_Digest fail; a wrong digest would pass corrupt data.
    std::abort();
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(digest.data()), size));
}

absl::StatusOr<fs::path> WriteCheckpointDir(FileSystem& fs, const fs::path& parent, const std::string& name,
                                            const std::vector<FileContent>& files,
                                            const nlohmann::json& metadata) {
  if (absl::Status s = ValidatePathName(name, "checkpoint name"); !s.ok()) return s;
  if (!metadata.is_null() && !metadata.is_object()) {
    return absl::InvalidArgumentError("checkpoint metadata must be a JSON object");
  }
  if (metadata.is_object() && metadata.contains("files")) {
    return absl::InvalidArgumentError("checkpoint metadata field 'files' is reserved");
  }
  std::set<std::string> seen;
  for (const FileContent& f : files) {
    if (absl::Status s = ValidateFileName(f.name); !s.ok()) return s;
    if (!seen.insert(f.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint file '", f.name, "' given twice"));
    }
  }

  const fs::path dest = parent / name;
  const std::string context = absl::StrCat("writing checkpoint ", dest.string());
  if (absl::Status s = CreateDirsDurably(fs, parent); !s.ok()) return WithContext(s, context);

  const fs::path tmp = parent / absl::StrCat(kTmpPrefix, name, "-", RandomSuffix());
  // Every failure from here on removes the temp dir (best effort) and reports `s`.
  auto fail = [&](const absl::Status& s) -> absl::Status {
    (void)fs.RemoveAll(tmp);
    return WithContext(s, context);
  };
  if (absl::Status s = fs.CreateDirs(tmp); !s.ok()) return fail(s);

  nlohmann::json meta = metadata.is_object() ? metadata : nlohmann::json::object();
  nlohmann::json listing = nlohmann::json::object();
  for (const FileContent& f : files) {
    if (f.stream) {
      absl::StatusOr<std::pair<uint64_t, std::string>> written = WriteStreamedFile(fs, tmp / f.name, f);
      if (!written.ok()) return fail(written.status());
      listing[f.name] = {{"size", written->first}, {"sha256", written->second}};
      continue;
    }
    if (absl::Status s = WriteOneFile(fs, tmp / f.name, f.bytes); !s.ok()) return fail(s);
    listing[f.name] = {{"size", f.bytes.size()}, {"sha256", Sha256Hex(f.bytes)}};
  }
  meta["files"] = std::move(listing);
  std::string meta_text;
  try {
    meta_text = meta.dump(2) + "\n";
  } catch (const nlohmann::json::exception& e) {  // invalid UTF-8 in a caller's field
    return fail(absl::InvalidArgumentError(absl::StrCat("checkpoint metadata: ", e.what())));
  }
  if (absl::Status s = WriteOneFile(fs, tmp / kMetadataFile, meta_text); !s.ok()) return fail(s);
  if (absl::Status s = fs.SyncDir(tmp); !s.ok()) return fail(s);

  // Swap in. From here a crash leaves `dest` or `.old-<name>-*` complete (see RecoverDir).
  std::optional<fs::path> old;
  if (fs.Exists(dest)) {
    old = parent / absl::StrCat(kOldPrefix, name, "-", RandomSuffix());
    if (absl::Status s = fs.Rename(dest, *old); !s.ok()) return fail(s);
  }
  if (absl::Status s = fs.Rename(tmp, dest); !s.ok()) {
    if (old) (void)fs.Rename(*old, dest);  // if this fails too, RecoverDir restores it
    return fail(s);
  }
  if (absl::Status s = fs.SyncDir(parent); !s.ok()) {
    // Not known to be durable: undo, so that an error always means "the old state".
    if (fs.Rename(dest, tmp).ok() && old) (void)fs.Rename(*old, dest);
    return fail(s);
  }
  // The new checkpoint is durable; a leftover old dir is only garbage for RecoverDir.
  if (old) (void)fs.RemoveAll(*old);
  return dest;
}

absl::StatusOr<nlohmann::json> VerifyCheckpointDir(FileSystem& fs, const fs::path& dir) {
  const fs::path meta_path = dir / kMetadataFile;
  absl::StatusOr<std::string> text = fs.ReadFile(meta_path);
  if (!text.ok()) {
    if (absl::IsNotFound(text.status())) {
      return absl::NotFoundError(absl::StrCat(dir.string(), " is not a checkpoint: no ", kMetadataFile));
    }
    return text.status();
  }
  nlohmann::json meta = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  auto bad = [&](const std::string& what) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint ", dir.string(), ": ", what));
  };
  if (meta.is_discarded()) return bad(absl::StrCat(kMetadataFile, " is not valid JSON"));
  if (!meta.is_object() || !meta.contains("files") || !meta["files"].is_object()) {
    return bad(absl::StrCat(kMetadataFile, " has no \"files\" object"));
  }
  for (const auto& [name, entry] : meta["files"].items()) {
    if (absl::Status s = ValidateFileName(name); !s.ok()) {
      return bad(absl::StrCat(kMetadataFile, " lists an invalid file: ", std::string(s.message())));
    }
    if (!entry.is_object() || !entry.contains("size") || !entry["size"].is_number_unsigned() ||
        !entry.contains("sha256") || !entry["sha256"].is_string()) {
      return bad(absl::StrCat(kMetadataFile, ": entry for '", name, "' needs size and sha256"));
    }
    const uint64_t want_size = entry["size"].get<uint64_t>();
    const std::string want_sha = entry["sha256"].get<std::string>();
    absl::StatusOr<std::string> bytes = fs.ReadFile(dir / name);
    if (!bytes.ok()) {
      if (absl::IsNotFound(bytes.status())) return bad(absl::StrCat("file '", name, "' is missing"));
      return bytes.status();
    }
    if (bytes->size() != want_size) {
      return bad(absl::StrCat("file '", name, "' has ", bytes->size(), " bytes, metadata says ", want_size));
    }
    const std::string got_sha = Sha256Hex(*bytes);
    if (got_sha != want_sha) {
      return bad(absl::StrCat("file '", name, "' has SHA-256 ", got_sha, ", metadata says ", want_sha));
    }
  }
  return meta;
}

absl::Status UpdateCheckpointMetadata(FileSystem& fs, const fs::path& dir, const nlohmann::json& fields) {
  if (!fields.is_object() || fields.contains("files")) {
    return absl::InvalidArgumentError("checkpoint metadata update: must be an object without 'files'");
  }
  const fs::path file = dir / kMetadataFile;
  absl::StatusOr<std::string> text = fs.ReadFile(file);
  if (!text.ok()) return text.status();
  nlohmann::json meta = nlohmann::json::parse(*text, nullptr, false);
  if (!meta.is_object()) {
    return absl::FailedPreconditionError(absl::StrCat(file.string(), ": unparsable checkpoint metadata"));
  }
  for (const auto& [key, value] : fields.items()) {
    if (value.is_null()) {
      meta.erase(key);
    } else {
      meta[key] = value;
    }
  }
  std::string out;
  try {
    out = meta.dump(2) + "\n";
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint metadata: ", e.what()));
  }
  const fs::path tmp = dir / absl::StrCat(kMetadataFile, ".tmp");
  if (absl::Status s = WriteOneFile(fs, tmp, out); !s.ok()) return s;
  if (absl::Status s = fs.Rename(tmp, file); !s.ok()) return s;
  return fs.SyncDir(dir);
}

absl::Status DeleteCheckpointDir(FileSystem& fs, const fs::path& dir) {
  if (!fs.Exists(dir)) return absl::OkStatus();
  const fs::path parent = dir.parent_path();
  const fs::path trash = parent / absl::StrCat(kTmpPrefix, "deleted-", dir.filename().string(), "-", RandomSuffix());
  const std::string context = absl::StrCat("deleting checkpoint ", dir.string());
  if (absl::Status s = fs.Rename(dir, trash); !s.ok()) return WithContext(s, context);
  if (absl::Status s = fs.SyncDir(parent); !s.ok()) {
    (void)fs.Rename(trash, dir);  // not known to be durable: an error means "still there"
    return WithContext(s, context);
  }
  (void)fs.RemoveAll(trash);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> RecoverDir(FileSystem& fs, const fs::path& parent) {
  std::vector<std::string> handled;
  if (!fs.Exists(parent)) return handled;
  absl::StatusOr<std::vector<std::string>> names = fs.ListDir(parent);
  if (!names.ok()) return names.status();
  bool changed = false;
  for (const std::string& entry : *names) {
    if (absl::StartsWith(entry, kTmpPrefix)) {
      if (absl::Status s = fs.RemoveAll(parent / entry); !s.ok()) return s;
      handled.push_back(entry);
      changed = true;
    }
  }
  // Sorted, so with several `.old-` dirs for one name (repeated crashes) the choice is stable.
  for (const std::string& entry : *names) {
    if (!absl::StartsWith(entry, kOldPrefix)) continue;
    const std::string rest = entry.substr(sizeof(kOldPrefix) - 1);
    const size_t dash = rest.rfind('-');
    const std::string name = dash == std::string::npos ? "" : rest.substr(0, dash);
    const fs::path target = parent / name;
    if (ValidatePathName(name, "checkpoint name").ok() && !fs.Exists(target)) {
      if (absl::Status s = fs.Rename(parent / entry, target); !s.ok()) return s;
    } else {
      if (absl::Status s = fs.RemoveAll(parent / entry); !s.ok()) return s;
    }
    handled.push_back(entry);
    changed = true;
  }
  if (changed) {
    if (absl::Status s = fs.SyncDir(parent); !s.ok()) return s;
  }
  return handled;
}

}  // namespace twinkle::storage
