#include "server/http/http_server.h"

#include <algorithm>
#include <array>
#include <deque>
#include <set>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include <sys/socket.h>

#include <cerrno>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/common/log.h"
#include "server/http/http_request.h"
#include "server/metrics.h"

namespace twinkle {
namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
namespace ssl = asio::ssl;
using tcp = asio::ip::tcp;

namespace {
constexpr size_t kMaxBodyBytes = 64 << 20;
// Threads that run route handlers (they may block on disk, SQLite, hashing); the I/O
// threads only read, write and dispatch.
constexpr int kHandlerThreads = 8;
constexpr auto kHandshakeTimeout = std::chrono::seconds(30);

// What a produced body's producer thread and its session share (HttpBodySource): the sink
// waits here for room (flow control) and learns here that the client is gone.
struct BodyPipe {
  std::mutex mu;
  std::condition_variable cv;
  int queued = 0;     // chunks handed to the session and not yet written (guarded by mu)
  bool gone = false;  // the client is gone, the body was aborted or the server stops (mu)

  // Waits until fewer than kMaxQueuedBodyChunks chunks are queued and takes a place; false
  // once gone.
  bool Reserve() {
    std::unique_lock lock(mu);
    cv.wait(lock, [this] { return gone || queued < kMaxQueuedBodyChunks; });
    if (gone) return false;
    ++queued;
    return true;
  }
  void Written() {
    {
      std::lock_guard lock(mu);
      --queued;
    }
    cv.notify_all();
  }
  void Cancel() {
    {
      std::lock_guard lock(mu);
      gone = true;
    }
    cv.notify_all();
  }
};

// What every session shares with the server and must outlive it: the io_context its socket
// is registered with. A session can outlive the HttpServer (a long-poll's responder is held
// by a future's completion callback until the coordinator is destroyed, after the HTTP
// server), and destroying a socket after its io_context is undefined behaviour (it was the
// segfault after "stopped cleanly"). So the io_context lives in this shared block, held by
// the server and by every session, and goes with the last of them.
struct IoCore {
  asio::io_context io;
  std::atomic<bool> stopped{false};  // set by Stop(): responders then write nothing
  std::atomic<int> connections{0};   // live sessions
  HttpServerLimits limits;
  // Handlers run here, never on the I/O threads: they may block on disk, SQLite or hashing,
  // and the I/O threads must keep serving probes and other connections meanwhile. Set by
  // Start, joined by Stop (before which no session dispatches).
  asio::thread_pool* handlers = nullptr;
  // Producers of HttpBodySource bodies run here (max_body_producers threads): they block on
  // disk and on their connection's room, so neither on the I/O threads nor on the handlers.
  // Set by Start, joined by Stop after every pipe is cancelled. `body_producers` counts the
  // bodies admitted (ProducerSlot), not yet finished.
  asio::thread_pool* producers = nullptr;
  std::atomic<int> body_producers{0};
  // Closes each live session's socket, by session; Stop uses them (after the I/O threads
  // are gone) so that every pending operation can complete and release its session.
  std::mutex mu;
  std::map<uint64_t, std::function<void()>> closers;
  // Each session's produced body in flight, so that Stop can wake and stop its producer.
  std::map<uint64_t, std::weak_ptr<BodyPipe>> body_pipes;
  uint64_t next_session = 0;
};

// One admitted produced body: counts against max_body_producers until it is destroyed (with
// the producer's task, or with the answer when it never started).
struct ProducerSlot {
  explicit ProducerSlot(std::shared_ptr<IoCore> c) : core(std::move(c)) {}
  ~ProducerSlot() { --core->body_producers; }
  ProducerSlot(const ProducerSlot&) = delete;
  ProducerSlot& operator=(const ProducerSlot&) = delete;
  std::shared_ptr<IoCore> core;
};

// Takes a place for a produced body, or nullptr past max_body_producers.
std::shared_ptr<ProducerSlot> TakeProducerSlot(const std::shared_ptr<IoCore>& core) {
  if (core->body_producers.fetch_add(1) >= core->limits.max_body_producers) {
    --core->body_producers;
    return nullptr;
  }
  return std::make_shared<ProducerSlot>(core);
}

struct Routes {
  std::map<std::pair<std::string, std::string>, AsyncHttpHandler> exact;
  std::map<std::pair<std::string, std::string>, StreamingHttpHandler> streaming;  // RouteStreaming
  std::set<std::pair<std::string, std::string>> inline_exact;  // RouteInline: run on the I/O thread
  struct Prefix {
    std::string method, prefix;
    AsyncHttpHandler handler;
  };
  std::vector<Prefix> prefixes;  // longest prefix first
  std::vector<HttpHeaderCheck> header_checks;
  std::function<std::string(const HttpRequest&)> tenant_of;  // for the access log; may be empty
};

// The request's id: its `x-request-id` header when that is a valid id, else a fresh one.
std::string RequestIdOf(const HttpRequest& request) {
  const std::string* id = request.Header("x-request-id");
  return id != nullptr && IsValidRequestId(*id) ? *id : NewRequestId();
}

// Probes and scrapes come every few seconds: their access lines are debug, the rest info.
LogLevel AccessLogLevel(const std::string& label) {
  return label == "GET /healthz" || label == "GET /readyz" || label == "GET /metrics" ? LogLevel::kDebug
                                                                                        : LogLevel::kInfo;
}

// What a streamed response's writer and its session share; also, for a streaming route's
// pending answer, what HttpRequest::on_client_gone and the session share (`ended`: answered).
struct StreamState {
  std::atomic<bool> gone{false};   // the client went away (or the server stopped)
  std::atomic<bool> ended{false};  // End was called (a pending answer: the answer was sent)
  std::mutex mu;
  std::function<void()> on_gone;  // guarded by mu

