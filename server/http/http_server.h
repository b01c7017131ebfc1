#pragma once
// A small asynchronous HTTP/1.1 server on Boost.Beast: a fixed pool of I/O threads serves
// any number of connections, so long-polls to come will not hold a thread each. Routes map
// (method, exact path) to a handler; everything else is 404 / 405. With a certificate it
// serves HTTPS only (Beast's ssl_stream), optionally requiring client certificates (mTLS).

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace twinkle {

class Metrics;

// Request headers by LOWER-CASE name (the first value when a name repeats).
using HttpHeaders = std::map<std::string, std::string>;

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string path;    // without the query string
  std::string query;
  std::string body;
  HttpHeaders headers;
  // Returns the header's value, or nullptr; `lower_name` must be lower-case.
  const std::string* Header(const std::string& lower_name) const {
    auto it = headers.find(lower_name);
    return it == headers.end() ? nullptr : &it->second;
  }
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  // Extra response headers, e.g. {"Retry-After", "3"}.
  std::vector<std::pair<std::string, std::string>> headers = {};
};

// HTTPS: both files set = TLS on the HTTP port (the same PEM files as gRPC).
struct HttpTlsOptions {
  std::string cert_file;       // PEM certificate chain
  std::string key_file;        // PEM private key
  std::string client_ca_file;  // set: clients must present a certificate signed by this CA
  bool enabled() const { return !cert_file.empty(); }
};

using HttpHandler = std::function<HttpResponse(const HttpRequest&)>;

class HttpServer {
 public:
  explicit HttpServer(Metrics& metrics, HttpTlsOptions tls = {});
  ~HttpServer();

  // Routes must be added before Start.
  void Route(const std::string& method, const std::string& path, HttpHandler handler);

  // Binds host:port (0 = any free port), starts `threads` I/O threads, returns the port.
  // With TLS, first loads the certificate, key and client CA (InvalidArgument naming the
  // file on failure).
  absl::StatusOr<int> Start(const std::string& host, int port, int threads);

  // Stops accepting and closes every connection; returns once the I/O threads have ended.
  void Stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace twinkle
