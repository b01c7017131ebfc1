#include "server/http/http_request.h"

#include <optional>
#include <string>

#include "absl/strings/ascii.h"

namespace twinkle {

HttpRequest RequestHead(const boost::beast::http::request<boost::beast::http::string_body>& req) {
  HttpRequest request;
  request.method = std::string(req.method_string());
  const std::string target(req.target());
  const size_t q = target.find('?');
  request.path = target.substr(0, q);
  if (q != std::string::npos) request.query = target.substr(q + 1);
  for (const auto& field : req) {
    request.headers.emplace(absl::AsciiStrToLower(std::string(field.name_string())), std::string(field.value()));
  }
  return request;
}

std::string UrlDecode(absl::string_view text, bool plus_is_space) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '%' && i + 2 < text.size() && hex(text[i + 1]) >= 0 &&
        hex(text[i + 2]) >= 0) {
      out.push_back(static_cast<char>(hex(text[i + 1]) * 16 + hex(text[i + 2])));
      i += 2;
    } else if (c == '+' && plus_is_space) {
      out.push_back(' ');
    } else {
      out.push_back(c);
    }
  }
  return out;
}

std::optional<std::string> HttpRequest::QueryParam(absl::string_view name) const {
  absl::string_view rest(query);
  while (!rest.empty()) {
    const size_t amp = rest.find('&');
    absl::string_view part = rest.substr(0, amp);
    rest = amp == absl::string_view::npos ? absl::string_view() : rest.substr(amp + 1);
    const size_t eq = part.find('=');
    const std::string key = UrlDecode(part.substr(0, eq), true);
    if (key != name) continue;
    return eq == absl::string_view::npos ? std::string() : UrlDecode(part.substr(eq + 1), true);
  }
  return std::nullopt;
}

}  // namespace twinkle
