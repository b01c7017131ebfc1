#include "server/auth/key_admin.h"

#include <openssl/rand.h>

#include <array>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/tenancy/sha256.h"
#include "core/tenancy/tenant_registry.h"
#include "server/auth/audit.h"

namespace twinkle {
namespace {

KeyInfo InfoOf(const registry::ApiKeyRecord& r) {
  return {r.key_id, r.tenant, r.role, r.name, r.source, r.created, r.revoked};
}

std::string KeyObject(int64_t key_id) { return absl::StrCat("key:", key_id); }

absl::Status CheckName(const std::string& name) {
  if (name.size() > kMaxKeyNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("name: ", name.size(), " bytes, more than the limit of ", kMaxKeyNameBytes));
  }
  for (unsigned char c : name) {
    if (c < 0x20 || c == 0x7f) return absl::InvalidArgumentError("name: control characters are not allowed");
  }
  return absl::OkStatus();
}

}  // namespace

std::string GenerateApiKey() {
  std::array<unsigned char, 32> bytes{};
  // RAND_bytes fails only when the CSPRNG cannot be seeded; a key must never be weak.
  if (RAND_bytes(bytes.data(), static_cast<int>(bytes.size())) != 1) return std::string();
  return absl::StrCat("tml-", absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(bytes.data()),
                                                                       bytes.size())));
}

absl::Status RoleRefusal(const tenancy::Tenant& who, absl::string_view what, absl::string_view need) {
  return absl::PermissionDeniedError(absl::StrCat(what, " needs role ", need, "; this API key has role ",
                                                  tenancy::RoleName(who.role)));
}

absl::Status KeyAdmin::RequireAuth() const {
  if (!auth_.enabled()) {
    return absl::FailedPreconditionError("authentication is off (auth.enabled: false): there are no API keys to manage");
  }
  return absl::OkStatus();
}

absl::Status KeyAdmin::RequireAdmin(const tenancy::Tenant& who) const {
  if (absl::Status s = RequireAuth(); !s.ok()) return s;
  if (who.role != tenancy::Role::kAdmin) return RoleRefusal(who, "managing keys and tenants", "admin");
  return absl::OkStatus();
}

absl::Status KeyAdmin::Reload() {
  absl::StatusOr<std::vector<registry::ApiKeyRecord>> keys = registry_.ListKeys("");
  if (!keys.ok()) return keys.status();
  std::vector<tenancy::KeyEntry> active;
  for (const registry::ApiKeyRecord& k : *keys) {
    if (!k.active()) continue;
    std::optional<tenancy::Sha256Digest> digest = tenancy::ParseSha256Hex(k.key_sha256);
    tenancy::Role role = tenancy::Role::kMember;
    if (!digest || !tenancy::ParseRole(k.role, &role)) continue;  // the schema's checks make this unreachable
    active.push_back({*digest, k.tenant, k.key_id, role});
  }
  absl::StatusOr<std::vector<registry::TenantRecord>> tenants = registry_.ListTenants();
  if (!tenants.ok()) return tenants.status();
  for (const registry::TenantRecord& t : *tenants) auth_.mutable_registry().AddTenant(t.id, auth_.default_quotas());
  auth_.mutable_registry().SetKeys(active, auth_.default_quotas());
  return absl::OkStatus();
}

absl::Status KeyAdmin::Bootstrap(const Config& config) {
  if (!config.auth.enabled) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  std::vector<registry::ApiKeyRecord> keys;
  for (const TenantConfig& t : config.auth.tenants) {
    int n = 0;
    for (const std::string& digest : t.key_sha256) {
      registry::ApiKeyRecord k;
      k.tenant = t.id;
      k.key_sha256 = digest;
      k.role = t.role;
      k.name = absl::StrCat(t.id, " config key ", ++n);
      keys.push_back(std::move(k));
    }
  }
  if (absl::Status s = registry_.BootstrapConfigKeys(keys, absl::Now()); !s.ok()) return s;
  return Reload();
}

absl::StatusOr<std::string> KeyAdmin::CreateTenant(const tenancy::Tenant& who, const std::string& tenant,
                                                   const std::string& peer) {
  if (absl::Status s = RequireAdmin(who); !s.ok()) return s;
  if (!tenancy::IsValidTenantId(tenant)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tenant: '", tenant.substr(0, 80), "' is not a tenant id (1 to 64 of a-z, 0-9, _ and -)"));
  }
  absl::MutexLock lock(&mu_);
  if (absl::Status s = registry_.PutTenant(tenant, "admin", absl::Now()); !s.ok()) return s;
  if (absl::Status s = Reload(); !s.ok()) return s;
  if (absl::Status s = Audit(registry_, who, "tenant_create", absl::StrCat("tenant:", tenant), peer); !s.ok()) {
    return s;
  }
  return tenant;
}

