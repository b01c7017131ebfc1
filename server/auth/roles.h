#pragma once
// What each role may call, for both transports (docs/security.md, "Roles"). One place: the
// HTTP header check (server/tinker/http_routes.cc) and the gRPC handlers' admission
// (server/grpc/handler.cc) ask these.
//
//   admin      everything, plus the admin routes (/api/v1/audit, /api/v1/billing/..., the
//              AdminService) for every tenant
//   member     everything of its own tenant except the admin routes
//   read-only  GETs and the calls that only read or sample: create/heartbeat/finish a
//              session, create a sampling session, sample (also the OpenAI completions
//              routes), retrieve a future, get_info, weights_info, search sessions, revoke
//              its own key; downloads of checkpoints it can read (external_weights_urls and
//              archive are GETs; the signed URL needs no key). Never train, save (also
//              save_weights_external, which writes a checkpoint), load, copy, import,
//              delete, publish, set a TTL or a project.
//
// Refusals are PermissionDenied (HTTP 403) naming the needed and the caller's role.

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "core/tenancy/tenant.h"

namespace twinkle {

// `path` is the full HTTP path ("/api/v1/..."); anything outside /api/v1 is not checked here.
absl::Status CheckHttpRole(const tenancy::Tenant& who, absl::string_view method, absl::string_view path);
// `method` is "Service/Method" as the gRPC handlers name it ("TrainingService/AddAdapter").
absl::Status CheckGrpcRole(const tenancy::Tenant& who, absl::string_view method);

}  // namespace twinkle
