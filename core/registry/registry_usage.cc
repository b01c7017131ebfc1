// Registry's usage table (schema v3; v6 adds the base model): hourly counters per tenant, key,
// session, run, base model and kind, written in batches by the server's usage meter
// (server/usage_meter.h).
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "core/registry/registry.h"
#include "core/registry/registry_internal.h"

namespace twinkle::registry {

using registry_internal::FromMicros;
using registry_internal::Micros;
using registry_internal::Stmt;
using registry_internal::Txn;

absl::Status Registry::AddUsage(const std::vector<UsageRecord>& rows) {
  if (rows.empty()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  Txn txn(db_, path_);
  if (absl::Status s = txn.Begin(/*write=*/true); !s.ok()) return s;
  for (const UsageRecord& r : rows) {
    Stmt st(db_, path_,
            "INSERT INTO usage (bucket_us, tenant, key_id, session_id, run_id, base_model, kind, amount) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (bucket_us, tenant, key_id, session_id, run_id, base_model, kind) "
            "DO UPDATE SET amount = usage.amount + excluded.amount");
    st.Bind(Micros(r.bucket)).Bind(r.tenant).Bind(r.key_id).Bind(r.session_id).Bind(r.run_id).Bind(r.base_model);
    st.Bind(r.kind).Bind(r.amount);
    if (absl::Status s = st.Run("add usage"); !s.ok()) return s;
  }
  return txn.Commit();
}

absl::StatusOr<std::vector<UsageRecord>> Registry::ListUsage(const std::string& tenant, absl::Time from,
                                                             absl::Time to) {
  absl::MutexLock lock(&mu_);
  Stmt st(db_, path_,
          "SELECT bucket_us, tenant, key_id, session_id, run_id, kind, amount, base_model FROM usage "
          "WHERE bucket_us >= ? AND bucket_us < ? AND (? = '' OR tenant = ?) "
          "ORDER BY bucket_us, tenant, key_id, session_id, run_id, base_model, kind");
  st.Bind(Micros(from)).Bind(Micros(to)).Bind(tenant).Bind(tenant);
  std::vector<UsageRecord> out;
  for (;;) {
    absl::StatusOr<bool> row = st.Step("list usage");
    if (!row.ok()) return row.status();
    if (!*row) return out;
    UsageRecord r;
    r.bucket = FromMicros(st.Int(0));
    r.tenant = st.Text(1);
    r.key_id = st.Int(2);
    r.session_id = st.Text(3);
    r.run_id = st.Text(4);
    r.kind = st.Text(5);
    r.amount = st.Int(6);
    r.base_model = st.Text(7);
    out.push_back(std::move(r));
  }
}

}  // namespace twinkle::registry
