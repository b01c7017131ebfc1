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

struct Tenant {
  std::string id;  // [a-z0-9_-]{1,64}; "default" when authentication is off
  Quotas quotas;
};

// The one tenant every request belongs to when authentication is off.
inline constexpr char kDefaultTenantId[] = "default";

}  // namespace twinkle::tenancy
