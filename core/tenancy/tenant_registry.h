#pragma once
// Who is calling: API key → tenant.
//
// Keys are never stored: the config holds the SHA-256 digest of each key, and
// Authenticate hashes the presented key and compares it with EVERY stored digest in
// constant time (CRYPTO_memcmp, no early exit), so neither the comparison nor the loop
// tells an attacker how close a guess came or which tenant's key it resembled. Keys never
// appear in a status message.
//
// With authentication off the registry holds one tenant, "default", and every request
// (with any key or none) belongs to it.

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "core/tenancy/sha256.h"
#include "core/tenancy/tenant.h"

namespace twinkle::tenancy {

// One tenant as the config describes it.
struct TenantSpec {
  std::string id;                       // [a-z0-9_-]{1,64}, unique
  std::vector<std::string> key_sha256;  // 64 hex digits each, unique across all tenants
  Quotas quotas;
  Role role = Role::kMember;            // of every key of the tenant
};

// One active API key, as the runtime key set (server/auth/key_admin.h) loads it.
struct KeyEntry {
  Sha256Digest digest;
  std::string tenant;
  int64_t key_id = 0;
  Role role = Role::kMember;
};

class TenantRegistry {
 public:
  // Authentication off: the single tenant "default" with `quotas` (role admin).
  static TenantRegistry Open(const Quotas& quotas);

  // Authentication on. InvalidArgument when there is no tenant, an id is malformed or
  // repeated, a tenant has no key, or a digest is malformed or repeated (the message names
  // the tenant, never a digest). Keys get `role` of their spec and key_id 0 until SetKeys.
  static absl::StatusOr<TenantRegistry> WithKeys(std::vector<TenantSpec> tenants);

  TenantRegistry(TenantRegistry&&) noexcept;
  TenantRegistry& operator=(TenantRegistry&&) noexcept;
  ~TenantRegistry();

  bool auth_enabled() const { return auth_enabled_; }

  // The principal `api_key` belongs to (its tenant, key id and role). Auth on:
  // Unauthenticated("missing API key") for an empty key, Unauthenticated("invalid API key")
  // for an unknown or revoked one. Auth off: always the default tenant. Thread-safe: a
  // shared lock and a constant-time scan of the active digests.
  absl::StatusOr<const Tenant*> Authenticate(absl::string_view api_key) const;

  // The principal of the active key `key_id` of `tenant` (a JWT's subject, server/auth/jwt.h):
  // Unauthenticated("the token's API key was revoked") when that key is no longer active.
  absl::StatusOr<const Tenant*> ActiveKey(int64_t key_id, absl::string_view tenant) const;

  // Replaces the active key set (auth on; a no-op with auth off). Tenants not known yet are
  // added with `default_quotas`. A key whose id and role are unchanged keeps its principal;
  // principals of removed keys stay allocated (in-flight work may hold them) but no longer
  // authenticate. Thread-safe.
  void SetKeys(const std::vector<KeyEntry>& keys, const Quotas& default_quotas);
  // Adds the tenant (default quotas) when absent; returns it. Thread-safe.
  const Tenant* AddTenant(absl::string_view id, const Quotas& default_quotas);

  // The tenant with this id, or nullptr. Pointers stay valid for the registry's lifetime
  // (also across moves of the registry).
  const Tenant* Find(absl::string_view id) const;

  // Every tenant, in config order, then those added at runtime.
  std::vector<const Tenant*> tenants() const;

 private:
  struct State;
  TenantRegistry();

  bool auth_enabled_ = false;
  std::unique_ptr<State> state_;
};

// True for a valid tenant id: 1 to 64 of [a-z0-9_-].
bool IsValidTenantId(absl::string_view id);

}  // namespace twinkle::tenancy