  // Registers `callback` (HttpStream::OnClientGone, HttpRequest::on_client_gone).
  void Register(std::function<void()> callback) {
    {
      std::lock_guard lock(mu);
      if (!gone.load()) {
        on_gone = std::move(callback);
        return;
      }
    }
    if (!ended.load()) callback();
  }
  // The client is gone: runs the callback once, unless the answer was already out.
  void Gone() {
    if (gone.exchange(true)) return;
    std::function<void()> callback;
    {
      std::lock_guard lock(mu);
      callback.swap(on_gone);
    }
    if (callback && !ended.load()) callback();
  }
};

// HttpStream over a session (Session<kTls> below): every call posts to the session's strand.
template <typename S>
class StreamWriter : public HttpStream {
 public:
  StreamWriter(std::shared_ptr<S> session, std::shared_ptr<StreamState> state)
      : session_(std::move(session)), state_(std::move(state)) {}

  bool Write(std::string data) override {
    if (state_->gone.load() || state_->ended.load() || session_->stopped()) return false;
    if (data.empty()) return true;
    session_->Post([s = session_, data = std::move(data)]() mutable { s->QueueChunk(std::move(data)); });
    return true;
  }
  void End() override {
    if (state_->ended.exchange(true) || session_->stopped()) return;
    session_->Post([s = session_] { s->EndStream(); });
  }
  bool client_gone() const override { return state_->gone.load(); }
  void OnClientGone(std::function<void()> callback) override { state_->Register(std::move(callback)); }

 private:
  std::shared_ptr<S> session_;
  std::shared_ptr<StreamState> state_;
};

// One connection: (TLS handshake,) read a request, answer it, repeat while keep-alive.
template <bool kTls>
class Session : public std::enable_shared_from_this<Session<kTls>> {
  using Stream = std::conditional_t<kTls, beast::ssl_stream<beast::tcp_stream>, beast::tcp_stream>;

 public:
  Session(std::shared_ptr<IoCore> core, tcp::socket socket, ssl::context* tls, const Routes& routes,
          Metrics& metrics)
      : core_(std::move(core)), stream_(MakeStream(std::move(socket), tls)), routes_(routes), metrics_(metrics) {
    ++core_->connections;
    std::lock_guard lock(core_->mu);
    id_ = core_->next_session++;
    core_->closers[id_] = [this] {
      beast::error_code ignored;
      beast::get_lowest_layer(stream_).socket().close(ignored);
    };
  }
  ~Session() {
    --core_->connections;
    std::lock_guard lock(core_->mu);
    core_->closers.erase(id_);
    core_->body_pipes.erase(id_);
  }

  void Run() {
    asio::dispatch(stream_.get_executor(), [self = this->shared_from_this()] { self->Start(); });
  }

  // ---- streamed responses (StreamWriter), on this session's strand ----
  bool stopped() const { return core_->stopped.load(); }
  template <typename F>
  void Post(F f) {
    asio::post(stream_.get_executor(), std::move(f));
  }
  void QueueChunk(std::string data) {
    if (stream_state_ != nullptr && stream_state_->gone.load()) return;
    backlog_ += data.size();
    out_.push_back(std::move(data));
    if (backlog_ > core_->limits.max_stream_backlog_bytes) {
      LogWarning("http", absl::StrCat("a streaming client is not reading (", backlog_, " bytes waiting, limit ",
                                      core_->limits.max_stream_backlog_bytes, "): dropped"));
      return StreamGone();
    }
    Pump();
  }
  void EndStream() {
    ending_ = true;
    Pump();
  }

  // Over the connection limit: answer 503 at once (after the TLS handshake, if any) and close,
  // reading nothing.
  void RunRefusing() {
    refuse_ = true;
    Run();
  }

 private:
  static Stream MakeStream(tcp::socket socket, ssl::context* tls) {
    if constexpr (kTls) {
      return Stream(std::move(socket), *tls);
    } else {
      return Stream(std::move(socket));
    }
  }

  void Start() {
    if constexpr (kTls) {
      beast::get_lowest_layer(stream_).expires_after(kHandshakeTimeout);
      stream_.async_handshake(ssl::stream_base::server,
                              [self = this->shared_from_this()](beast::error_code ec) {
                                if (ec) {
                                  // Plaintext clients, unknown CAs, missing client certs.
                                  Log(LogLevel::kDebug, "http", absl::StrCat("TLS handshake failed: ", ec.message()));
                                  return;
                                }
                                self->refuse_ ? self->Refuse() : self->Read();
                              });
    } else {
      refuse_ ? Refuse() : Read();
    }
  }

