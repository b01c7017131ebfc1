#include "server/http/http_server.h"

#include <thread>
#include <vector>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "core/common/log.h"
#include "server/metrics.h"

namespace twinkle {
namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

namespace {
constexpr size_t kMaxBodyBytes = 64 << 20;
constexpr auto kIdleTimeout = std::chrono::seconds(120);

using Routes = std::map<std::pair<std::string, std::string>, HttpHandler>;

// One connection: read a request, answer it, repeat while keep-alive.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, const Routes& routes, Metrics& metrics)
      : stream_(std::move(socket)), routes_(routes), metrics_(metrics) {}

  void Run() {
    asio::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->Read(); });
  }

 private:
  void Read() {
    parser_.emplace();
    parser_->body_limit(kMaxBodyBytes);
    stream_.expires_after(kIdleTimeout);
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code ec, size_t) { self->OnRead(ec); });
  }

  void OnRead(beast::error_code ec) {
    if (ec == http::error::end_of_stream || ec) {
      beast::error_code ignored;
      stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
      return;
    }
    http::request<http::string_body> req = parser_->release();
    HttpRequest request;
    request.method = std::string(req.method_string());
    const std::string target(req.target());
    const size_t q = target.find('?');
    request.path = target.substr(0, q);
    if (q != std::string::npos) request.query = target.substr(q + 1);
    request.body = std::move(req.body());

    HttpResponse response = Dispatch(request);
    auto res = std::make_shared<http::response<http::string_body>>(
        static_cast<http::status>(response.status), req.version());
    res->set(http::field::server, "twinkle-server");
    res->set(http::field::content_type, response.content_type);
    res->keep_alive(req.keep_alive());
    res->body() = std::move(response.body);
    res->prepare_payload();
    http::async_write(stream_, *res,
                      [self = shared_from_this(), res](beast::error_code ec, size_t) {
                        if (ec || !res->keep_alive()) {
                          beast::error_code ignored;
                          self->stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
                          return;
                        }
                        self->Read();
                      });
  }

  HttpResponse Dispatch(const HttpRequest& request) {
    auto it = routes_.find({request.method, request.path});
    if (it == routes_.end()) {
      bool path_known = false;
      for (const auto& [key, handler] : routes_) path_known |= key.second == request.path;
      RequestTimer timer(metrics_, "HTTP other");
      const int status = path_known ? 405 : 404;
      timer.set_code(absl::StrCat(status));
      const nlohmann::json body = {{"error", path_known ? "method not allowed" : "not found"},
                                   {"path", request.path.substr(0, 200)}};
      return {status, "application/json", body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)};
    }
    RequestTimer timer(metrics_, absl::StrCat(request.method, " ", request.path));
    HttpResponse response = it->second(request);
    timer.set_code(absl::StrCat(response.status));
    return response;
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  const Routes& routes_;
  Metrics& metrics_;
};

}  // namespace

struct HttpServer::Impl {
  explicit Impl(Metrics& m) : metrics(m) {}

  void Accept() {
    acceptor->async_accept(asio::make_strand(io), [this](beast::error_code ec, tcp::socket socket) {
      if (ec) {
        if (ec != asio::error::operation_aborted) {
          LogWarning("http", absl::StrCat("accept failed: ", ec.message()));
        }
        if (!acceptor->is_open()) return;
      } else {
        std::make_shared<Session>(std::move(socket), routes, metrics)->Run();
      }
      Accept();
    });
  }

  Metrics& metrics;
  Routes routes;
  asio::io_context io;
  std::optional<tcp::acceptor> acceptor;
  std::vector<std::thread> threads;
};

HttpServer::HttpServer(Metrics& metrics) : impl_(std::make_unique<Impl>(metrics)) {}
HttpServer::~HttpServer() { Stop(); }

void HttpServer::Route(const std::string& method, const std::string& path, HttpHandler handler) {
  impl_->routes[{method, path}] = std::move(handler);
}

absl::StatusOr<int> HttpServer::Start(const std::string& host, int port, int threads) {
  beast::error_code ec;
  const std::string bind_host = host == "localhost" ? "127.0.0.1" : host;
  const asio::ip::address address = asio::ip::make_address(bind_host, ec);
  if (ec) return absl::InvalidArgumentError(absl::StrCat("bad HTTP host '", host, "': ", ec.message()));
  const tcp::endpoint endpoint(address, static_cast<uint16_t>(port));
  impl_->acceptor.emplace(impl_->io);
  impl_->acceptor->open(endpoint.protocol(), ec);
  if (!ec) impl_->acceptor->set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) impl_->acceptor->bind(endpoint, ec);
  if (!ec) impl_->acceptor->listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return absl::UnavailableError(absl::StrCat("cannot listen for HTTP on ", bind_host, ":", port,
                                               ": ", ec.message()));
  }
  const int bound = impl_->acceptor->local_endpoint().port();
  impl_->Accept();
  for (int i = 0; i < threads; ++i) impl_->threads.emplace_back([this] { impl_->io.run(); });
  return bound;
}

void HttpServer::Stop() {
  if (!impl_ || impl_->threads.empty()) return;
  asio::post(impl_->io, [this] {
    beast::error_code ignored;
    impl_->acceptor->close(ignored);
  });
  impl_->io.stop();
  for (std::thread& t : impl_->threads) t.join();
  impl_->threads.clear();
}

}  // namespace twinkle
