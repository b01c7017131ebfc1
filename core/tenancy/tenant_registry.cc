#include "core/tenancy/tenant_registry.h"

#include <openssl/crypto.h>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace twinkle::tenancy {

bool IsValidTenantId(absl::string_view id) {
  if (id.empty() || id.size() > 64) return false;
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

TenantRegistry TenantRegistry::Open(const Quotas& quotas) {
  TenantRegistry registry;
  registry.auth_enabled_ = false;
  registry.tenants_.push_back(std::make_unique<Tenant>(Tenant{kDefaultTenantId, quotas}));
  registry.by_id_[kDefaultTenantId] = registry.tenants_.back().get();
  return registry;
}

absl::StatusOr<TenantRegistry> TenantRegistry::WithKeys(std::vector<TenantSpec> tenants) {
  if (tenants.empty()) {
    return absl::InvalidArgumentError("authentication is enabled but no tenant is configured");
  }
  TenantRegistry registry;
  registry.auth_enabled_ = true;
  absl::flat_hash_set<std::string> seen_digests;
  for (TenantSpec& spec : tenants) {
    if (!IsValidTenantId(spec.id)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tenant id '", spec.id.substr(0, 80), "' is not 1-64 of [a-z0-9_-]"));
    }
    if (registry.by_id_.contains(spec.id)) {
      return absl::InvalidArgumentError(absl::StrCat("tenant '", spec.id, "' is defined twice"));
    }
    if (spec.key_sha256.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("tenant '", spec.id, "' has no key"));
    }
    registry.tenants_.push_back(std::make_unique<Tenant>(Tenant{spec.id, spec.quotas}));
    const size_t index = registry.tenants_.size();  // 1-based: 0 means "no match"
    for (const std::string& hex : spec.key_sha256) {
      std::optional<Sha256Digest> digest = ParseSha256Hex(hex);
      if (!digest) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tenant '", spec.id, "': a key_sha256 entry is not 64 hex digits"));
      }
      const std::string canonical(digest->begin(), digest->end());
      if (!seen_digests.insert(canonical).second) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tenant '", spec.id, "': a key_sha256 digest is listed more than once"));
      }
      registry.keys_.emplace_back(*digest, index);
    }
    registry.by_id_[spec.id] = registry.tenants_.back().get();
  }
  return registry;
}

absl::StatusOr<const Tenant*> TenantRegistry::Authenticate(absl::string_view api_key) const {
  if (!auth_enabled_) return tenants_.front().get();
  if (api_key.empty()) return absl::UnauthenticatedError("missing API key");
  const Sha256Digest presented = Sha256(api_key);
  // Every digest is compared, and the match is selected with a mask rather than a branch,
  // so the time taken depends only on how many digests there are.
  size_t found = 0;
  for (const auto& [digest, index] : keys_) {
    const size_t equal =
        static_cast<size_t>(CRYPTO_memcmp(digest.data(), presented.data(), digest.size()) == 0);
    const size_t mask = size_t{0} - equal;  // all ones on a match, else zero
    found = (found & ~mask) | (index & mask);
  }
  if (found == 0) return absl::UnauthenticatedError("invalid API key");
  return tenants_[found - 1].get();
}

const Tenant* TenantRegistry::Find(absl::string_view id) const {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second;
}

std::vector<const Tenant*> TenantRegistry::tenants() const {
  std::vector<const Tenant*> out;
  out.reserve(tenants_.size());
  for (const auto& t : tenants_) out.push_back(t.get());
  return out;
}

}  // namespace twinkle::tenancy
