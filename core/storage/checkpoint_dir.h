#pragma once
// Checkpoint directories written atomically and verified on read.
//
// Write: `parent` is created durably (CreateDirsDurably); every file goes into a fresh temp dir beside the destination (same filesystem:
// `<parent>/.tmp-<name>-<random>`), each file is fsynced, checkpoint_metadata.json (size and
// SHA-256 of every other file, plus caller-supplied fields) is written LAST and fsynced, the
// temp dir is fsynced, renamed into place, and the parent fsynced. A destination that exists
// is replaced: it is first renamed to `<parent>/.old-<name>-<random>`, the new dir renamed in,
// the parent fsynced, the old dir removed. A crash at any point leaves either the old or the
// new complete checkpoint under `<name>` (RecoverDir puts an `.old-` dir back when `<name>`
// is missing), plus temp dirs that RecoverDir removes.
//
// Read: VerifyCheckpointDir re-reads every file listed in the metadata and checks its size
// and SHA-256; a missing metadata file means the directory is not a checkpoint.

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/storage/filesystem.h"

namespace twinkle::storage {

inline constexpr char kMetadataFile[] = "checkpoint_metadata.json";

// Hands a streamed file's bytes to the writer, piece by piece, in order.
using AppendFn = std::function<absl::Status(absl::string_view piece)>;

struct FileContent {
  std::string name;   // a plain file name, no directories
  std::string bytes;
  // When set, the file's content comes from here instead of `bytes`: it is called once with
  // an AppendFn and must append every byte of the file through it (a file larger than memory,
  // such as a merged model's weights, is written without ever being held whole). An error it
  // returns (or one from the AppendFn, which it must pass on) fails the write like an I/O error.
  std::function<absl::Status(const AppendFn& append)> stream;
};

// Writes `files` (+ checkpoint_metadata.json with `metadata` merged into its top level and a
// "files" map {name: {size, sha256}}) as `parent/name`, atomically as described above.
// Creates `parent` if needed. On error nothing under `parent/name` changed, and the temp dir
// is removed when possible. Returns the final directory.
//
// InvalidArgument (nothing touched) when `name` or a file name fails ValidatePathName, a file
// name is kMetadataFile or repeated, or `metadata` is not an object or has a "files" key.
// I/O errors keep the FileSystem's code and read "writing checkpoint <parent/name>: <op>
// <path>: <errno text>". Should fsync of `parent` fail after the swap, the swap is undone
// (new dir removed, old one renamed back) before the error returns. Failing to remove the
// `.old-` dir after a successful swap is not an error (RecoverDir removes it later).
// Not safe against a concurrent writer of the same `parent/name`; callers serialise.
absl::StatusOr<fs::path> WriteCheckpointDir(FileSystem& fs, const fs::path& parent,
                                            const std::string& name,
                                            const std::vector<FileContent>& files,
                                            const nlohmann::json& metadata = nlohmann::json::object());

// Checks every file listed in dir's metadata (size and SHA-256). Returns the metadata.
// FailedPrecondition naming the file and what differs (also for unparsable metadata, or a
// listed name that fails ValidatePathName); NotFound without a metadata file. Files not
// listed in the metadata are ignored.
absl::StatusOr<nlohmann::json> VerifyCheckpointDir(FileSystem& fs, const fs::path& dir);

// Startup cleanup of one parent folder: removes `.tmp-*` dirs; for each `.old-<name>-*` dir,
// renames it back to `<name>` when `<name>` is missing (a crash mid-replace), else removes
// it. Returns the names of dirs removed or restored, for the log. Run it before any writer
// uses `parent` (it removes in-progress temp dirs); stops at the first I/O error. A missing
// `parent` is not an error.
absl::StatusOr<std::vector<std::string>> RecoverDir(FileSystem& fs, const fs::path& parent);

// Removes the checkpoint directory `dir` durably: it is first renamed to a temp name beside
// it (`.tmp-deleted-<name>-<random>`, which RecoverDir removes) and the parent fsynced, so
// once this returns OK the checkpoint cannot come back after a crash; then the renamed
// directory is removed (best effort: a failure there is left to RecoverDir). A missing `dir`
// is OK. Errors name the operation and path; nothing is removed when the rename fails.
absl::Status DeleteCheckpointDir(FileSystem& fs, const fs::path& dir);

// Sets top-level fields of dir's checkpoint_metadata.json (a null value removes the field),
// atomically: the new text is written to checkpoint_metadata.json.tmp beside it, fsynced and
// renamed over it, and the directory fsynced; a crash leaves the old or the new metadata.
// The files and their listing are untouched, so VerifyCheckpointDir passes as before.
// InvalidArgument when `fields` is not an object or names "files"; NotFound without metadata.
absl::Status UpdateCheckpointMetadata(FileSystem& fs, const fs::path& dir, const nlohmann::json& fields);

// Lower-case hex SHA-256.
std::string Sha256Hex(absl::string_view bytes);

}  // namespace twinkle::storage
