#pragma once
// One line per event on stderr, in one of two formats (logging.format):
//   text (default): "2026-11-30T22:51:26.123Z INFO  [component] message"
//   json:           {"time":"2026-11-30T22:51:26.123Z","level":"info","component":"...","msg":"..."}
// Request lines (LogRequest) add the request id, tenant, op, duration and outcome, as fields
// in JSON and as key=value pairs in text. Deliberately tiny: the daemon's logs go to journald
// / kubectl logs, which add their own metadata. Never pass keys, prompts or tensor contents
// here.

#include <string>

#include "absl/strings/string_view.h"

namespace twinkle {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };
enum class LogFormat { kText = 0, kJson = 1 };

// Lines below this level are dropped. Defaults to kInfo.
void SetLogLevel(LogLevel level);
bool ParseLogLevel(absl::string_view name, LogLevel* level);
// Defaults to kText. Set once at startup, before other threads log.
void SetLogFormat(LogFormat format);
bool ParseLogFormat(absl::string_view name, LogFormat* format);
absl::string_view LogFormatName(LogFormat format);
LogFormat GetLogFormat();

// Writes the line with control characters and backslashes escaped (EscapeForLog; in JSON,
// JSON string escapes).
void Log(LogLevel level, absl::string_view component, absl::string_view message);

// One finished request: what the access log records of it. No key, prompt or tensor ever
// goes in here; `op` is a route or RPC name, `outcome` a gRPC code name or an HTTP status.
struct RequestLogFields {
  absl::string_view request_id;
  absl::string_view tenant;  // empty: not known (unauthenticated, or an open route)
  absl::string_view op;
  absl::string_view outcome;
  double duration_s = -1;  // negative: not measured
};
void LogRequest(LogLevel level, absl::string_view component, const RequestLogFields& fields);

// A fresh request id: 16 lower-case hex digits from a random source.
std::string NewRequestId();
// A client may bring its own id (x-request-id): 1 to 64 of [A-Za-z0-9._:-]. Anything else is
// replaced by a fresh id, so an id can neither forge a log line nor bloat it.
bool IsValidRequestId(absl::string_view id);

// `text` with '\\' as "\\\\", newline, CR and tab as "\\n", "\\r", "\\t", and other control
// characters as "\\xNN": what Log writes for a message.
std::string EscapeForLog(absl::string_view text);

// `text` as the inside of a JSON string: '"' and '\\' escaped, control characters as
// \u00XX, invalid UTF-8 bytes as U+FFFD; valid UTF-8 passes through.
std::string JsonEscapeForLog(absl::string_view text);

inline void LogInfo(absl::string_view component, absl::string_view message) {
  Log(LogLevel::kInfo, component, message);
}
inline void LogWarning(absl::string_view component, absl::string_view message) {
  Log(LogLevel::kWarning, component, message);
}
inline void LogError(absl::string_view component, absl::string_view message) {
  Log(LogLevel::kError, component, message);
}

}  // namespace twinkle