  void Refuse() {
    HttpResponse busy{503, "application/json",
                      R"({"error":"too many connections","detail":"too many connections (server.max_http_connections); retry"})",
                      {{"Retry-After", "1"}}};
    MakeResponder("HTTP refused", NewRequestId(), "", 11, /*keep_alive=*/false)(std::move(busy));
  }

  void Read() {
    parser_.emplace();
    parser_->body_limit(kMaxBodyBytes);
    beast::get_lowest_layer(stream_).expires_after(std::chrono::seconds(core_->limits.idle_timeout_s));
    http::async_read_header(stream_, buffer_, *parser_,
                            [self = this->shared_from_this()](beast::error_code ec, size_t) { self->OnHeader(ec); });
  }

  // The header is in: run the header checks; the body is read only if none answers.
  void OnHeader(beast::error_code ec) {
    if (core_->stopped.load()) return;  // Stop drains the queue: nothing new starts
    if (ec == http::error::end_of_stream) return Close();
    if (ec) return;
    if (!routes_.header_checks.empty()) {
      HttpRequest head = RequestHead(parser_->get());
      for (const HttpHeaderCheck& check : routes_.header_checks) {
        std::optional<HttpResponse> refusal = check(head);
        if (!refusal) continue;
        // Not keep-alive: the unread body would otherwise be taken for the next request.
        MakeResponder(absl::StrCat(head.method, " ", head.path), RequestIdOf(head), "",
                      parser_->get().version(), /*keep_alive=*/false)(*std::move(refusal));
        return;
      }
    }
    http::async_read(stream_, buffer_, *parser_,
                     [self = this->shared_from_this()](beast::error_code ec, size_t) { self->OnRead(ec); });
  }

  void Close() {
    if constexpr (kTls) {
      beast::get_lowest_layer(stream_).expires_after(kHandshakeTimeout);
      stream_.async_shutdown([self = this->shared_from_this()](beast::error_code) {
        beast::error_code ignored;
        beast::get_lowest_layer(self->stream_).socket().shutdown(tcp::socket::shutdown_both, ignored);
      });
    } else {
      beast::error_code ignored;
      stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    }
  }

  std::string Peer() {
    beast::error_code ec;
    const tcp::endpoint remote = beast::get_lowest_layer(stream_).socket().remote_endpoint(ec);
    if (ec) return std::string();
    return absl::StrCat(remote.address().to_string(), ":", remote.port());
  }

  void OnRead(beast::error_code ec) {
    if (core_->stopped.load()) return;
    if (ec == http::error::end_of_stream) return Close();
    if (ec) return;  // timeout, reset, or a TLS error: nothing more can be said on it
    http::request<http::string_body> req = parser_->release();
    HttpRequest request = RequestHead(req);
    request.body = std::move(req.body());
    request.peer = Peer();
    Dispatch(request, req.version(), req.keep_alive());
  }

  // The responder a handler gets: the first call writes the response on this session's
  // strand, whatever thread it comes from, with the request's id in `X-Request-Id`, and logs
  // the access line; later calls are ignored.
  HttpResponder MakeResponder(std::string label, std::string request_id, std::string tenant, unsigned version,
                              bool keep_alive, std::shared_ptr<std::atomic<bool>> done = nullptr) {
    auto timer = std::make_shared<RequestTimer>(metrics_, label);
    if (done == nullptr) done = std::make_shared<std::atomic<bool>>(false);
    return [self = this->shared_from_this(), timer, done, version, keep_alive, label = std::move(label),
            request_id = std::move(request_id), tenant = std::move(tenant),
            start = absl::Now()](HttpResponse response) {
      if (done->exchange(true)) return;
      if (self->core_->stopped.load()) return;  // the I/O threads are gone; nobody would write it
      std::shared_ptr<ProducerSlot> slot;
      if (response.body_source.has_value()) {
        slot = TakeProducerSlot(self->core_);
        if (slot == nullptr) {
          const int limit = self->core_->limits.max_body_producers;
          response = {503, "application/json",
                      nlohmann::json{{"error", "too many downloads"},
                                     {"detail", absl::StrCat("too many bodies are being sent at once (", limit,
                                                             ", the HTTP server's max_body_producers); retry")}}
                          .dump(),
                      {{"Retry-After", "1"}}};
        }
      }
      const std::string status = absl::StrCat(response.status);
      timer->set_code(status);
      LogRequest(AccessLogLevel(label), "http",
                 {request_id, tenant, label, status, absl::ToDoubleSeconds(absl::Now() - start)});
      response.headers.emplace_back("X-Request-Id", request_id);
      asio::post(self->stream_.get_executor(), [self, response = std::move(response), version, keep_alive,
                                                 slot = std::move(slot), request_id]() mutable {
        self->Write(std::move(response), version, keep_alive, std::move(slot), request_id);
      });
    };
  }

