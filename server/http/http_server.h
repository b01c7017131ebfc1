#pragma once
// A small asynchronous HTTP/1.1 server on Boost.Beast: a fixed pool of I/O threads serves
// any number of connections, so long-polls to come will not hold a thread each. Routes map
// (method, exact path) to a handler; everything else is 404 / 405.

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"

namespace twinkle {

class Metrics;

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string path;    // without the query string
  std::string query;
  std::string body;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
};

using HttpHandler = std::function<HttpResponse(const HttpRequest&)>;

class HttpServer {
 public:
  explicit HttpServer(Metrics& metrics);
  ~HttpServer();

  // Routes must be added before Start.
  void Route(const std::string& method, const std::string& path, HttpHandler handler);

  // Binds host:port (0 = any free port), starts `threads` I/O threads, returns the port.
  absl::StatusOr<int> Start(const std::string& host, int port, int threads);

  // Stops accepting and closes every connection; returns once the I/O threads have ended.
  void Stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace twinkle
