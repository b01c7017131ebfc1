#pragma once
// Transport-side authentication: finds the API key in gRPC metadata or HTTP headers and
// maps it to a tenant through core/tenancy's TenantRegistry.
//
// Where the key is looked for, first match wins (tinker-protocol.md §1.4):
//   1. `x-api-key: KEY`                    (the tinker SDK)
//   2. `authorization: Bearer KEY`         (twinkle_client, grpcurl -H, curl)
//   3. `twinkle-authorization: Bearer KEY` (Twinkle-patched SDKs)
// The same names serve gRPC metadata and HTTP headers (HTTP names are case-insensitive;
// gRPC metadata keys are lower-case by protocol). The `Bearer` scheme is case-insensitive.
//
// With a JwtIssuer set (auth.jwt_ttl_s > 0), a credential shaped like a JWT is verified as
// one of this server's tokens (server/auth/jwt.h) and maps to its key's current principal;
// a token that fails is an InvalidTokenError. Anything else is looked up as an API key.
//
// Failures are counted (failures()) and reported to an optional listener for metrics and
// logs. Keys are never logged and never appear in a status.

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/tenancy/tenant_registry.h"
#include "server/auth/jwt.h"
#include "server/config/config.h"

namespace grpc {
class ServerContextBase;
}  // namespace grpc

namespace twinkle {

// The quotas `limits` describes.
tenancy::Quotas QuotasFromLimits(const LimitsSection& limits);

// The registry a validated config describes: auth.enabled → its tenants (auth.tenants, which
// includes those of auth.tenants_file); otherwise the single "default" tenant with `limits`.
absl::StatusOr<tenancy::TenantRegistry> TenantRegistryFromConfig(const Config& config);

class Authenticator {
 public:
  explicit Authenticator(tenancy::TenantRegistry registry);
  static absl::StatusOr<std::unique_ptr<Authenticator>> FromConfig(const Config& config);

  Authenticator(const Authenticator&) = delete;
  Authenticator& operator=(const Authenticator&) = delete;

  // The caller's tenant from the call's client metadata. Unauthenticated("missing API key" |
  // "invalid API key" | "malformed authorization metadata: expected 'Bearer <key>'").
  absl::StatusOr<const tenancy::Tenant*> AuthenticateGrpc(
      const grpc::ServerContextBase& context) const;

  // The same from HTTP request headers; `headers` maps LOWER-CASE names to values
  // (HttpRequest::headers has that shape).
  absl::StatusOr<const tenancy::Tenant*> AuthenticateHttp(
      const std::map<std::string, std::string>& headers) const;

  // The principal of HTTP `headers`' credential without counting a failure (the access log).
  absl::StatusOr<const tenancy::Tenant*> Identify(const std::map<std::string, std::string>& headers) const;

  // The same from a bare key (empty = none presented).
  absl::StatusOr<const tenancy::Tenant*> AuthenticateKey(absl::string_view api_key) const;

  // POST /api/v1/auth/token: a token for the API key in `headers` (a token is not accepted
  // in exchange for another, so a leaked token cannot outlive its own expiry). NotFound when
  // no JwtIssuer is set or authentication is off.
  absl::StatusOr<std::string> IssueToken(const std::map<std::string, std::string>& headers) const;

  // Enables the token exchange and token credentials. Set before serving; outlives this.
  void SetJwtIssuer(const JwtIssuer* issuer) { jwt_ = issuer; }
  // Whether the Tinker SDK should exchange its key for a token (client config pjwt_auth_enabled).
  bool jwt_enabled() const { return enabled() && jwt_ != nullptr; }

  bool enabled() const { return registry_.auth_enabled(); }
  const tenancy::TenantRegistry& registry() const { return registry_; }
  // For the runtime key set (KeyAdmin), which replaces the active keys after each change.
  tenancy::TenantRegistry& mutable_registry() { return registry_; }
  // The quotas of tenants created at runtime: the config's `limits`.
  const tenancy::Quotas& default_quotas() const { return default_quotas_; }

  // Failed authentications so far (missing, malformed or unknown keys).
  int64_t failures() const { return failures_.load(std::memory_order_relaxed); }

  // Called with each failure's status (never containing the key). Set before serving.
  void SetFailureListener(std::function<void(const absl::Status&)> listener) {
    on_failure_ = std::move(listener);
  }

 private:
  absl::StatusOr<const tenancy::Tenant*> Finish(absl::StatusOr<const tenancy::Tenant*> result) const;
  // The principal of a presented credential: a token (when it verifies as one) or a key.
  absl::StatusOr<const tenancy::Tenant*> Resolve(absl::string_view credential) const;
  absl::StatusOr<std::string> HttpCredential(const std::map<std::string, std::string>& headers) const;

  tenancy::TenantRegistry registry_;
  tenancy::Quotas default_quotas_;
  mutable std::atomic<int64_t> failures_{0};
  std::function<void(const absl::Status&)> on_failure_;
  const JwtIssuer* jwt_ = nullptr;
};

// Key extraction, shared by both transports and exposed for tests. `lookup(name)` returns the
// value of a lower-case header/metadata name, or nullptr when absent. Returns the key ("" when
// none was presented), or Unauthenticated for a present but malformed authorization value.
absl::StatusOr<std::string> ExtractApiKey(
    const std::function<const std::string*(absl::string_view name)>& lookup);

}  // namespace twinkle
