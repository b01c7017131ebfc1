#include "core/storage/names.h"

#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace twinkle::storage {
namespace {

constexpr size_t kMaxNameLength = 128;
constexpr size_t kMaxQuoted = 64;

bool AllowedChar(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
}

// 'name' with control and non-ASCII bytes escaped, cut to kMaxQuoted bytes.
std::string Quote(absl::string_view name) {
  bool cut = name.size() > kMaxQuoted;
  std::string head(name.substr(0, kMaxQuoted));
  return absl::StrCat("'", absl::CHexEscape(head), cut ? "'..." : "'");
}

absl::Status Invalid(absl::string_view field, absl::string_view name, absl::string_view rule) {
  return absl::InvalidArgumentError(
      absl::StrCat(std::string(field), " ", Quote(name), " ", std::string(rule)));
}

}  // namespace

absl::Status ValidatePathName(absl::string_view name, absl::string_view field) {
  if (name.empty()) return absl::InvalidArgumentError(absl::StrCat(std::string(field), " must not be empty"));
  if (name.size() > kMaxNameLength) {
    return Invalid(field, name,
                   absl::StrCat("is ", name.size(), " characters long; at most ", kMaxNameLength, " allowed"));
  }
  for (char c : name) {
    if (!AllowedChar(c)) return Invalid(field, name, "may only contain A-Z a-z 0-9 . _ -");
  }
  if (name == "." || name == "..") return Invalid(field, name, "must not be '.' or '..'");
  if (name.front() == '.') return Invalid(field, name, "must not start with '.'");
  return absl::OkStatus();
}

bool IsInside(const std::filesystem::path& root, const std::filesystem::path& path) {
  if (root.empty() || path.empty()) return false;
  if (root.is_absolute() != path.is_absolute()) return false;
  std::vector<std::filesystem::path> r;
  for (const auto& part : root.lexically_normal()) {
    if (!part.empty()) r.push_back(part);  // a trailing '/' shows up as an empty part
  }
  std::vector<std::filesystem::path> p;
  for (const auto& part : path.lexically_normal()) {
    if (!part.empty()) p.push_back(part);
  }
  // A root that still climbs ("../x") is fine to compare lexically; a path that climbs
  // beyond where the root does cannot be below it. Strictly below: the root is not inside.
  if (p.size() <= r.size()) return false;
  for (size_t i = 0; i < r.size(); ++i) {
    if (r[i] != p[i]) return false;
  }
  for (size_t i = r.size(); i < p.size(); ++i) {
    if (p[i] == "..") return false;  // lexically_normal keeps only leading "..": cannot happen here
  }
  return true;
}

}  // namespace twinkle::storage