  // The streamer a streaming route's handler gets beside its responder (sharing `done`).
  HttpStreamer MakeStreamer(std::string label, std::string request_id, std::string tenant, unsigned version,
                            std::shared_ptr<std::atomic<bool>> done) {
    return [self = this->shared_from_this(), done, version, label = std::move(label),
            request_id = std::move(request_id), tenant = std::move(tenant),
            start = absl::Now()](HttpResponse head) -> std::shared_ptr<HttpStream> {
      auto state = std::make_shared<StreamState>();
      auto writer = std::make_shared<StreamWriter<Session>>(self, state);
      if (done->exchange(true) || self->core_->stopped.load()) {
        state->gone = true;
        return writer;
      }
      RequestTimer timer(self->metrics_, label);
      timer.set_code(absl::StrCat(head.status));
      LogRequest(AccessLogLevel(label), "http",
                 {request_id, tenant, label, absl::StrCat(head.status), absl::ToDoubleSeconds(absl::Now() - start)});
      head.headers.emplace_back("X-Request-Id", request_id);
      self->Post([self, state, head = std::move(head), version]() mutable {
        self->StartStream(std::move(head), version, std::move(state));
      });
      return writer;
    };
  }

  void StartStream(HttpResponse head, unsigned version, std::shared_ptr<StreamState> state) {
    EndPendingWatch();
    stream_state_ = std::move(state);
    // A stream may run for as long as its generation does; the client's close ends it.
    beast::get_lowest_layer(stream_).expires_never();
    auto res = std::make_shared<http::response<http::empty_body>>(static_cast<http::status>(head.status), version);
    res->set(http::field::server, "twinkle-server");
    res->set(http::field::content_type, head.content_type);
    res->set(http::field::cache_control, "no-cache");
    for (const auto& [name, value] : head.headers) res->set(name, value);
    res->keep_alive(false);
    res->chunked(true);
    auto serializer = std::make_shared<http::response_serializer<http::empty_body>>(*res);
    http::async_write_header(stream_, *serializer,
                             [self = this->shared_from_this(), res, serializer](beast::error_code ec, size_t) {
                               if (ec || self->core_->stopped.load()) return self->StreamGone();
                               self->head_sent_ = true;
                               self->WatchForClose();
                               self->Pump();
                             });
  }

  // A read that ends when the client closes its side (or resets): that is how a client that
  // stops listening is noticed even while nothing is being written.
  void WatchForClose() {
    stream_.async_read_some(asio::buffer(probe_), [self = this->shared_from_this()](beast::error_code ec, size_t) {
      if (ec || self->core_->stopped.load()) return self->StreamGone();
      self->WatchForClose();  // bytes after the request are not read as a request: ignored
    });
  }

  void Pump() {
    if (!head_sent_ || writing_ || stream_state_ == nullptr || stream_state_->gone.load()) return;
    if (!out_.empty()) {
      auto data = std::make_shared<std::string>(std::move(out_.front()));
      out_.pop_front();
      writing_ = true;
      asio::async_write(stream_, http::make_chunk(asio::buffer(*data)),
                        [self = this->shared_from_this(), data](beast::error_code ec, size_t) {
                          self->writing_ = false;
                          self->backlog_ -= data->size();
                          if (ec || self->core_->stopped.load()) return self->StreamGone();
                          self->Pump();
                        });
      return;
    }
    if (ending_ && !last_sent_) {
      last_sent_ = true;
      writing_ = true;
      asio::async_write(stream_, http::make_chunk_last(),
                        [self = this->shared_from_this()](beast::error_code ec, size_t) {
                          self->writing_ = false;
                          if (ec || self->core_->stopped.load()) return self->StreamGone();
                          // The close watcher's read ends when the client closes, or times out.
                          beast::get_lowest_layer(self->stream_).expires_after(kHandshakeTimeout);
                          self->Close();
                        });
    }
  }

  // A streaming route's answer is pending: waits (without reading: a pipelined request stays
  // in the socket) until the connection turns readable; a close, a reset or a shut-down
  // sending side (a peek that finds no byte) means the client is gone. Bytes mean it is still
  // there: the watch ends, the next request waits its turn. (Over TLS a close_notify is
  // bytes too: a client that sends one before closing is not noticed until the answer.)
  void WatchPending(std::shared_ptr<StreamState> watch) {
    pending_watch_ = watch;
    auto& socket = beast::get_lowest_layer(stream_).socket();
    socket.async_wait(tcp::socket::wait_read, [self = this->shared_from_this(), watch](beast::error_code ec) {
      if (self->pending_watch_ != watch || ec == asio::error::operation_aborted) return;
      self->pending_watch_.reset();
      if (self->core_->stopped.load()) return;  // the server's Stop, not the client
      if (!ec) {
        char byte = 0;
        const ssize_t n = ::recv(beast::get_lowest_layer(self->stream_).socket().native_handle(), &byte, 1,
                                 MSG_PEEK | MSG_DONTWAIT);
        if (n > 0) return;  // a request, not a close
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
          return self->WatchPending(watch);  // nothing after all
        }
      }
      watch->Gone();
    });
  }
  // The answer is on its way: the watch's wait is cancelled and its callback never runs.
  void EndPendingWatch() {
    if (pending_watch_ == nullptr) return;
    pending_watch_->ended = true;
    pending_watch_.reset();
    beast::error_code ignored;
    beast::get_lowest_layer(stream_).socket().cancel(ignored);
  }

  void StreamGone() {
    if (stream_state_ == nullptr || stream_state_->gone.exchange(true)) return;
    std::function<void()> callback;
    {
      std::lock_guard lock(stream_state_->mu);
      callback.swap(stream_state_->on_gone);
    }
    out_.clear();
    beast::error_code ignored;
    beast::get_lowest_layer(stream_).socket().close(ignored);
    if (callback && !stream_state_->ended.load()) callback();
  }

