#include "server/http/request_guard.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/config/config.h"

namespace twinkle {
namespace {

bool Listed(const std::vector<std::string>& list, absl::string_view value) {
  return std::any_of(list.begin(), list.end(), [&](const std::string& item) { return absl::EqualsIgnoreCase(item, value); });
}

HttpResponse Forbidden(absl::string_view detail) {
  const nlohmann::json body = {{"error", "forbidden"}, {"detail", detail}};
  return {403, "application/json", body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)};
}

}  // namespace

std::string HostName(absl::string_view host_header) {
  absl::string_view h = absl::StripAsciiWhitespace(host_header);
  if (absl::StartsWith(h, "[")) {
    const size_t close = h.find(']');
    h = close == absl::string_view::npos ? h.substr(1) : h.substr(1, close - 1);
  } else if (const size_t colon = h.rfind(':'); colon != absl::string_view::npos && h.find(':') == colon) {
    h = h.substr(0, colon);  // one colon: name:port (more would be a bare IPv6 address)
  }
  return absl::AsciiStrToLower(h);
}

std::optional<HttpResponse> CheckHostAndOrigin(const RequestGuardOptions& options, const HttpRequest& head) {
  if (const std::string* origin = head.Header("origin"); origin != nullptr) {
    if (!Listed(options.allowed_origins, *origin)) {
      return Forbidden(absl::StrCat("requests from browser origin '", origin->substr(0, 200),
                                    "' are not allowed (server.allowed_origins)"));
    }
  }
  const bool loopback_bind = IsLoopbackHost(options.bind_host);
  if (!loopback_bind && options.allowed_hosts.empty()) return std::nullopt;
  const std::string* host = head.Header("host");
  if (host == nullptr) return std::nullopt;  // HTTP/1.0 without Host: no browser sends that
  const std::string name = HostName(*host);
  if (IsLoopbackHost(name) || absl::EqualsIgnoreCase(name, options.bind_host) || Listed(options.allowed_hosts, name)) {
    return std::nullopt;
  }
  return Forbidden(absl::StrCat("Host '", name.substr(0, 200), "' is not this server's (server.allowed_hosts)"));
}

}  // namespace twinkle
