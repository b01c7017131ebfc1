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

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/tenancy/sha256.h"
#include "core/tenancy/tenant.h"

namespace twinkle::tenancy {

// One tenant as the config describes it.
struct TenantSpec {
  std::string id;                       // [a-z0-9_-]{1,64}, unique
  std::vector<std::string> key_sha256;  // 64 hex digits each, unique across all tenants
  Quotas quotas;
};

class TenantRegistry {
 public:
  // Authentication off: the single tenant "default" with `quotas`.
  static TenantRegistry Open(const Quotas& quotas);

  // Authentication on. InvalidArgument when there is no tenant, an id is malformed or
  // repeated, a tenant has no key, or a digest is malformed or repeated (the message names
  // the tenant, never a digest).
  static absl::StatusOr<TenantRegistry> WithKeys(std::vector<TenantSpec> tenants);

  TenantRegistry(TenantRegistry&&) = default;
  TenantRegistry& operator=(TenantRegistry&&) = default;

  bool auth_enabled() const { return auth_enabled_; }

  // The tenant `api_key` belongs to. Auth on: Unauthenticated("missing API key") for an
  // empty key, Unauthenticated("invalid API key") for an unknown one. Auth off: always the
  // default tenant. Thread-safe (the registry is immutable once built).
  absl::StatusOr<const Tenant*> Authenticate(absl::string_view api_key) const;

  // The tenant with this id, or nullptr. Pointers stay valid for the registry's lifetime
  // (also across moves of the registry).
  const Tenant* Find(absl::string_view id) const;

  // Every tenant, in config order.
  std::vector<const Tenant*> tenants() const;

 private:
  TenantRegistry() = default;

  bool auth_enabled_ = false;
  std::vector<std::unique_ptr<Tenant>> tenants_;
  absl::flat_hash_map<std::string, const Tenant*> by_id_;
  // (digest, index into tenants_ + 1); scanned in full on every Authenticate.
  std::vector<std::pair<Sha256Digest, size_t>> keys_;
};

// True for a valid tenant id: 1 to 64 of [a-z0-9_-].
bool IsValidTenantId(absl::string_view id);

}  // namespace twinkle::tenancy
