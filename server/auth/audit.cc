#include "server/auth/audit.h"

#include "absl/strings/str_cat.h"
#include "core/common/log.h"

namespace twinkle {

absl::Status Audit(registry::Registry& registry, const tenancy::Tenant& who, absl::string_view action,
                   absl::string_view object, absl::string_view peer, const nlohmann::json& details,
                   absl::Time now) {
  registry::AuditRecord row;
  row.at = now;
  row.tenant = who.id;
  row.key_id = who.key_id;
  row.action = std::string(action);
  row.object = std::string(object);
  row.peer = std::string(peer);
  row.details_json = details.is_object() ? details.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
                                         : std::string("{}");
  absl::StatusOr<int64_t> seq = registry.AppendAudit(row);
  if (!seq.ok()) {
    LogError("audit", absl::StrCat("could not write the audit row for ", action, " on ", object, ": ",
                                   seq.status().message()));
    return seq.status();
  }
  return absl::OkStatus();
}

}  // namespace twinkle