  // The head every answer shares: server, content type, the route's headers, keep-alive.
  template <typename Body>
  static void SetHead(http::response<Body>& res, const HttpResponse& response, bool keep_alive) {
    res.set(http::field::server, "twinkle-server");
    res.set(http::field::content_type, response.content_type);
    for (const auto& [name, value] : response.headers) res.set(name, value);
    res.keep_alive(keep_alive);
  }

  void Write(HttpResponse response, unsigned version, bool keep_alive, std::shared_ptr<ProducerSlot> slot = nullptr,
             const std::string& request_id = std::string()) {
    EndPendingWatch();
    if (response.body_source.has_value()) {
      return StartBody(std::move(response), version, keep_alive, std::move(slot), request_id);
    }
    auto res = std::make_shared<http::response<http::string_body>>(static_cast<http::status>(response.status),
                                                                   version);
    SetHead(*res, response, keep_alive);
    res->body() = std::move(response.body);
    res->prepare_payload();  // always an explicit Content-Length (the tinker SDK needs it on 4xx)
    http::async_write(stream_, *res,
                      [self = this->shared_from_this(), res](beast::error_code ec, size_t) {
                        if (ec || self->core_->stopped.load()) return;
                        if (!res->keep_alive()) return self->Close();
                        self->Read();
                      });
  }

  // ---- produced bodies (HttpBodySource), on this session's strand but for the producer ----

  // Sends the head (with the source's size as Content-Length) and hands `produce` to the
  // producer pool; its chunks come back through QueueBodyChunk, its end through EndBody.
  void StartBody(HttpResponse response, unsigned version, bool keep_alive, std::shared_ptr<ProducerSlot> slot,
                 const std::string& request_id) {
    if (core_->stopped.load() || core_->producers == nullptr || slot == nullptr) return;
    HttpBodySource source = *std::move(response.body_source);
    auto res = std::make_shared<http::response<http::empty_body>>(static_cast<http::status>(response.status),
                                                                  version);
    SetHead(*res, response, keep_alive);
    res->content_length(static_cast<uint64_t>(std::max<int64_t>(source.size, 0)));
    auto pipe = std::make_shared<BodyPipe>();
    body_pipe_ = pipe;
    body_keep_alive_ = keep_alive;
    body_head_sent_ = body_producer_done_ = body_writing_ = false;
    body_out_.clear();
    body_last_.reset();
    {
      std::lock_guard lock(core_->mu);
      core_->body_pipes[id_] = pipe;
    }
    auto serializer = std::make_shared<http::response_serializer<http::empty_body>>(*res);
    body_writing_ = true;
    beast::get_lowest_layer(stream_).expires_after(std::chrono::seconds(core_->limits.idle_timeout_s));
    http::async_write_header(stream_, *serializer,
                             [self = this->shared_from_this(), res, serializer, pipe](beast::error_code ec, size_t) {
                               if (pipe != self->body_pipe_) return;  // already gone
                               self->body_writing_ = false;
                               if (ec || self->core_->stopped.load()) return self->BodyGone();
                               self->body_head_sent_ = true;
                               self->PumpBody();
                             });
    asio::post(*core_->producers, [self = this->shared_from_this(), pipe, source = std::move(source),
                                   slot = std::move(slot), request_id]() {
      int64_t sent = 0;
      const HttpBodySink sink = [&](absl::string_view chunk) -> absl::Status {
        if (chunk.empty()) return absl::OkStatus();
        if (static_cast<int64_t>(chunk.size()) > source.size - sent) {
          return absl::InternalError(
              absl::StrCat("the body is longer than its announced ", source.size, " bytes"));
        }
        if (!pipe->Reserve()) return absl::CancelledError("the client went away (or the server is stopping)");
        sent += static_cast<int64_t>(chunk.size());
        self->Post([self, pipe, data = std::string(chunk), last = sent == source.size]() mutable {
          self->QueueBodyChunk(pipe, std::move(data), last);
        });
        return absl::OkStatus();
      };
      absl::Status status = !source.produce ? absl::InternalError("the body has no producer") : source.produce(sink);
      if (status.ok() && sent != source.size) {
        status = absl::InternalError(absl::StrCat("the body ended after ", sent, " of its ", source.size, " bytes"));
      }
      self->Post([self, pipe, status = std::move(status), request_id, sent, size = source.size] {
        self->EndBody(pipe, status, request_id, sent, size);
      });
    });
  }

  // A chunk from the producer; the one that completes the body is held back until the
  // producer has returned OK (a check at its very end may still fail).
  void QueueBodyChunk(const std::shared_ptr<BodyPipe>& pipe, std::string data, bool last) {
    if (pipe != body_pipe_) return;  // gone: the producer has been told
    if (last) {
      body_last_ = std::move(data);
    } else {
      body_out_.push_back(std::move(data));
    }
    PumpBody();
  }

  void EndBody(const std::shared_ptr<BodyPipe>& pipe, const absl::Status& status, const std::string& request_id,
               int64_t sent, int64_t size) {
    if (pipe != body_pipe_) return;
    if (!status.ok()) {
      if (!absl::IsCancelled(status)) {
        LogWarning("http", absl::StrCat("request ", request_id, ": the body failed after ", sent, " of ", size,
                                        " bytes, connection aborted: ", status.ToString()));
      }
      return BodyGone();
    }
    body_producer_done_ = true;
    PumpBody();
  }

