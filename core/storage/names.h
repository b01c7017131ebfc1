#pragma once
// Validation of names that become path components (checkpoint names, run ids, export
// names): nothing a client sends may ever address a path outside its tenant's root.

#include <filesystem>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace twinkle::storage {

// OK for 1..128 characters from [A-Za-z0-9._-], not "." or "..", not starting with '.'.
// InvalidArgument naming `field` and the rule broken otherwise (the name is quoted with
// control characters escaped).
absl::Status ValidatePathName(absl::string_view name, absl::string_view field);

// True when `path` (after lexical normalisation) lies strictly below `root` (root itself is
// not inside it). Purely lexical: symlinks are not resolved, so callers must not follow
// links they did not create. An absolute path is never inside a relative root or the
// other way round; empty paths are inside nothing.
bool IsInside(const std::filesystem::path& root, const std::filesystem::path& path);

}  // namespace twinkle::storage
