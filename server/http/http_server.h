#pragma once
// A small asynchronous HTTP/1.1 server on Boost.Beast: a fixed pool of I/O threads serves
// any number of connections. Routes map (method, exact path) or (method, path prefix) to a
// handler; everything else is 404 / 405. A handler either returns its response at once, or
// (RouteAsync) gets a responder it may call later from any thread, so a long-poll holds no
// thread while it waits. A response's body is a string, or (HttpResponse::body_source) is
// produced in chunks by a producer thread with flow control, for large downloads; a streaming
// route (RouteStreaming) may instead write a chunked body of unknown length (server-sent
// events). With a certificate it serves HTTPS only (Beast's ssl_stream), optionally
// requiring client certificates (mTLS).

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace twinkle {

class Metrics;

// Request headers by LOWER-CASE name (the first value when a name repeats).
using HttpHeaders = std::map<std::string, std::string>;

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string path;    // without the query string
  std::string query;  // raw, without the '?'
  std::string body;
  HttpHeaders headers;
  // Prefix routes: the part of `path` after the prefix (URL-decoded); empty otherwise.
  std::string path_tail;
  // The client's address ("ip:port"; audit rows' "from where"); empty in tests without sockets.
  std::string peer;
  // Streaming routes (RouteStreaming) only, else unset: registers `callback` to run once (on
  // an I/O thread; at once if it already has) when the client closes its connection (or
  // shuts down its sending side, or resets it) while the response is still pending, i.e.
  // before the responder or the streamer was called; so a handler that answers later can
  // stop work nobody will read. One callback; a later one replaces it. After the streamer
  // was called, HttpStream::OnClientGone takes over.
  std::function<void(std::function<void()> callback)> on_client_gone;
  // Returns the header's value, or nullptr; `lower_name` must be lower-case.
  const std::string* Header(const std::string& lower_name) const {
    auto it = headers.find(lower_name);
    return it == headers.end() ? nullptr : &it->second;
  }
  // The URL-decoded value of query parameter `name` (the first one when it repeats), or
  // nullopt when absent.
  std::optional<std::string> QueryParam(absl::string_view name) const;
};

// Decodes %XX escapes and '+' (as a space when `plus_is_space`); malformed escapes stay as
// they are.
std::string UrlDecode(absl::string_view text, bool plus_is_space);

// Takes the next chunk of a produced body (HttpBodySource). Blocks while the connection
// already holds kMaxQueuedBodyChunks chunks it has not written (flow control: a slow client
// slows the producer, the server never holds more). An error (Cancelled) once the client is
// gone (its connection closed or reset, or a chunk not taken within the idle timeout) or the
// server is stopping: the producer must then stop. Empty chunks are skipped.
using HttpBodySink = std::function<absl::Status(absl::string_view chunk)>;
inline constexpr int kMaxQueuedBodyChunks = 2;

// A response body produced in chunks instead of held whole (downloads of large files): its
// length is known before the first byte (it is the Content-Length), and `produce` hands the
// bytes to the sink in order. `produce` runs on a producer thread, never on an I/O thread, so
// it may block on disk. A producer that returns an error, or ends with another length than
// `size`, aborts the connection without completing the body: the last chunk is written only
// once `produce` has returned OK, so a client never sees a complete-looking body that failed
// a check at its end (e.g. a checksum). At most HttpServerLimits::max_body_producers run at
// once; a response past that is answered 503 with Retry-After instead.
struct HttpBodySource {
  int64_t size = 0;
  std::function<absl::Status(const HttpBodySink& sink)> produce;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  // Extra response headers, e.g. {"Retry-After", "3"}.
  std::vector<std::pair<std::string, std::string>> headers = {};
  // Set: the body is produced by it (and `body` is ignored). Exact, prefix and async routes
  // only (a streaming route's HttpStreamer takes no source).
  std::optional<HttpBodySource> body_source = std::nullopt;
};

// HTTPS: both files set = TLS on the HTTP port (the same PEM files as gRPC).
struct HttpTlsOptions {
  std::string cert_file;       // PEM certificate chain
  std::string key_file;        // PEM private key
  std::string client_ca_file;  // set: clients must present a certificate signed by this CA
  bool enabled() const { return !cert_file.empty(); }
};

