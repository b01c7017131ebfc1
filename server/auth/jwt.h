#pragma once
// Short-lived JWTs for the Tinker SDK's auth exchange (client config pjwt_auth_enabled):
// POST /api/v1/auth/token trades an API key for a token, which the SDK then sends instead
// of the key (in X-API-Key) and refreshes at half its lifetime. RestClient.whoami and
// `tinker auth whoami` read the caller's identity from the token's claims.
//
// Tokens are HS256 (libjwt; docs/security.md says why) under a server secret
// (auth.jwt_signing_secret, or 32 random bytes kept in <data_dir>/jwt_signing.key, so tokens
// survive a restart). Claims: iss "twinkle-server", sub "twinkle:key:<key id>", org_id (the
// tenant), key_id, email "" (no principal is user-backed), iat, exp. A token names a key,
// never holds one: each call re-checks that the key is still active (a revoked key's tokens
// fail on their next call) and takes the key's current role.
//
// Hostile tokens are bounded before any decoding (kMaxJwtBytes); a token that fails any check
// is Unauthenticated marked invalid_token (IsInvalidToken), which HTTP answers with
// `WWW-Authenticate: Bearer error="invalid_token"` so the SDK fetches a fresh one.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/common/clock.h"
#include "core/tenancy/tenant.h"

namespace twinkle {

inline constexpr size_t kMaxJwtBytes = 4096;
inline constexpr char kJwtIssuer[] = "twinkle-server";

struct JwtClaims {
  std::string tenant;  // org_id
  int64_t key_id = 0;
  absl::Time issued_at;
  absl::Time expires_at;
};

// True when `credential` has a JWT's shape (base64url JSON header, three dot-separated parts).
bool LooksLikeJwt(absl::string_view credential);

// Unauthenticated(why) marked as a rejected bearer token (RFC 6750 invalid_token).
absl::Status InvalidTokenError(absl::string_view why);
bool IsInvalidToken(const absl::Status& status);

class JwtIssuer {
 public:
  // `secret`: at least 32 bytes. `clock`: issue and expiry times (outlives this object).
  JwtIssuer(std::string secret, absl::Duration ttl, const Clock& clock);

  // A token for `principal` (an active key: key_id > 0), valid for ttl from now.
  absl::StatusOr<std::string> Issue(const tenancy::Tenant& principal) const;

  // The claims of a token this server signed that has not expired; otherwise an
  // InvalidTokenError saying which check failed (never echoing the token).
  absl::StatusOr<JwtClaims> Verify(absl::string_view token) const;

  absl::Duration ttl() const { return ttl_; }

 private:
  const std::string secret_;
  const absl::Duration ttl_;
  const Clock& clock_;
};

}  // namespace twinkle