absl::StatusOr<NewKey> KeyAdmin::CreateKey(const tenancy::Tenant& who, const std::string& tenant,
                                           const std::string& role, const std::string& name,
                                           const std::string& peer) {
  if (absl::Status s = RequireAdmin(who); !s.ok()) return s;
  tenancy::Role parsed;
  if (!tenancy::ParseRole(role, &parsed)) {
    return absl::InvalidArgumentError(absl::StrCat("role: '", role.substr(0, 64), "' is not one of admin, member, read-only"));
  }
  if (absl::Status s = CheckName(name); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  absl::StatusOr<std::vector<registry::ApiKeyRecord>> existing = registry_.ListKeys(tenant);
  if (!existing.ok()) return existing.status();
  int32_t active = 0;
  for (const auto& k : *existing) active += k.active() ? 1 : 0;
  if (active >= max_keys_per_tenant_) {
    return absl::ResourceExhaustedError(absl::StrCat("tenant '", tenant, "' has ", active,
                                                     " active API keys, the limit (auth.max_keys_per_tenant)"));
  }
  NewKey out;
  out.key = GenerateApiKey();
  if (out.key.empty()) return absl::InternalError("could not generate a key: the random generator failed");
  registry::ApiKeyRecord record;
  record.tenant = tenant;
  record.key_sha256 = tenancy::Sha256Hex(out.key);
  record.role = role;
  record.name = name;
  record.source = "admin";
  record.created = absl::Now();
  absl::StatusOr<registry::ApiKeyRecord> inserted = registry_.InsertKey(record);
  if (!inserted.ok()) return inserted.status();
  out.info = InfoOf(*inserted);
  if (absl::Status s = Reload(); !s.ok()) return s;
  if (absl::Status s = Audit(registry_, who, "key_create", KeyObject(out.info.key_id), peer,
                             {{"tenant", tenant}, {"role", role}, {"name", name}});
      !s.ok()) {
    return s;
  }
  return out;
}

absl::StatusOr<std::vector<KeyInfo>> KeyAdmin::ListKeys(const tenancy::Tenant& who, const std::string& tenant) {
  if (absl::Status s = RequireAdmin(who); !s.ok()) return s;
  absl::StatusOr<std::vector<registry::ApiKeyRecord>> keys = registry_.ListKeys(tenant);
  if (!keys.ok()) return keys.status();
  std::vector<KeyInfo> out;
  for (const auto& k : *keys) out.push_back(InfoOf(k));
  return out;
}

absl::StatusOr<KeyInfo> KeyAdmin::RevokeKey(const tenancy::Tenant& who, int64_t key_id, const std::string& peer) {
  if (absl::Status s = RequireAdmin(who); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  absl::StatusOr<registry::ApiKeyRecord> r = registry_.RevokeKey(key_id, absl::Now());
  if (!r.ok()) return r.status();
  if (absl::Status s = Reload(); !s.ok()) return s;
  if (absl::Status s = Audit(registry_, who, "key_revoke", KeyObject(key_id), peer, {{"tenant", r->tenant}});
      !s.ok()) {
    return s;
  }
  return InfoOf(*r);
}

absl::StatusOr<NewKey> KeyAdmin::RotateKey(const tenancy::Tenant& who, int64_t key_id, const std::string& peer) {
  if (absl::Status s = RequireAdmin(who); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  NewKey out;
  out.key = GenerateApiKey();
  if (out.key.empty()) return absl::InternalError("could not generate a key: the random generator failed");
  absl::StatusOr<registry::ApiKeyRecord> r = registry_.RotateKey(key_id, tenancy::Sha256Hex(out.key), absl::Now());
  if (!r.ok()) return r.status();
  out.info = InfoOf(*r);
  if (absl::Status s = Reload(); !s.ok()) return s;
  if (absl::Status s = Audit(registry_, who, "key_rotate", KeyObject(key_id), peer,
                             {{"tenant", r->tenant}, {"new_key_id", r->key_id}});
      !s.ok()) {
    return s;
  }
  return out;
}

absl::StatusOr<KeyInfo> KeyAdmin::SetRole(const tenancy::Tenant& who, int64_t key_id, const std::string& role,
                                          const std::string& peer) {
  if (absl::Status s = RequireAdmin(who); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  absl::StatusOr<registry::ApiKeyRecord> r = registry_.SetKeyRole(key_id, role);
  if (!r.ok()) return r.status();
  if (absl::Status s = Reload(); !s.ok()) return s;
  if (absl::Status s = Audit(registry_, who, "key_role_set", KeyObject(key_id), peer,
                             {{"tenant", r->tenant}, {"role", role}});
      !s.ok()) {
    return s;
  }
  return InfoOf(*r);
}

absl::StatusOr<KeyInfo> KeyAdmin::RevokeSelf(const tenancy::Tenant& who, const std::string& peer) {
  if (absl::Status s = RequireAuth(); !s.ok()) return s;
  if (who.key_id <= 0) return absl::FailedPreconditionError("this API key is not in the registry yet");
  absl::MutexLock lock(&mu_);
  absl::StatusOr<registry::ApiKeyRecord> r = registry_.RevokeKey(who.key_id, absl::Now());
  if (!r.ok()) return r.status();
  if (absl::Status s = Reload(); !s.ok()) return s;
  if (absl::Status s = Audit(registry_, who, "key_revoke", KeyObject(who.key_id), peer, {{"self", true}}); !s.ok()) {
    return s;
  }
  return InfoOf(*r);
}

absl::StatusOr<KeyInfo> KeyAdmin::Describe(const tenancy::Tenant& who) {
  if (!auth_.enabled()) {
    KeyInfo info;
    info.tenant = who.id;
    info.role = tenancy::RoleName(who.role);
    info.name = "authentication off";
    info.source = "none";
    return info;
  }
  absl::StatusOr<registry::ApiKeyRecord> r = registry_.GetKey(who.key_id);
  if (!r.ok()) return r.status();
  return InfoOf(*r);
}

}  // namespace twinkle