using HttpHandler = std::function<HttpResponse(const HttpRequest&)>;
// Runs on each request once its header is read, before its body (HttpRequest::body is empty
// here): a response it returns is sent at once and the connection closed, the body never
// read. This is where a caller without a valid key is refused before it can make the server
// read (and hold) a large body. Must be quick: it runs on an I/O thread.
using HttpHeaderCheck = std::function<std::optional<HttpResponse>(const HttpRequest& head)>;
// Sends the response; call it exactly once, from any thread (later calls are ignored).
using HttpResponder = std::function<void(HttpResponse)>;
using AsyncHttpHandler = std::function<void(const HttpRequest&, HttpResponder)>;

// The body of a streamed response (chunked transfer encoding), e.g. server-sent events.
// Thread-safe: chunks are sent in the order written, each flushed as soon as the connection
// takes it. The connection closes after End.
class HttpStream {
 public:
  virtual ~HttpStream() = default;
  // Queues one chunk (empty ones are skipped). False once the client is gone or End was called.
  virtual bool Write(std::string data) = 0;
  // Sends the last chunk; later writes are ignored.
  virtual void End() = 0;
  // True once the client went away (closed its connection or a write failed).
  virtual bool client_gone() const = 0;
  // `callback` runs once when the client goes away before End (on an I/O thread; at once if
  // it already has). One callback; a later one replaces it.
  virtual void OnClientGone(std::function<void()> callback) = 0;
};
// Sends `head` (status, content type, headers; its body is ignored) as the start of a
// streamed response and returns the stream its body is written to. It and the responder
// handed beside it answer once between them: whichever is called first wins; a streamer
// called after that returns a stream that is already gone.
using HttpStreamer = std::function<std::shared_ptr<HttpStream>(HttpResponse head)>;
using StreamingHttpHandler = std::function<void(const HttpRequest&, HttpResponder, HttpStreamer)>;

struct HttpServerLimits {
  int max_connections = 1024;  // open connections; the next is answered 503 and closed
  int idle_timeout_s = 120;    // a connection waiting this long for its next request is closed
  // A streamed response's chunks written but not yet taken by the client: past this the
  // client is taken as gone (its connection closed, OnClientGone called), so one that stops
  // reading cannot make the server hold its whole answer.
  size_t max_stream_backlog_bytes = size_t{16} << 20;
  // Produced bodies (HttpBodySource) being sent at once, each with a producer thread of its
  // own; the next is answered 503 with Retry-After. A chunk that the client does not take
  // within idle_timeout_s drops it (so a client that stops reading holds a producer for at
  // most that long).
  int max_body_producers = 16;
};

class HttpServer {
 public:
  explicit HttpServer(Metrics& metrics, HttpTlsOptions tls = {});
  ~HttpServer();

  // Routes must be added before Start.
  // Handlers run on a pool of handler threads, never on the I/O threads, so one that blocks
  // (disk, SQLite, hashing) does not stall other connections; RouteInline runs on the I/O
  // thread, for cheap probes (/healthz) that must answer even when every handler is busy.
  void Route(const std::string& method, const std::string& path, HttpHandler handler);
  void RouteInline(const std::string& method, const std::string& path, HttpHandler handler);
  void RouteAsync(const std::string& method, const std::string& path, AsyncHttpHandler handler);
  // Like RouteAsync, and the handler may answer with a streamed body instead (HttpStreamer).
  void RouteStreaming(const std::string& method, const std::string& path, StreamingHttpHandler handler);
  // Every path that starts with `prefix` (which should end in '/') and is longer than it;
  // the handler finds the rest in HttpRequest::path_tail. Exact routes win; among prefix
  // routes the longest prefix wins.
  void RoutePrefix(const std::string& method, const std::string& prefix, AsyncHttpHandler handler);
  // Adds a header check (before Start); checks run in the order added, the first response wins.
  void AddHeaderCheck(HttpHeaderCheck check);
  void SetLimits(HttpServerLimits limits);  // before Start
  // Every response carries `X-Request-Id` (the request's own when it is a valid id, else a
  // fresh one) and the access log gets one line with the same id, the route, status and
  // duration (probes and /metrics at debug level, the rest at info). `tenant_of`, when set
  // (before Start), names the caller's tenant for that line ("" when unknown); it runs on the
  // I/O thread, so it must be quick and must not count failures.
  void SetLogTenant(std::function<std::string(const HttpRequest&)> tenant_of);

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
