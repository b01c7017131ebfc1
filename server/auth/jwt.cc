#include "server/auth/jwt.h"

#include <jwt.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string_view>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace twinkle {
namespace {

constexpr char kInvalidTokenPayload[] = "twinkle/invalid_token";

struct JwtFree {
  void operator()(jwt_t* jwt) const { jwt_free(jwt); }
};
using JwtPtr = std::unique_ptr<jwt_t, JwtFree>;
struct CharFree {
  void operator()(char* p) const { free(p); }
};

const unsigned char* KeyBytes(const std::string& secret) {
  return reinterpret_cast<const unsigned char*>(secret.data());
}

// A numeric claim, or nullopt when it is absent or not a number.
std::optional<int64_t> IntClaim(jwt_t* jwt, const char* name) {
  errno = 0;
  const long value = jwt_get_grant_int(jwt, name);
  if (errno != 0) return std::nullopt;
  return static_cast<int64_t>(value);
}

}  // namespace

bool LooksLikeJwt(absl::string_view credential) {
  return absl::StartsWith(credential, "eyJ") && std::count(credential.begin(), credential.end(), '.') == 2;
}

absl::Status InvalidTokenError(absl::string_view why) {
  absl::Status status = absl::UnauthenticatedError(why);
  status.SetPayload(kInvalidTokenPayload, absl::Cord("1"));
  return status;
}

bool IsInvalidToken(const absl::Status& status) {
  return absl::IsUnauthenticated(status) && status.GetPayload(kInvalidTokenPayload).has_value();
}

JwtIssuer::JwtIssuer(std::string secret, absl::Duration ttl, const Clock& clock)
    : secret_(std::move(secret)), ttl_(ttl), clock_(clock) {}

absl::StatusOr<std::string> JwtIssuer::Issue(const tenancy::Tenant& principal) const {
  if (principal.key_id <= 0) return absl::FailedPreconditionError("only a registered API key can get a token");
  jwt_t* raw = nullptr;
  if (jwt_new(&raw) != 0) return absl::InternalError("jwt_new failed");
  JwtPtr jwt(raw);
  const int64_t now = absl::ToUnixSeconds(clock_.Now());
  const int64_t exp = now + absl::ToInt64Seconds(ttl_);
  const std::string sub = absl::StrCat("twinkle:key:", principal.key_id);
  bool ok = jwt_add_grant(jwt.get(), "iss", kJwtIssuer) == 0 && jwt_add_grant(jwt.get(), "sub", sub.c_str()) == 0 &&
            jwt_add_grant(jwt.get(), "org_id", principal.id.c_str()) == 0 &&
            jwt_add_grant(jwt.get(), "email", "") == 0 &&
            jwt_add_grant_int(jwt.get(), "key_id", static_cast<long>(principal.key_id)) == 0 &&
            jwt_add_grant_int(jwt.get(), "iat", static_cast<long>(now)) == 0 &&
            jwt_add_grant_int(jwt.get(), "exp", static_cast<long>(exp)) == 0 &&
            jwt_set_alg(jwt.get(), JWT_ALG_HS256, KeyBytes(secret_), static_cast<int>(secret_.size())) == 0;
  if (!ok) return absl::InternalError("building the token failed");
  std::unique_ptr<char, CharFree> encoded(jwt_encode_str(jwt.get()));
  if (encoded == nullptr) return absl::InternalError("signing the token failed");
  return std::string(encoded.get());
}

absl::StatusOr<JwtClaims> JwtIssuer::Verify(absl::string_view token) const {
  if (token.size() > kMaxJwtBytes) {
    return InvalidTokenError(absl::StrCat("token longer than ", kMaxJwtBytes, " bytes"));
  }
  jwt_t* raw = nullptr;
  // jwt_decode checks the signature with the key, and refuses alg "none" when given one.
  const std::string text(token);
  if (jwt_decode(&raw, text.c_str(), KeyBytes(secret_), static_cast<int>(secret_.size())) != 0 || raw == nullptr) {
    if (raw != nullptr) jwt_free(raw);
    return InvalidTokenError("invalid token: bad signature or format");
  }
  JwtPtr jwt(raw);
  if (jwt_get_alg(jwt.get()) != JWT_ALG_HS256) return InvalidTokenError("invalid token: not HS256");
  const char* issuer = jwt_get_grant(jwt.get(), "iss");
  const char* tenant = jwt_get_grant(jwt.get(), "org_id");
  const std::optional<int64_t> key_id = IntClaim(jwt.get(), "key_id");
  const std::optional<int64_t> iat = IntClaim(jwt.get(), "iat");
  const std::optional<int64_t> exp = IntClaim(jwt.get(), "exp");
  if (issuer == nullptr || std::string_view(issuer) != kJwtIssuer || tenant == nullptr || !key_id || *key_id <= 0 ||
      !iat || !exp) {
    return InvalidTokenError("invalid token: missing or wrong claims");
  }
  if (absl::ToUnixSeconds(clock_.Now()) >= *exp) return InvalidTokenError("token expired");
  return JwtClaims{tenant, *key_id, absl::FromUnixSeconds(*iat), absl::FromUnixSeconds(*exp)};
}

}  // namespace twinkle
