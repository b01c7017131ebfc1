#include "server/tinker/trace_store.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace twinkle::tinker {

void TraceStore::Record(const std::string& tenant, const std::string& session, TraceEvent event) {
  if (session.empty()) return;
  absl::MutexLock lock(&mu_);
  const std::string key = absl::StrCat(tenant, "\n", session);
  auto it = traces_.find(key);
  if (it == traces_.end()) {
    if (traces_.size() >= kMaxTracedSessions) {
      auto oldest = traces_.begin();
      for (auto t = traces_.begin(); t != traces_.end(); ++t) {
        if (t->second.touched < oldest->second.touched) oldest = t;
      }
      traces_.erase(oldest);
    }
    it = traces_.emplace(key, Trace{}).first;
  }
  Trace& trace = it->second;
  trace.touched = ++clock_;
  trace.events.push_back(std::move(event));
  if (trace.events.size() > kMaxEventsPerSession) trace.events.pop_front();
}

std::vector<TraceEvent> TraceStore::Events(const std::string& tenant, const std::string& session) const {
  absl::MutexLock lock(&mu_);
  auto it = traces_.find(absl::StrCat(tenant, "\n", session));
  if (it == traces_.end()) return {};
  return std::vector<TraceEvent>(it->second.events.begin(), it->second.events.end());
}

}  // namespace twinkle::tinker
