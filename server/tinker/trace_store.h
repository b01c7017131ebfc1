#pragma once
// The requests of each Tinker session, with timings and sizes, for
// GET /sessions/{id}/trace_export. Never tokens, tensors or keys: only the route, when it
// started, how long it took, the request and response sizes in bytes and the HTTP status.
//
// Bounded: at most kMaxEventsPerSession events per session (the oldest are dropped) and
// kMaxTracedSessions sessions (the one recorded least recently is dropped). In memory only:
// a restart forgets the traces.

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace twinkle::tinker {

inline constexpr size_t kMaxEventsPerSession = 10000;
inline constexpr size_t kMaxTracedSessions = 4096;

struct TraceEvent {
  std::string route;  // "POST /api/v1/forward_backward"
  absl::Time start;
  absl::Duration duration;
  int64_t request_bytes = 0;
  int64_t response_bytes = 0;
  int status = 0;
};

class TraceStore {
 public:
  void Record(const std::string& tenant, const std::string& session, TraceEvent event);
  // Oldest first; empty when none were recorded.
  std::vector<TraceEvent> Events(const std::string& tenant, const std::string& session) const;

 private:
  struct Trace {
    std::deque<TraceEvent> events;
    uint64_t touched = 0;
  };
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Trace> traces_ ABSL_GUARDED_BY(mu_);  // tenant "\n" session
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace twinkle::tinker