  void PumpBody() {
    if (body_pipe_ == nullptr || body_writing_ || !body_head_sent_) return;
    std::shared_ptr<std::string> data;
    if (!body_out_.empty()) {
      data = std::make_shared<std::string>(std::move(body_out_.front()));
      body_out_.pop_front();
    } else if (body_producer_done_ && body_last_.has_value()) {
      data = std::make_shared<std::string>(*std::move(body_last_));
      body_last_.reset();
    } else if (body_producer_done_) {
      return FinishBody();
    } else {
      return;  // waiting for the producer
    }
    body_writing_ = true;
    // A chunk the client does not take within the idle timeout drops it: a client that stops
    // reading holds its producer (and at most a couple of chunks) no longer than that.
    beast::get_lowest_layer(stream_).expires_after(std::chrono::seconds(core_->limits.idle_timeout_s));
    asio::async_write(stream_, asio::buffer(*data),
                      [self = this->shared_from_this(), data, pipe = body_pipe_](beast::error_code ec, size_t) {
                        if (pipe != self->body_pipe_) return;
                        self->body_writing_ = false;
                        if (ec || self->core_->stopped.load()) return self->BodyGone();
                        pipe->Written();
                        self->PumpBody();
                      });
  }

  // The whole body is out: the connection goes on (keep-alive) or closes.
  void FinishBody() {
    ReleaseBody();
    if (core_->stopped.load()) return;
    if (body_keep_alive_) return Read();
    Close();
  }

  // The client is gone, a write failed or timed out, or the producer failed: the producer is
  // stopped and the connection closed at once, its body incomplete (short of its
  // Content-Length), so no client takes it for whole.
  void BodyGone() {
    if (body_pipe_ == nullptr) return;
    body_pipe_->Cancel();
    ReleaseBody();
    beast::error_code ignored;
    beast::get_lowest_layer(stream_).socket().close(ignored);
  }

  void ReleaseBody() {
    body_pipe_.reset();
    body_out_.clear();
    body_last_.reset();
    body_writing_ = false;
    std::lock_guard lock(core_->mu);
    core_->body_pipes.erase(id_);
  }

  // Runs `handler` on the handler pool (inline routes: here, on the I/O thread).
  void Run(const AsyncHttpHandler& handler, HttpRequest request, HttpResponder respond, bool on_io_thread) {
    if (on_io_thread || core_->handlers == nullptr) return handler(request, std::move(respond));
    asio::post(*core_->handlers, [&handler, request = std::move(request), respond = std::move(respond)]() mutable {
      handler(request, std::move(respond));
    });
  }

  void Dispatch(HttpRequest& request, unsigned version, bool keep_alive) {
    const std::pair<std::string, std::string> key{request.method, request.path};
    std::string request_id = RequestIdOf(request);
    std::string tenant = routes_.tenant_of ? routes_.tenant_of(request) : std::string();
    if (auto st = routes_.streaming.find(key); st != routes_.streaming.end()) {
      auto watch = std::make_shared<StreamState>();
      request.on_client_gone = [watch](std::function<void()> callback) { watch->Register(std::move(callback)); };
      WatchPending(watch);
      auto done = std::make_shared<std::atomic<bool>>(false);
      const std::string label = absl::StrCat(request.method, " ", request.path);
      HttpResponder respond = MakeResponder(label, request_id, tenant, version, keep_alive, done);
      HttpStreamer streamer = MakeStreamer(label, std::move(request_id), std::move(tenant), version, done);
      if (core_->handlers == nullptr) return st->second(request, std::move(respond), std::move(streamer));
      asio::post(*core_->handlers, [&handler = st->second, request = std::move(request), respond = std::move(respond),
                                    streamer = std::move(streamer)]() mutable {
        handler(request, std::move(respond), std::move(streamer));
      });
      return;
    }
    auto it = routes_.exact.find(key);
    if (it != routes_.exact.end()) {
      HttpResponder respond = MakeResponder(absl::StrCat(request.method, " ", request.path), std::move(request_id),
                                            std::move(tenant), version, keep_alive);
      Run(it->second, std::move(request), std::move(respond), routes_.inline_exact.contains(key));
      return;
    }
    bool path_known = false;
    for (const auto& [key, handler] : routes_.exact) path_known |= key.second == request.path;
    for (const auto& [key, handler] : routes_.streaming) path_known |= key.second == request.path;
    for (const Routes::Prefix& p : routes_.prefixes) {
      if (request.path.size() <= p.prefix.size() || request.path.compare(0, p.prefix.size(), p.prefix) != 0) continue;
      if (p.method != request.method) {
        path_known = true;
        continue;
      }
      request.path_tail = UrlDecode(absl::string_view(request.path).substr(p.prefix.size()), false);
      HttpResponder respond = MakeResponder(absl::StrCat(request.method, " ", p.prefix, "*"), std::move(request_id),
                                            std::move(tenant), version, keep_alive);
      Run(p.handler, std::move(request), std::move(respond), /*on_io_thread=*/false);
      return;
    }
    const int status = path_known ? 405 : 404;
    const nlohmann::json body = {{"error", path_known ? "method not allowed" : "not found"},
                                 {"detail", path_known ? "method not allowed" : "not found"},
                                 {"path", request.path.substr(0, 200)}};
    MakeResponder("HTTP other", std::move(request_id), std::move(tenant), version, keep_alive)(
        {status, "application/json", body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)});
  }

