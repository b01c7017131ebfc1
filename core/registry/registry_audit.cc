// Registry's audit table (schema v3): append-only rows (a trigger refuses UPDATE); only the
// retention sweep (ExpireAudit) deletes.
#include <sqlite3.h>

#include <string>
#include <vector>

#include "absl/time/time.h"
#include "core/registry/registry.h"
#include "core/registry/registry_internal.h"

namespace twinkle::registry {

using registry_internal::FromMicros;
using registry_internal::Micros;
using registry_internal::NonEmpty;
using registry_internal::Stmt;

absl::StatusOr<int64_t> Registry::AppendAudit(const AuditRecord& r) {
  if (absl::Status s = NonEmpty(r.action, "audit action"); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_,
          "INSERT INTO audit (at_us, tenant, key_id, action, object, peer, details_json) VALUES (?, ?, ?, ?, ?, ?, ?)");
  st.Bind(Micros(r.at)).Bind(r.tenant).Bind(r.key_id).Bind(r.action).Bind(r.object).Bind(r.peer);
  st.Bind(r.details_json.empty() ? std::string("{}") : r.details_json);
  if (absl::Status s = st.Run("append audit row"); !s.ok()) return s;
  return static_cast<int64_t>(sqlite3_last_insert_rowid(db_));
}

absl::StatusOr<std::vector<AuditRecord>> Registry::ListAudit(const std::string& tenant, absl::Time from, absl::Time to,
                                                             int32_t limit) {
  if (limit < 0) return absl::InvalidArgumentError("limit must be >= 0");
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_,
          "SELECT seq, at_us, tenant, key_id, action, object, peer, details_json FROM audit "
          "WHERE at_us >= ? AND at_us < ? AND (? = '' OR tenant = ?) ORDER BY at_us, seq LIMIT ?");
  st.Bind(Micros(from)).Bind(Micros(to)).Bind(tenant).Bind(tenant).Bind(int64_t{limit});
  std::vector<AuditRecord> out;
  for (;;) {
    absl::StatusOr<bool> row = st.Step("list audit rows");
    if (!row.ok()) return row.status();
    if (!*row) return out;
    AuditRecord r;
    r.seq = st.Int(0);
    r.at = FromMicros(st.Int(1));
    r.tenant = st.Text(2);
    r.key_id = st.Int(3);
    r.action = st.Text(4);
    r.object = st.Text(5);
    r.peer = st.Text(6);
    r.details_json = st.Text(7);
    out.push_back(std::move(r));
  }
}

absl::StatusOr<int64_t> Registry::ExpireAudit(absl::Time cutoff) {
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_, "DELETE FROM audit WHERE at_us < ?");
  st.Bind(Micros(cutoff));
  if (absl::Status s = st.Run("expire audit rows"); !s.ok()) return s;
  return static_cast<int64_t>(sqlite3_changes64(db_));
}

}  // namespace twinkle::registry
