#include "core/common/log.h"

#include <atomic>
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace twinkle {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};

absl::string_view LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "DEBUG";
    case LogLevel::kInfo: return "INFO ";
    case LogLevel::kWarning: return "WARN ";
    case LogLevel::kError: return "ERROR";
  }
  return "?";
}

void AppendEscaped(std::string& line, absl::string_view text) {
  static constexpr char kHex[] = "0123456789abcdef";
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    switch (c) {
      case '\\': line.append("\\\\"); break;
      case '\n': line.append("\\n"); break;
      case '\r': line.append("\\r"); break;
      case '\t': line.append("\\t"); break;
      default:
        if (u < 0x20 || u == 0x7f) {
          line.append("\\x");
          line.push_back(kHex[u >> 4]);
          line.push_back(kHex[u & 0xf]);
        } else {
          line.push_back(c);
        }
    }
  }
}

}  // namespace

void SetLogLevel(LogLevel level) { g_level.store(static_cast<int>(level)); }

bool ParseLogLevel(absl::string_view name, LogLevel* level) {
  if (name == "debug") *level = LogLevel::kDebug;
  else if (name == "info") *level = LogLevel::kInfo;
  else if (name == "warning") *level = LogLevel::kWarning;
  else if (name == "error") *level = LogLevel::kError;
  else return false;
  return true;
}

std::string EscapeForLog(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  AppendEscaped(out, text);
  return out;
}

void Log(LogLevel level, absl::string_view component, absl::string_view message) {
  if (static_cast<int>(level) < g_level.load(std::memory_order_relaxed)) return;
  // One fwrite of a whole line, so lines from different threads never interleave. Control
  // characters are escaped, so a client's string inside a message (a name, a path, an error
  // text) can neither end the line early nor forge the next one.
  std::string line = absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone());
  line.append(" ").append(LevelName(level).data(), LevelName(level).size()).append(" [");
  AppendEscaped(line, component);
  line.append("] ");
  AppendEscaped(line, message);
  line.append("\n");
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace twinkle
