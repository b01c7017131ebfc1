#include "core/tenancy/tenant_registry.h"

#include <openssl/crypto.h>

#include <deque>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace twinkle::tenancy {

// Everything behind a pointer, so the registry moves while its objects (and the mutex) stay.
struct TenantRegistry::State {
  mutable absl::Mutex mu;
  // Tenants in order of addition; principals ever made (never freed: in-flight work may hold
  // one after its key is revoked). Deques keep element addresses stable.
  std::deque<std::unique_ptr<Tenant>> tenants ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<std::string, const Tenant*> by_id ABSL_GUARDED_BY(mu);
  std::deque<std::unique_ptr<Tenant>> principals ABSL_GUARDED_BY(mu);
  // The active keys: scanned in full on every Authenticate.
  std::vector<std::pair<Sha256Digest, const Tenant*>> keys ABSL_GUARDED_BY(mu);

  const Tenant* AddTenantLocked(absl::string_view id, const Quotas& quotas) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = by_id.find(id);
    if (it != by_id.end()) return it->second;
    tenants.push_back(std::make_unique<Tenant>(Tenant{std::string(id), quotas}));
    by_id[tenants.back()->id] = tenants.back().get();
    return tenants.back().get();
  }
  const Tenant* NewPrincipalLocked(const Tenant& tenant, int64_t key_id, Role role) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    principals.push_back(std::make_unique<Tenant>(Tenant{tenant.id, tenant.quotas, key_id, role}));
    return principals.back().get();
  }
};

bool IsValidTenantId(absl::string_view id) {
  if (id.empty() || id.size() > 64) return false;
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

TenantRegistry::TenantRegistry() : state_(std::make_unique<State>()) {}
TenantRegistry::TenantRegistry(TenantRegistry&&) noexcept = default;
TenantRegistry& TenantRegistry::operator=(TenantRegistry&&) noexcept = default;
TenantRegistry::~TenantRegistry() = default;

TenantRegistry TenantRegistry::Open(const Quotas& quotas) {
  TenantRegistry registry;
  registry.auth_enabled_ = false;
  State& st = *registry.state_;
  absl::MutexLock lock(&st.mu);
  st.tenants.push_back(std::make_unique<Tenant>(Tenant{kDefaultTenantId, quotas, 0, Role::kAdmin}));
  st.by_id[kDefaultTenantId] = st.tenants.back().get();
  return registry;
}

absl::StatusOr<TenantRegistry> TenantRegistry::WithKeys(std::vector<TenantSpec> tenants) {
  if (tenants.empty()) {
    return absl::InvalidArgumentError("authentication is enabled but no tenant is configured");
  }
  TenantRegistry registry;
  registry.auth_enabled_ = true;
  State& st = *registry.state_;
  absl::MutexLock lock(&st.mu);
  absl::flat_hash_set<std::string> seen_digests;
  for (TenantSpec& spec : tenants) {
    if (!IsValidTenantId(spec.id)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tenant id '", spec.id.substr(0, 80), "' is not 1-64 of [a-z0-9_-]"));
    }
    if (st.by_id.contains(spec.id)) {
      return absl::InvalidArgumentError(absl::StrCat("tenant '", spec.id, "' is defined twice"));
    }
    if (spec.key_sha256.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("tenant '", spec.id, "' has no key"));
    }
    const Tenant* tenant = st.AddTenantLocked(spec.id, spec.quotas);
    const Tenant* principal = st.NewPrincipalLocked(*tenant, 0, spec.role);
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
      st.keys.emplace_back(*digest, principal);
    }
  }
  return registry;
}

absl::StatusOr<const Tenant*> TenantRegistry::Authenticate(absl::string_view api_key) const {
  State& st = *state_;
  absl::ReaderMutexLock lock(&st.mu);
  if (!auth_enabled_) return st.tenants.front().get();
  if (api_key.empty()) return absl::UnauthenticatedError("missing API key");
  const Sha256Digest presented = Sha256(api_key);
  // Every digest is compared, and the match is selected with a mask rather than a branch,
  // so the time taken depends only on how many digests there are.
  uintptr_t found = 0;
  for (const auto& [digest, principal] : st.keys) {
    const uintptr_t equal =
        static_cast<uintptr_t>(CRYPTO_memcmp(digest.data(), presented.data(), digest.size()) == 0);
    const uintptr_t mask = uintptr_t{0} - equal;  // all ones on a match, else zero
    found = (found & ~mask) | (reinterpret_cast<uintptr_t>(principal) & mask);
  }
  if (found == 0) return absl::UnauthenticatedError("invalid API key");
  return reinterpret_cast<const Tenant*>(found);
}

absl::StatusOr<const Tenant*> TenantRegistry::ActiveKey(int64_t key_id, absl::string_view tenant) const {
  State& st = *state_;
  absl::ReaderMutexLock lock(&st.mu);
  for (const auto& [digest, principal] : st.keys) {
    if (principal->key_id == key_id && principal->id == tenant) return principal;
  }
  return absl::UnauthenticatedError("the token's API key was revoked");
}

void TenantRegistry::SetKeys(const std::vector<KeyEntry>& keys, const Quotas& default_quotas) {
  if (!auth_enabled_) return;
  State& st = *state_;
  absl::MutexLock lock(&st.mu);
  // Reuse the principal of a key whose (id, role) did not change.
  absl::flat_hash_map<int64_t, const Tenant*> current;
  for (const auto& [digest, principal] : st.keys) {
    if (principal->key_id != 0) current[principal->key_id] = principal;
  }
  std::vector<std::pair<Sha256Digest, const Tenant*>> next;
  next.reserve(keys.size());
  for (const KeyEntry& k : keys) {
    const Tenant* tenant = st.AddTenantLocked(k.tenant, default_quotas);
    auto it = current.find(k.key_id);
    const Tenant* principal = it != current.end() && it->second->role == k.role && it->second->id == k.tenant
                                  ? it->second
                                  : st.NewPrincipalLocked(*tenant, k.key_id, k.role);
    next.emplace_back(k.digest, principal);
  }
  st.keys = std::move(next);
}

const Tenant* TenantRegistry::AddTenant(absl::string_view id, const Quotas& default_quotas) {
  State& st = *state_;
  absl::MutexLock lock(&st.mu);
  return st.AddTenantLocked(id, default_quotas);
}

const Tenant* TenantRegistry::Find(absl::string_view id) const {
  State& st = *state_;
  absl::ReaderMutexLock lock(&st.mu);
  auto it = st.by_id.find(id);
  return it == st.by_id.end() ? nullptr : it->second;
}

std::vector<const Tenant*> TenantRegistry::tenants() const {
  State& st = *state_;
  absl::ReaderMutexLock lock(&st.mu);
  std::vector<const Tenant*> out;
  out.reserve(st.tenants.size());
  for (const auto& t : st.tenants) out.push_back(t.get());
  return out;
}

}  // namespace twinkle::tenancy
