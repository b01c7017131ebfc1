#pragma once
// Which browsers and host names may talk to the HTTP API (server.allowed_hosts,
// server.allowed_origins): a header check (HttpServer::AddHeaderCheck) that answers 403
// before the body is read.
//
// - Host: on a loopback bind the API is only for this machine, yet a web page whose domain
//   re-resolves to 127.0.0.1 (DNS rebinding) would reach it with its own name as Host and
//   read the replies. So a Host must be a loopback name (localhost, 127.x.x.x, ::1), the
//   bind address, or listed. On any other bind the check applies only when a list is set.
// - Origin: browsers send it on cross-origin requests (the SDKs never do). Any Origin not
//   listed is refused, so a page the user visits cannot POST to the API.

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "server/http/http_server.h"

namespace twinkle {

struct RequestGuardOptions {
  std::string bind_host;                     // server.host
  std::vector<std::string> allowed_hosts;    // names, no ports; compared case-insensitively
  std::vector<std::string> allowed_origins;  // scheme://host[:port], compared exactly (case-insensitive)
};

// The name in a Host header without its port and brackets: "[::1]:8000" -> "::1",
// "Example.COM:80" -> "example.com".
std::string HostName(absl::string_view host_header);

// The 403 to answer, or nullopt when the request may go on.
std::optional<HttpResponse> CheckHostAndOrigin(const RequestGuardOptions& options, const HttpRequest& head);

}  // namespace twinkle
