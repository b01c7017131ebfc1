#pragma once
// The hosted-service routes under /api/v1 that are not training or sampling (docs/api.md,
// "Sessions, keys, usage and audit"):
//   POST   /auth/token                          the SDK's auth exchange: API key → short-lived JWT
//   GET    /auth/apikey/me                      who am I (key id, tenant, role; never the key)
//   DELETE /auth/apikey/me                      revoke the calling key
//   GET    /audit                               AdminClient.get_audit_log (admin)
//   GET    /billing/usage/events                AdminClient.get_billing_usage (admin)
//   GET    /billing/usage/checkpoints/current   AdminClient.get_current_checkpoint_storage_usage (admin)
//   POST   /sessions/search                     RestClient.search_sessions
//   PUT    /sessions/{id}/project               RestClient.assign_session_project
// Thin codecs over KeyAdmin, UsageMeter, the registry and TinkerApi.

#include "server/http/http_server.h"
#include "server/serving_state.h"
#include "server/tinker/tinker_api.h"

namespace twinkle::tinker {

// Call before HttpServer::Start (and after AddTinkerRoutes, whose header check covers these).
void AddAdminRoutes(HttpServer& http, TinkerApi& api, ServingState& state);

// The billing window's limits (docs/api.md).
inline constexpr absl::Duration kMaxBillingWindow = absl::Hours(24 * 14);
// Audit rows one /audit call returns at most.
inline constexpr int32_t kMaxAuditRows = 10000;

}  // namespace twinkle::tinker