  std::shared_ptr<IoCore> core_;  // first: destroyed after stream_, whose socket it serves
  uint64_t id_ = 0;                // its entry in core_->closers
  bool refuse_ = false;
  Stream stream_;
  beast::flat_buffer buffer_;
  // A streamed response (strand only): its shared state, the chunks not yet written.
  std::shared_ptr<StreamState> stream_state_;
  std::shared_ptr<StreamState> pending_watch_;  // a streaming route's answer is pending (WatchPending)
  std::deque<std::string> out_;
  size_t backlog_ = 0;  // bytes queued or being written
  bool head_sent_ = false, writing_ = false, ending_ = false, last_sent_ = false;
  std::array<char, 256> probe_{};
  // A produced body (strand only): its pipe (null when none), the chunks not yet written, the
  // last chunk held until the producer has returned OK.
  std::shared_ptr<BodyPipe> body_pipe_;
  std::deque<std::string> body_out_;
  std::optional<std::string> body_last_;
  bool body_keep_alive_ = false, body_head_sent_ = false, body_producer_done_ = false, body_writing_ = false;
  std::optional<http::request_parser<http::string_body>> parser_;
  const Routes& routes_;
  Metrics& metrics_;
};

// The server's TLS context: TLS 1.2+, the certificate chain and key, and with a client CA,
// verification of client certificates (a client without one is refused at the handshake).
absl::StatusOr<std::unique_ptr<ssl::context>> MakeTlsContext(const HttpTlsOptions& options) {
  auto ctx = std::make_unique<ssl::context>(ssl::context::tls_server);
  beast::error_code ec;
  ctx->set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 |
                       ssl::context::no_sslv3 | ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1 |
                       ssl::context::single_dh_use,
                   ec);
  if (ec) return absl::InternalError(absl::StrCat("TLS setup failed: ", ec.message()));
  ctx->use_certificate_chain_file(options.cert_file, ec);
  if (ec) {
    return absl::InvalidArgumentError(absl::StrCat("server.tls.cert_file: cannot load certificate ",
                                                   options.cert_file, ": ", ec.message()));
  }
  ctx->use_private_key_file(options.key_file, ssl::context::pem, ec);
  if (ec) {
    return absl::InvalidArgumentError(absl::StrCat("server.tls.key_file: cannot load private key ",
                                                   options.key_file, ": ", ec.message()));
  }
  if (!options.client_ca_file.empty()) {
    ctx->load_verify_file(options.client_ca_file, ec);
    if (ec) {
      return absl::InvalidArgumentError(absl::StrCat("server.tls.client_ca_file: cannot load ",
                                                     options.client_ca_file, ": ", ec.message()));
    }
    ctx->set_verify_mode(ssl::verify_peer | ssl::verify_fail_if_no_peer_cert, ec);
    if (ec) return absl::InternalError(absl::StrCat("TLS setup failed: ", ec.message()));
  }
  return ctx;
}

}  // namespace

struct HttpServer::Impl {
  Impl(Metrics& m, HttpTlsOptions t) : metrics(m), tls_options(std::move(t)) {}

  void Accept() {
    acceptor->async_accept(asio::make_strand(core->io), [this](beast::error_code ec, tcp::socket socket) {
      if (ec) {
        if (ec == asio::error::operation_aborted || !acceptor->is_open()) return;
        // EMFILE / ENFILE / ENOBUFS: retrying at once would spin on the same error; wait a
        // little for connections to close. Logged once per streak.
        if (!accept_failing) LogWarning("http", absl::StrCat("accept failed: ", ec.message(), "; backing off"));
        accept_failing = true;
        accept_backoff.expires_after(std::chrono::milliseconds(100));
        accept_backoff.async_wait([this](beast::error_code wait_ec) {
          if (!wait_ec) Accept();
        });
        return;
      }
      accept_failing = false;
      const bool over_limit = core->connections.load() >= core->limits.max_connections;
      if (tls) {
        auto session = std::make_shared<Session<true>>(core, std::move(socket), tls.get(), routes, metrics);
        over_limit ? session->RunRefusing() : session->Run();
      } else {
        auto session = std::make_shared<Session<false>>(core, std::move(socket), nullptr, routes, metrics);
        over_limit ? session->RunRefusing() : session->Run();
      }
      Accept();
    });
  }

  Metrics& metrics;
  const HttpTlsOptions tls_options;
  std::unique_ptr<ssl::context> tls;  // set when TLS is on; outlives every session (io first)
  Routes routes;
  std::shared_ptr<IoCore> core = std::make_shared<IoCore>();
  std::optional<tcp::acceptor> acceptor;
  asio::steady_timer accept_backoff{core->io};
  std::optional<asio::thread_pool> handlers;
  std::optional<asio::thread_pool> producers;
  bool accept_failing = false;  // only touched by the accept handler chain
  std::vector<std::thread> threads;
};

