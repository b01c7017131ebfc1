#pragma once
// The audit log's one entry point. Every state change worth an audit row calls Audit(...)
// after it succeeded: key and role changes (server/auth/key_admin.cc), session project
// moves, and (after the retention helper's merge) checkpoint create/delete/publish/unpublish/
// export and TTL changes.
//
//   Audit(registry, who, "checkpoint_delete", "tinker://<run>/weights/<name>", peer,
//         {{"run_id", run}});
//
// who: the caller's principal (tenancy::Tenant from the Authenticator): its tenant id and key
//   id are recorded, never the key.
// action: "<resource>_<verb>" in snake case: key_create, key_revoke, key_rotate,
//   key_role_set, tenant_create, session_project_set, checkpoint_delete, checkpoint_publish,
//   checkpoint_unpublish, checkpoint_export, checkpoint_ttl_set, ...
// object: what was acted on ("key:12", "tenant:carol", a tinker:// path, "session:<id>").
// peer: where the call came from: HttpRequest::peer or grpc::ServerContext::peer().
// details: a JSON object of extra facts. NEVER a key, a token, a tensor or a digest.
//
// Rows are append-only (the registry refuses UPDATE on them) and are deleted only by the
// retention sweep (auth.audit_retention_days). A failure to write the row is returned (and
// logged); callers decide whether to fail the request — the key admin does (its change is
// already applied, so it reports Internal naming the missing audit row).

#include <string>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/registry/registry.h"
#include "core/tenancy/tenant.h"

namespace twinkle {

absl::Status Audit(registry::Registry& registry, const tenancy::Tenant& who, absl::string_view action,
                   absl::string_view object, absl::string_view peer,
                   const nlohmann::json& details = nlohmann::json::object(), absl::Time now = absl::Now());

}  // namespace twinkle
