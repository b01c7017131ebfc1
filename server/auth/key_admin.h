#pragma once
// The runtime key set: tenants, API keys (SHA-256 digests only) and roles in the registry,
// changed without a restart. The transports' Authenticator answers from an in-memory copy
// (TenantRegistry::SetKeys), replaced after every change here — never a SQLite read per
// request.
//
//  - Bootstrap (at launch): the config's tenants and key digests are inserted or updated
//    (idempotent: a second launch changes nothing); a config key an admin revoked stays
//    revoked; a config key no longer in the config is revoked.
//  - CreateKey / RotateKey return the new key ONCE (in their reply); only its digest is
//    stored. Keys are "tml-" + 64 hex digits (256 random bits from OpenSSL's RAND_bytes).
//  - RevokeKey: the key fails (401) on its next call; work it started finishes (its
//    principal object outlives the key).
//  - Every change writes an audit row (server/auth/audit.h) naming the acting key id.
//
// Who may call what (checked here, so every transport gets the same rule): CreateTenant,
// CreateKey, ListKeys, RevokeKey, RotateKey and SetRole need role admin; RevokeSelf and
// Describe need any valid key. Refusals: PermissionDenied naming the caller's role. With
// authentication off every change is FailedPrecondition ("authentication is off").

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/registry/registry.h"
#include "core/tenancy/tenant.h"
#include "server/auth/authenticator.h"
#include "server/config/config.h"

namespace twinkle {

// A key as shown to admins: never the key, never its digest.
struct KeyInfo {
  int64_t key_id = 0;
  std::string tenant, role, name, source;
  absl::Time created;
  absl::Time revoked = absl::InfinitePast();  // InfinitePast: active
};

struct NewKey {
  KeyInfo info;
  std::string key;  // the secret: shown once, never stored or logged
};

// Limits on what a caller names.
inline constexpr size_t kMaxKeyNameBytes = 128;

class KeyAdmin {
 public:
  KeyAdmin(registry::Registry& registry, Authenticator& authenticator, int32_t max_keys_per_tenant)
      : registry_(registry), auth_(authenticator), max_keys_per_tenant_(max_keys_per_tenant) {}

  // The config's tenants and keys become the bootstrap set; then the active keys are loaded.
  // No-op with authentication off.
  absl::Status Bootstrap(const Config& config);

  absl::StatusOr<std::string> CreateTenant(const tenancy::Tenant& who, const std::string& tenant,
                                           const std::string& peer);
  absl::StatusOr<NewKey> CreateKey(const tenancy::Tenant& who, const std::string& tenant, const std::string& role,
                                   const std::string& name, const std::string& peer);
  // tenant "" = every tenant.
  absl::StatusOr<std::vector<KeyInfo>> ListKeys(const tenancy::Tenant& who, const std::string& tenant);
  absl::StatusOr<KeyInfo> RevokeKey(const tenancy::Tenant& who, int64_t key_id, const std::string& peer);
  absl::StatusOr<NewKey> RotateKey(const tenancy::Tenant& who, int64_t key_id, const std::string& peer);
  absl::StatusOr<KeyInfo> SetRole(const tenancy::Tenant& who, int64_t key_id, const std::string& role,
                                  const std::string& peer);
  // The caller's own key (DELETE /auth/apikey/me).
  absl::StatusOr<KeyInfo> RevokeSelf(const tenancy::Tenant& who, const std::string& peer);
  // The caller's own key (GET /auth/apikey/me).
  absl::StatusOr<KeyInfo> Describe(const tenancy::Tenant& who);

 private:
  absl::Status RequireAdmin(const tenancy::Tenant& who) const;
  absl::Status RequireAuth() const;
  // Replaces the authenticator's active keys with the registry's.
  absl::Status Reload() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  registry::Registry& registry_;
  Authenticator& auth_;
  const int32_t max_keys_per_tenant_;
  absl::Mutex mu_;  // one change (and its reload) at a time
};

// "tml-" + 64 hex digits.
std::string GenerateApiKey();

// PermissionDenied "<what> needs role <need>; this API key has role <has>".
absl::Status RoleRefusal(const tenancy::Tenant& who, absl::string_view what, absl::string_view need);

}  // namespace twinkle
