#pragma once
// One line per event on stderr: "2026-11-30T22:51:26.123Z INFO  [component] message".
// Deliberately tiny: the daemon's logs are line-oriented and go to journald / kubectl logs,
// which add their own metadata. Never pass keys or tensor contents here.

#include <string>

#include "absl/strings/string_view.h"

namespace twinkle {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Lines below this level are dropped. Defaults to kInfo.
void SetLogLevel(LogLevel level);
bool ParseLogLevel(absl::string_view name, LogLevel* level);

// Writes the line with control characters and backslashes escaped (EscapeForLog).
void Log(LogLevel level, absl::string_view component, absl::string_view message);

// `text` with '\\' as "\\\\", newline, CR and tab as "\\n", "\\r", "\\t", and other control
// characters as "\\xNN": what Log writes for a message.
std::string EscapeForLog(absl::string_view text);

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