HttpServer::HttpServer(Metrics& metrics, HttpTlsOptions tls)
    : impl_(std::make_unique<Impl>(metrics, std::move(tls))) {}
HttpServer::~HttpServer() { Stop(); }

void HttpServer::Route(const std::string& method, const std::string& path, HttpHandler handler) {
  RouteAsync(method, path, [handler = std::move(handler)](const HttpRequest& request, HttpResponder respond) {
    respond(handler(request));
  });
}

void HttpServer::RouteAsync(const std::string& method, const std::string& path, AsyncHttpHandler handler) {
  impl_->routes.exact[{method, path}] = std::move(handler);
}

void HttpServer::RouteStreaming(const std::string& method, const std::string& path, StreamingHttpHandler handler) {
  impl_->routes.streaming[{method, path}] = std::move(handler);
}

void HttpServer::RouteInline(const std::string& method, const std::string& path, HttpHandler handler) {
  Route(method, path, std::move(handler));
  impl_->routes.inline_exact.insert({method, path});
}

void HttpServer::RoutePrefix(const std::string& method, const std::string& prefix, AsyncHttpHandler handler) {
  auto& v = impl_->routes.prefixes;
  v.push_back({method, prefix, std::move(handler)});
  std::stable_sort(v.begin(), v.end(), [](const Routes::Prefix& a, const Routes::Prefix& b) {
    return a.prefix.size() > b.prefix.size();
  });
}

void HttpServer::SetLimits(HttpServerLimits limits) { impl_->core->limits = limits; }

void HttpServer::SetLogTenant(std::function<std::string(const HttpRequest&)> tenant_of) {
  impl_->routes.tenant_of = std::move(tenant_of);
}

void HttpServer::AddHeaderCheck(HttpHeaderCheck check) {
  impl_->routes.header_checks.push_back(std::move(check));
}

absl::StatusOr<int> HttpServer::Start(const std::string& host, int port, int threads) {
  if (impl_->tls_options.enabled()) {
    absl::StatusOr<std::unique_ptr<ssl::context>> ctx = MakeTlsContext(impl_->tls_options);
    if (!ctx.ok()) return ctx.status();
    impl_->tls = std::move(*ctx);
  }
  beast::error_code ec;
  const std::string bind_host = host == "localhost" ? "127.0.0.1" : host;
  const asio::ip::address address = asio::ip::make_address(bind_host, ec);
  if (ec) return absl::InvalidArgumentError(absl::StrCat("bad HTTP host '", host, "': ", ec.message()));
  const tcp::endpoint endpoint(address, static_cast<uint16_t>(port));
  impl_->acceptor.emplace(impl_->core->io);
  impl_->acceptor->open(endpoint.protocol(), ec);
  if (!ec) impl_->acceptor->set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) impl_->acceptor->bind(endpoint, ec);
  if (!ec) impl_->acceptor->listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return absl::UnavailableError(absl::StrCat("cannot listen for HTTP on ", bind_host, ":", port,
                                               ": ", ec.message()));
  }
  const int bound = impl_->acceptor->local_endpoint().port();
  impl_->handlers.emplace(kHandlerThreads);
  impl_->core->handlers = &*impl_->handlers;
  impl_->producers.emplace(static_cast<size_t>(std::max(impl_->core->limits.max_body_producers, 1)));
  impl_->core->producers = &*impl_->producers;
  impl_->Accept();
  for (int i = 0; i < threads; ++i) impl_->threads.emplace_back([core = impl_->core] { core->io.run(); });
  return bound;
}

void HttpServer::Stop() {
  if (!impl_ || impl_->threads.empty()) return;
  impl_->core->stopped = true;
  asio::post(impl_->core->io, [this] {
    beast::error_code ignored;
    impl_->acceptor->close(ignored);
  });
  impl_->core->io.stop();
  for (std::thread& t : impl_->threads) t.join();
  impl_->threads.clear();
  // Producers of bodies in flight: every pipe is cancelled, so a producer waiting for room
  // (or handing its next chunk) stops at once, one in a disk read after it; then they are
  // joined. No new one starts: StartBody runs on the I/O threads, which are gone, and checks
  // `stopped` in the drain below.
  {
    std::lock_guard lock(impl_->core->mu);
    for (auto& [id, weak] : impl_->core->body_pipes) {
      if (std::shared_ptr<BodyPipe> pipe = weak.lock()) pipe->Cancel();
    }
  }
  impl_->producers->join();
  impl_->core->producers = nullptr;
  // Handlers still running finish (their responses are dropped: the I/O threads are gone).
  impl_->handlers->join();
  impl_->core->handlers = nullptr;
  impl_->acceptor.reset();  // its socket belongs to the io_context too
  impl_->accept_backoff.cancel();
  // Drain: close every session's socket and run what is queued until nothing is, so each
  // pending read or write completes (with an error) and drops its hold on its session. A
  // handler left in the stopped queue would keep its session, and with it the io_context
  // the session holds, alive for ever (LeakSanitizer saw that cycle).
  {
    std::lock_guard lock(impl_->core->mu);
    for (auto& [id, close] : impl_->core->closers) close();
  }
  impl_->core->io.restart();
  impl_->core->io.run();
}

}  // namespace twinkle
