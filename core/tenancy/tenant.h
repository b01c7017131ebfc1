#pragma once
// A tenant: who an API key belongs to, and what that tenant may use.

#include <cstdint>
#include <string>

namespace twinkle::tenancy {

// Per-tenant quotas. The server-wide `limits` section of the config gives every tenant's
// defaults; a tenant's own `quotas` may lower them, never raise them.
struct Quotas {
  int32_t max_adapters = 64;               // adapters the tenant may hold at once
  int32_t max_lora_rank = 64;              // largest LoRA rank it may request
  int64_t max_tokens_per_request = 32768;  // largest single request, in tokens
  int32_t max_sessions = 256;              // sessions (Twinkle and Tinker) open at once
  int32_t max_pending_ops = 256;           // ops queued for it over all its adapters (and
                                           // Tinker ops buffered ahead of a seq_id gap)
  int64_t max_buffered_tokens = 262144;    // tokens of its Tinker ops buffered ahead of gaps
  double tokens_per_s = 0;                 // sustained token rate; 0 = unlimited
  int64_t burst_tokens = 65536;            // token bucket size (tokens usable at once)
};

// What an API key may do (docs/security.md): admin manages keys, tenants and reads usage
// and audit for every tenant; member trains, samples and manages its tenant's objects;
// read-only may list, get, sample and download, never train, save or delete.
enum class Role { kAdmin, kMember, kReadOnly };

inline const char* RoleName(Role role) {
  switch (role) {
    case Role::kAdmin: return "admin";
    case Role::kReadOnly: return "read-only";
    default: return "member";
  }
}

// The role named `name` ("admin", "member", "read-only"), or false.
inline bool ParseRole(const std::string& name, Role* role) {
  if (name == "admin") *role = Role::kAdmin;
  else if (name == "member") *role = Role::kMember;
  else if (name == "read-only") *role = Role::kReadOnly;
  else return false;
  return true;
}

// Who is calling. TenantRegistry::Authenticate returns one of these per API key (the key's
// tenant id and quotas, plus key_id and role); Find and tenants() return the tenant itself
// (key_id 0, role member). Objects live as long as their registry, so a pointer held by
// in-flight work stays valid after its key is revoked.
struct Tenant {
  std::string id;  // [a-z0-9_-]{1,64}; "default" when authentication is off
  Quotas quotas;
  int64_t key_id = 0;          // the registry's key id (0: not a key, or auth off)
  Role role = Role::kMember;   // auth off: admin
};

// The one tenant every request belongs to when authentication is off.
inline constexpr char kDefaultTenantId[] = "default";

}  // namespace twinkle::tenancy
