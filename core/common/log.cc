#include "core/common/log.h"

#include <atomic>
#include <cstdio>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace twinkle {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
std::atomic<int> g_format{static_cast<int>(LogFormat::kText)};
constexpr char kHex[] = "0123456789abcdef";

absl::string_view LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "DEBUG";
    case LogLevel::kInfo: return "INFO ";
    case LogLevel::kWarning: return "WARN ";
    case LogLevel::kError: return "ERROR";
  }
  return "?";
}

absl::string_view JsonLevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarning: return "warning";
    case LogLevel::kError: return "error";
  }
  return "?";
}

void AppendEscaped(std::string& line, absl::string_view text) {
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

// The length of the valid UTF-8 sequence starting at text[i], or 0 when it is not one.
size_t Utf8SequenceLength(absl::string_view text, size_t i) {
  const auto b0 = static_cast<unsigned char>(text[i]);
  size_t n = 0;
  uint32_t min = 0;
  if (b0 >= 0xc2 && b0 <= 0xdf) {
    n = 2, min = 0x80;
  } else if (b0 >= 0xe0 && b0 <= 0xef) {
    n = 3, min = 0x800;
  } else if (b0 >= 0xf0 && b0 <= 0xf4) {
    n = 4, min = 0x10000;
  } else {
    return 0;
  }
  if (i + n > text.size()) return 0;
  uint32_t cp = b0 & (0x7f >> n);
  for (size_t k = 1; k < n; ++k) {
    const auto b = static_cast<unsigned char>(text[i + k]);
    if ((b & 0xc0) != 0x80) return 0;
    cp = (cp << 6) | (b & 0x3f);
  }
  if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
  return n;
}

void AppendJsonEscaped(std::string& out, absl::string_view text) {
  for (size_t i = 0; i < text.size();) {
    const char c = text[i];
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x80) {
      const size_t n = Utf8SequenceLength(text, i);
      if (n == 0) {
        out.append("\\ufffd");
        ++i;
      } else {
        out.append(text.data() + i, n);
        i += n;
      }
      continue;
    }
    switch (c) {
      case '"': out.append("\\\""); break;
      case '\\': out.append("\\\\"); break;
      case '\n': out.append("\\n"); break;
      case '\r': out.append("\\r"); break;
      case '\t': out.append("\\t"); break;
      default:
        if (u < 0x20 || u == 0x7f) {
          out.append("\\u00");
          out.push_back(kHex[u >> 4]);
          out.push_back(kHex[u & 0xf]);
        } else {
          out.push_back(c);
        }
    }
    ++i;
  }
}

void AppendJsonField(std::string& line, absl::string_view name, absl::string_view value) {
  line.append(",\"").append(name.data(), name.size()).append("\":\"");
  AppendJsonEscaped(line, value);
  line.push_back('"');
}

std::string Now() {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone());
}

bool Enabled(LogLevel level) { return static_cast<int>(level) >= g_level.load(std::memory_order_relaxed); }

// One fwrite of a whole line, so lines from different threads never interleave.
void Emit(const std::string& line) { std::fwrite(line.data(), 1, line.size(), stderr); }

// The start of a line, up to (not including) the message: text "TIME LEVEL [component] ",
// JSON '{"time":...,"level":...,"component":...'.
std::string Head(LogLevel level, absl::string_view component, bool json) {
  std::string line;
  if (json) {
    line.append("{\"time\":\"").append(Now()).append("\"");
    AppendJsonField(line, "level", JsonLevelName(level));
    AppendJsonField(line, "component", component);
    return line;
  }
  line = Now();
  line.append(" ").append(LevelName(level).data(), LevelName(level).size()).append(" [");
  AppendEscaped(line, component);
  line.append("] ");
  return line;
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

void SetLogFormat(LogFormat format) { g_format.store(static_cast<int>(format)); }
LogFormat GetLogFormat() { return static_cast<LogFormat>(g_format.load(std::memory_order_relaxed)); }

bool ParseLogFormat(absl::string_view name, LogFormat* format) {
  if (name == "text") *format = LogFormat::kText;
  else if (name == "json") *format = LogFormat::kJson;
  else return false;
  return true;
}

absl::string_view LogFormatName(LogFormat format) { return format == LogFormat::kJson ? "json" : "text"; }

std::string EscapeForLog(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  AppendEscaped(out, text);
  return out;
}

std::string JsonEscapeForLog(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  AppendJsonEscaped(out, text);
  return out;
}

void Log(LogLevel level, absl::string_view component, absl::string_view message) {
  if (!Enabled(level)) return;
  // Control characters are escaped, so a client's string inside a message (a name, a path,
  // an error text) can neither end the line early nor forge the next one.
  const bool json = GetLogFormat() == LogFormat::kJson;
  std::string line = Head(level, component, json);
  if (json) {
    AppendJsonField(line, "msg", message);
    line.append("}\n");
  } else {
    AppendEscaped(line, message);
    line.append("\n");
  }
  Emit(line);
}

void LogRequest(LogLevel level, absl::string_view component, const RequestLogFields& f) {
  if (!Enabled(level)) return;
  const bool json = GetLogFormat() == LogFormat::kJson;
  std::string line = Head(level, component, json);
  char duration_ms[32] = "";
  if (f.duration_s >= 0) std::snprintf(duration_ms, sizeof(duration_ms), "%.3f", f.duration_s * 1e3);
  if (json) {
    AppendJsonField(line, "msg", "request");
    AppendJsonField(line, "request_id", f.request_id);
    if (!f.tenant.empty()) AppendJsonField(line, "tenant", f.tenant);
    AppendJsonField(line, "op", f.op);
    AppendJsonField(line, "outcome", f.outcome);
    if (duration_ms[0] != 0) line.append(",\"duration_ms\":").append(duration_ms);
    line.append("}\n");
  } else {
    line.append("request request_id=");
    AppendEscaped(line, f.request_id);
    if (!f.tenant.empty()) {
      line.append(" tenant=");
      AppendEscaped(line, f.tenant);
    }
    line.append(" op=\"");
    AppendEscaped(line, f.op);
    line.append("\" outcome=");
    AppendEscaped(line, f.outcome);
    if (duration_ms[0] != 0) line.append(" duration_ms=").append(duration_ms);
    line.append("\n");
  }
  Emit(line);
}

std::string NewRequestId() {
  thread_local std::mt19937_64 rng{[] {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }()};
  const uint64_t v = rng();
  std::string id(16, '0');
  for (int i = 0; i < 16; ++i) id[i] = kHex[(v >> (60 - 4 * i)) & 0xf];
  return id;
}

bool IsValidRequestId(absl::string_view id) {
  if (id.empty() || id.size() > 64) return false;
  for (const char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == ':' || c == '-';
    if (!ok) return false;
  }
  return true;
}

}  // namespace twinkle
