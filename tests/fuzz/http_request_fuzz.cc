// libFuzzer entry point for the HTTP front: raw bytes go through Boost.Beast's
// request_parser<string_body> (the body limit the server sets), then what HttpServer and the
// Tinker routes do with the request: RequestHead (method, path, query, lower-cased headers),
// the Host/Origin guard on a loopback and on a public bind, query parameters, and the
// URL-decoded tail of a prefix route. Invariants: no crash or sanitizer report; UrlDecode
// never lengthens its input; HostName is lower-case.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include <boost/beast/core/error.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/string_body.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "server/http/http_request.h"
#include "server/http/request_guard.h"

namespace http = boost::beast::http;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  http::request_parser<http::string_body> parser;
  parser.body_limit(64 << 20);
  parser.eager(true);
  boost::beast::error_code ec;
  parser.put(boost::asio::buffer(data, size), ec);
  if (!ec && !parser.is_done()) parser.put_eof(ec);
  if (!parser.is_header_done()) return 0;

  twinkle::HttpRequest request = twinkle::RequestHead(parser.get());
  if (parser.is_done() && !ec) request.body = parser.get().body();

  for (const char* bind : {"127.0.0.1", "0.0.0.0"}) {
    twinkle::RequestGuardOptions options;
    options.bind_host = bind;
    (void)twinkle::CheckHostAndOrigin(options, request);
    options.allowed_hosts = {"example.com", "::1"};
    options.allowed_origins = {"https://example.com"};
    (void)twinkle::CheckHostAndOrigin(options, request);
  }
  if (const std::string* host = request.Header("host"); host != nullptr) {
    const std::string name = twinkle::HostName(*host);
    if (name != absl::AsciiStrToLower(name)) std::abort();
  }
  for (const char* name : {"limit", "offset", "", "a b"}) {
    if (std::optional<std::string> v = request.QueryParam(name); v && v->size() > request.query.size()) std::abort();
  }
  // Prefix routes (/api/v1/sessions/, /training_runs/, /samplers/) take the decoded tail.
  constexpr absl::string_view kPrefix = "/api/v1/";
  if (absl::StartsWith(request.path, kPrefix)) {
    const std::string tail = twinkle::UrlDecode(absl::string_view(request.path).substr(kPrefix.size()), false);
    if (tail.size() > request.path.size() - kPrefix.size()) std::abort();
  }
  if (twinkle::UrlDecode(request.query, true).size() > request.query.size()) std::abort();
  return 0;
}
