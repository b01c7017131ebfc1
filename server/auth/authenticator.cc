#include "server/auth/authenticator.h"

#include <grpcpp/server_context.h>

#include <optional>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/strip.h"

namespace twinkle {
namespace {

constexpr const char* kBearerHeaders[] = {"authorization", "twinkle-authorization"};

}  // namespace

tenancy::Quotas QuotasFromLimits(const LimitsSection& limits) {
  tenancy::Quotas q;
  q.max_adapters = limits.max_adapters;
  q.max_lora_rank = limits.max_lora_rank;
  q.max_tokens_per_request = limits.max_tokens_per_request;
  q.max_pending_ops = limits.max_pending_ops;
  q.max_sessions = limits.max_sessions;
  q.max_buffered_tokens = limits.max_buffered_tokens;
  q.tokens_per_s = limits.tokens_per_s;
  q.burst_tokens = limits.burst_tokens;
  return q;
}

absl::StatusOr<tenancy::TenantRegistry> TenantRegistryFromConfig(const Config& config) {
  if (!config.auth.enabled) return tenancy::TenantRegistry::Open(QuotasFromLimits(config.limits));
  std::vector<tenancy::TenantSpec> specs;
  specs.reserve(config.auth.tenants.size());
  for (const TenantConfig& t : config.auth.tenants) {
    tenancy::Role role = tenancy::Role::kMember;
    tenancy::ParseRole(t.role, &role);  // validated by the config parser
    specs.push_back({t.id, t.key_sha256, QuotasFromLimits(t.quotas), role});
  }
  return tenancy::TenantRegistry::WithKeys(std::move(specs));
}

absl::StatusOr<std::string> ExtractApiKey(
    const std::function<const std::string*(absl::string_view name)>& lookup) {
  if (const std::string* key = lookup("x-api-key"); key != nullptr) {
    const absl::string_view stripped = absl::StripAsciiWhitespace(*key);
    if (!stripped.empty()) return std::string(stripped);
  }
  for (const char* name : kBearerHeaders) {
    const std::string* value = lookup(name);
    if (value == nullptr) continue;
    absl::string_view v = absl::StripAsciiWhitespace(*value);
    if (v.empty()) continue;
    constexpr absl::string_view kBearer = "bearer ";
    if (v.size() <= kBearer.size() || !absl::StartsWithIgnoreCase(v, kBearer)) {
      return absl::UnauthenticatedError(
          absl::StrCat("malformed ", name, " value: expected 'Bearer <key>'"));
    }
    v.remove_prefix(kBearer.size());
    v = absl::StripAsciiWhitespace(v);
    if (!v.empty()) return std::string(v);
  }
  return std::string();
}

Authenticator::Authenticator(tenancy::TenantRegistry registry) : registry_(std::move(registry)) {}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::FromConfig(const Config& config) {
  absl::StatusOr<tenancy::TenantRegistry> registry = TenantRegistryFromConfig(config);
  if (!registry.ok()) return registry.status();
  auto authenticator = std::make_unique<Authenticator>(std::move(*registry));
  authenticator->default_quotas_ = QuotasFromLimits(config.limits);
  return authenticator;
}

absl::StatusOr<const tenancy::Tenant*> Authenticator::Finish(
    absl::StatusOr<const tenancy::Tenant*> result) const {
  if (!result.ok()) {
    failures_.fetch_add(1, std::memory_order_relaxed);
    if (on_failure_) on_failure_(result.status());
  }
  return result;
}

absl::StatusOr<const tenancy::Tenant*> Authenticator::Resolve(absl::string_view credential) const {
  if (jwt_ == nullptr || !LooksLikeJwt(credential)) return registry_.Authenticate(credential);
  absl::StatusOr<JwtClaims> claims = jwt_->Verify(credential);
  if (!claims.ok()) {
    // An API key that merely looks like a token (configured keys are free-form) still works.
    absl::StatusOr<const tenancy::Tenant*> as_key = registry_.Authenticate(credential);
    return as_key.ok() ? as_key : claims.status();
  }
  absl::StatusOr<const tenancy::Tenant*> principal = registry_.ActiveKey(claims->key_id, claims->tenant);
  if (!principal.ok()) return InvalidTokenError(principal.status().message());
  return principal;
}

absl::StatusOr<const tenancy::Tenant*> Authenticator::AuthenticateKey(
    absl::string_view api_key) const {
  if (!enabled()) return registry_.Authenticate("");
  return Finish(Resolve(api_key));
}

absl::StatusOr<const tenancy::Tenant*> Authenticator::AuthenticateGrpc(
    const grpc::ServerContextBase& context) const {
  if (!enabled()) return registry_.Authenticate("");
  const auto& metadata = context.client_metadata();
  std::string holder;
  absl::StatusOr<std::string> key = ExtractApiKey([&](absl::string_view name) -> const std::string* {
    auto it = metadata.find(grpc::string_ref(name.data(), name.size()));
    if (it == metadata.end()) return nullptr;
    holder.assign(it->second.data(), it->second.size());
    return &holder;
  });
  if (!key.ok()) return Finish(key.status());
  return Finish(Resolve(*key));
}

absl::StatusOr<std::string> Authenticator::HttpCredential(const std::map<std::string, std::string>& headers) const {
  return ExtractApiKey([&](absl::string_view name) -> const std::string* {
    auto it = headers.find(std::string(name));
    return it == headers.end() ? nullptr : &it->second;
  });
}

absl::StatusOr<const tenancy::Tenant*> Authenticator::AuthenticateHttp(
    const std::map<std::string, std::string>& headers) const {
  if (!enabled()) return registry_.Authenticate("");
  absl::StatusOr<std::string> key = HttpCredential(headers);
  if (!key.ok()) return Finish(key.status());
  return Finish(Resolve(*key));
}

absl::StatusOr<const tenancy::Tenant*> Authenticator::Identify(
    const std::map<std::string, std::string>& headers) const {
  if (!enabled()) return registry_.Authenticate("");
  absl::StatusOr<std::string> key = HttpCredential(headers);
  if (!key.ok()) return key.status();
  return Resolve(*key);
}

absl::StatusOr<std::string> Authenticator::IssueToken(const std::map<std::string, std::string>& headers) const {
  if (!jwt_enabled()) {
    return absl::NotFoundError("the token exchange is off (authentication off, or auth.jwt_ttl_s is 0)");
  }
  absl::StatusOr<const tenancy::Tenant*> principal = [&]() -> absl::StatusOr<const tenancy::Tenant*> {
    absl::StatusOr<std::string> key = HttpCredential(headers);
    if (!key.ok()) return key.status();
    absl::StatusOr<const tenancy::Tenant*> by_key = registry_.Authenticate(*key);
    if (!by_key.ok() && LooksLikeJwt(*key) && jwt_->Verify(*key).ok()) {
      return absl::UnauthenticatedError("a token cannot be exchanged for another: present the API key");
    }
    return by_key;
  }();
  if (!Finish(principal).ok()) return principal.status();
  return jwt_->Issue(**principal);
}

}  // namespace twinkle
