// HttpResponse::body_source over real loopback sockets: a body produced in chunks by a
// producer thread (never an I/O thread), sent with its Content-Length, with flow control (a
// client that stops reading stops the producer, the server holds a couple of chunks), aborted
// short of its length when the producer fails (also at its very end), stopped when the client
// goes away or the server stops, and bounded by max_body_producers (limit + 1 is 503).

#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "server/http/http_server.h"
#include "server/metrics.h"
#include "tests/unit/server/raw_http_client.h"

namespace twinkle {
namespace {

constexpr size_t kChunk = size_t{1} << 20;

using RawClient = ::twinkle::testing::RawHttpClient;

int64_t ContentLength(const std::string& head) {
  const size_t at = head.find("Content-Length: ");
  if (at == std::string::npos) return -1;
  int64_t n = -1;
  const size_t end = head.find("\r\n", at);
  EXPECT_TRUE(absl::SimpleAtoi(head.substr(at + 16, end - at - 16), &n)) << head;
  return n;
}

// Byte i of a produced body: position-dependent, so a lost, repeated or reordered chunk shows.
char ByteAt(int64_t i) { return static_cast<char>('a' + (i * 7 + i / 4093) % 26); }
std::string Expected(int64_t from, int64_t n) {
  std::string s(static_cast<size_t>(n), '\0');
  for (int64_t i = 0; i < n; ++i) s[static_cast<size_t>(i)] = ByteAt(from + i);
  return s;
}

// What one producer did: the chunks its sink accepted, how it ended, on which thread.
struct Producer {
  std::atomic<int> accepted{0};
  std::promise<absl::Status> ended;
  std::thread::id thread;
};

// A body of `size` bytes in `chunk`-byte pieces; `fail_after` (>= 0): the producer returns
// DataLoss after handing that many bytes (all of them: a check at its end fails).
HttpBodySource Source(Producer& p, int64_t size, size_t chunk = kChunk, int64_t fail_after = -1,
                      int64_t produce = -1) {
  return {size, [&p, size, chunk, fail_after, produce](const HttpBodySink& sink) {
            p.thread = std::this_thread::get_id();
            const int64_t total = produce >= 0 ? produce : size;
            absl::Status status;
            for (int64_t at = 0; at < total && status.ok(); at += static_cast<int64_t>(chunk)) {
              if (fail_after >= 0 && at >= fail_after) break;
              status = sink(Expected(at, std::min<int64_t>(static_cast<int64_t>(chunk), total - at)));
              if (status.ok()) ++p.accepted;
            }
            if (status.ok() && fail_after >= 0) status = absl::DataLossError("checksum differs");
            p.ended.set_value(status);
            return status;
          }};
}

TEST(HttpBody, ProducedOffTheIoThreadsWithItsContentLengthAndKeepAliveGoesOn) {
  Metrics metrics;
  HttpServer http(metrics);
  Producer p;
  constexpr int64_t kSize = 5 * kChunk + 12345;
  std::thread::id io_thread;
  http.RouteInline("GET", "/probe", [&io_thread](const HttpRequest&) {
    io_thread = std::this_thread::get_id();
    return HttpResponse{200, "text/plain", "ok"};
  });
  http.Route("GET", "/file", [&p](const HttpRequest&) {
    HttpResponse r{200, "application/octet-stream", "", {{"X-Checksum-SHA256", "abc"}}};
    r.body_source = Source(p, kSize);
    return r;
  });
  absl::StatusOr<int> port = http.Start("127.0.0.1", 0, 1);  // one I/O thread
  ASSERT_TRUE(port.ok()) << port.status();
  RawClient client(*port);
  client.Get("/probe");
  EXPECT_NE(client.ReadHead().find("200"), std::string::npos);
  EXPECT_EQ(client.ReadBody(2), "ok");
  client.Get("/file");
  const std::string head = client.ReadHead();
  EXPECT_NE(head.find("HTTP/1.1 200"), std::string::npos) << head;
  EXPECT_NE(head.find("X-Checksum-SHA256: abc"), std::string::npos) << head;
  EXPECT_EQ(head.find("chunked"), std::string::npos) << head;
  EXPECT_EQ(ContentLength(head), kSize) << head;
  EXPECT_TRUE(client.ReadBody(kSize) == Expected(0, kSize));
  EXPECT_TRUE(p.ended.get_future().get().ok());
  EXPECT_NE(p.thread, io_thread);
  // The same connection serves the next request.
  client.Get("/probe");
  EXPECT_NE(client.ReadHead().find("200"), std::string::npos);
  EXPECT_EQ(client.ReadBody(2), "ok");
  http.Stop();
}

TEST(HttpBody, AnEmptyBodyAndOddChunkSizesArriveWhole) {
  Metrics metrics;
  HttpServer http(metrics);
  Producer empty, odd;
  http.Route("GET", "/empty", [&empty](const HttpRequest&) {
    HttpResponse r{200, "application/octet-stream", ""};
    r.body_source = Source(empty, 0);
    return r;
  });
  http.Route("GET", "/odd", [&odd](const HttpRequest&) {
    HttpResponse r{200, "application/octet-stream", ""};
    r.body_source = Source(odd, 100003, 777);
    return r;
  });
  absl::StatusOr<int> port = http.Start("127.0.0.1", 0, 2);
  ASSERT_TRUE(port.ok()) << port.status();
  RawClient client(*port);
  client.Get("/empty");
  EXPECT_EQ(ContentLength(client.ReadHead()), 0);
  client.Get("/odd");
  EXPECT_EQ(ContentLength(client.ReadHead()), 100003);
  EXPECT_TRUE(client.ReadBody(100003) == Expected(0, 100003));
  EXPECT_TRUE(empty.ended.get_future().get().ok());
  EXPECT_TRUE(odd.ended.get_future().get().ok());
  http.Stop();
}

// A client that stops reading stops the producer: the server holds at most a couple of
// chunks (plus what the kernel's socket buffers take), never the body; once the client reads
// again the rest comes, whole and in order.
TEST(HttpBody, AClientThatStopsReadingHoldsTheProducerNotTheBody) {
  Metrics metrics;
  HttpServer http(metrics);
  Producer p;
  constexpr int64_t kSize = 256 * kChunk;
  http.Route("GET", "/file", [&p](const HttpRequest&) {
    HttpResponse r{200, "application/octet-stream", ""};
    r.body_source = Source(p, kSize);
    return r;
  });
  absl::StatusOr<int> port = http.Start("127.0.0.1", 0, 2);
  ASSERT_TRUE(port.ok()) << port.status();
  RawClient client(*port, /*receive_buffer=*/64 << 10);
  client.Get("/file");
  EXPECT_EQ(ContentLength(client.ReadHead()), kSize);
  std::future<absl::Status> ended = p.ended.get_future();
  // Without flow control the producer would be done in milliseconds; with it, it waits.
  EXPECT_EQ(ended.wait_for(std::chrono::seconds(2)), std::future_status::timeout);
  const int accepted = p.accepted.load();
  // The queued chunks plus the socket buffers (loopback's send buffer grows to a few MiB).
  EXPECT_LT(accepted, 32) << "chunks taken while the client read nothing";
  std::printf("a client reading nothing: the producer stopped after %d of 256 chunks\n", accepted);
  EXPECT_TRUE(client.ReadBody(kSize) == Expected(0, kSize));
  EXPECT_TRUE(ended.get().ok());
  http.Stop();
}

TEST(HttpBody, AProducerThatFailsMidWayAbortsTheConnectionShortOfItsLength) {
  Metrics metrics;
  HttpServer http(metrics);
  Producer p;
  constexpr int64_t kSize = 8 * kChunk;
  http.Route("GET", "/file", [&p](const HttpRequest&) {
    HttpResponse r{200, "application/octet-stream", ""};
    r.body_source = Source(p, kSize, kChunk, /*fail_after=*/3 * kChunk);
    return r;
  });
  absl::StatusOr<int> port = http.Start("127.0.0.1", 0, 2);
  ASSERT_TRUE(port.ok()) << port.status();
  RawClient client(*port);
  client.Get("/file");
  EXPECT_EQ(ContentLength(client.ReadHead()), kSize);
  const std::string got = client.ReadBody(kSize);
  EXPECT_LE(got.size(), 3 * kChunk);
  EXPECT_TRUE(got == Expected(0, static_cast<int64_t>(got.size())));
  EXPECT_TRUE(client.ServerClosed());
  EXPECT_TRUE(absl::IsDataLoss(p.ended.get_future().get()));
  http.Stop();
}

// A check at the very end (a checksum over every byte) fails after the producer has handed
// every byte: the last chunk is held back, so the client never gets a complete-looking body.
TEST(HttpBody, AFailureAfterTheLastByteStillLeavesTheBodyShort) {
  Metrics metrics;
  HttpServer http(metrics);
  Producer p;
  constexpr int64_t kSize = 4 * kChunk + 100;
  http.Route("GET", "/file", [&p](const HttpRequest&) {
    HttpResponse r{200, "application/octet-stream", ""};
    r.body_source = Source(p, kSize, kChunk, /*fail_after=*/kSize);
    return r;
  });
  absl::StatusOr<int> port = http.Start("127.0.0.1", 0, 2);
  ASSERT_TRUE(port.ok()) << port.status();
  RawClient client(*port);
  client.Get("/file");
  EXPECT_EQ(ContentLength(client.ReadHead()), kSize);
  const std::string got = client.ReadBody(kSize);
  EXPECT_LT(static_cast<int64_t>(got.size()), kSize);
  EXPECT_TRUE(client.ServerClosed());
  EXPECT_TRUE(absl::IsDataLoss(p.ended.get_future().get()));
  http.Stop();
}

// A producer that ends short of its size, or hands more than its size: aborted the same way.
TEST(HttpBody, AProducerWithTheWrongLengthIsAborted) {
  Metrics metrics;
  HttpServer http(metrics);
  Producer shorter, longer;
  constexpr int64_t kSize = 2 * kChunk;
  http.Route("GET", "/short", [&shorter](const HttpRequest&) {
    HttpResponse r{200, "application/octet-stream", ""};
    r.body_source = Source(shorter, kSize, kChunk, -1, /*produce=*/kSize - 1);
    return r;
  });
  http.Route("GET", "/long", [&longer](const HttpRequest&) {
    HttpResponse r{200, "application/octet-stream", ""};
    r.body_source = Source(longer, kSize, kChunk, -1, /*produce=*/kSize + 1);
    return r;
  });
  absl::StatusOr<int> port = http.Start("127.0.0.1", 0, 2);
  ASSERT_TRUE(port.ok()) << port.status();
  for (const char* path : {"/short", "/long"}) {
    RawClient client(*port);
    client.Get(path);
    EXPECT_EQ(ContentLength(client.ReadHead()), kSize) << path;
    EXPECT_LT(static_cast<int64_t>(client.ReadBody(kSize).size()), kSize) << path;
    EXPECT_TRUE(client.ServerClosed()) << path;
  }
  EXPECT_TRUE(shorter.ended.get_future().get().ok());  // its sink took all it gave: the server aborts
  EXPECT_TRUE(absl::IsInternal(longer.ended.get_future().get()));  // its sink refused the extra byte
  http.Stop();
}

// A client that goes away half way stops the producer (its sink refuses the next chunk) and
// leaves the server serving.
TEST(HttpBody, AClientThatDisconnectsHalfWayStopsTheProducer) {
  Metrics metrics;
  HttpServer http(metrics);
  Producer p;
  constexpr int64_t kSize = 256 * kChunk;
  http.Route("GET", "/file", [&p](const HttpRequest&) {
    HttpResponse r{200, "application/octet-stream", ""};
    r.body_source = Source(p, kSize);
    return r;
  });
  http.Route("GET", "/probe", [](const HttpRequest&) { return HttpResponse{200, "text/plain", "ok"}; });
  absl::StatusOr<int> port = http.Start("127.0.0.1", 0, 2);
  ASSERT_TRUE(port.ok()) << port.status();
  {
    RawClient client(*port);
    client.Get("/file");
    client.ReadHead();
    EXPECT_EQ(client.ReadBody(4 * kChunk).size(), 4 * kChunk);
  }  // closed with the rest unread
  std::future<absl::Status> ended = p.ended.get_future();
  ASSERT_EQ(ended.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  EXPECT_TRUE(absl::IsCancelled(ended.get()));
  EXPECT_LT(p.accepted.load(), 256);
  RawClient next(*port);
  next.Get("/probe");
  EXPECT_NE(next.ReadHead().find("200"), std::string::npos);
  http.Stop();
}

// A client that stops reading is dropped once a chunk waits longer than the idle timeout.
TEST(HttpBody, AClientThatStopsReadingIsDroppedAfterTheIdleTimeout) {
  Metrics metrics;
  HttpServer http(metrics);
  HttpServerLimits limits;
  limits.idle_timeout_s = 1;
  http.SetLimits(limits);
  Producer p;
  http.Route("GET", "/file", [&p](const HttpRequest&) {
    HttpResponse r{200, "application/octet-stream", ""};
    r.body_source = Source(p, 256 * kChunk);
    return r;
  });
  absl::StatusOr<int> port = http.Start("127.0.0.1", 0, 2);
  ASSERT_TRUE(port.ok()) << port.status();
  RawClient client(*port, 64 << 10);
  client.Get("/file");  // and reads nothing
  std::future<absl::Status> ended = p.ended.get_future();
  ASSERT_EQ(ended.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  EXPECT_TRUE(absl::IsCancelled(ended.get()));
  http.Stop();
}

// Stop with bodies in flight (one producer waiting for room, one waiting on its "disk")
// returns; both producers are told to stop.
TEST(HttpBody, StopWithBodiesInFlightStopsTheirProducers) {
  Metrics metrics;
  auto http = std::make_unique<HttpServer>(metrics);
  Producer waiting;
  std::promise<void> slow_started;
  std::promise<absl::Status> slow_ended;
  std::atomic<bool> release{false};
  http->Route("GET", "/file", [&waiting](const HttpRequest&) {
    HttpResponse r{200, "application/octet-stream", ""};
    r.body_source = Source(waiting, 256 * kChunk);
    return r;
  });
  http->Route("GET", "/slow", [&](const HttpRequest&) {
    HttpResponse r{200, "application/octet-stream", ""};
    r.body_source = HttpBodySource{2 * kChunk, [&](const HttpBodySink& sink) {
                                     absl::Status s = sink(std::string(kChunk, 'x'));
                                     slow_started.set_value();
                                     while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
                                     if (s.ok()) s = sink(std::string(kChunk, 'y'));
                                     slow_ended.set_value(s);
                                     return s;
                                   }};
    return r;
  });
  absl::StatusOr<int> port = http->Start("127.0.0.1", 0, 2);
  ASSERT_TRUE(port.ok()) << port.status();
  RawClient a(*port, 64 << 10), b(*port);
  a.Get("/file");
  b.Get("/slow");
  EXPECT_EQ(ContentLength(a.ReadHead()), 256 * kChunk);
  slow_started.get_future().wait();
  std::thread releaser([&release] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    release = true;  // the "disk read" ends while Stop waits for the producers
  });
  http->Stop();
  releaser.join();
  EXPECT_TRUE(absl::IsCancelled(waiting.ended.get_future().get()));
  EXPECT_TRUE(absl::IsCancelled(slow_ended.get_future().get()));
  http.reset();
  EXPECT_TRUE(a.ServerClosed());
}

// max_body_producers: at the limit a body is sent; limit + 1 is 503 with Retry-After; once
// one ends the next is sent again.
TEST(HttpBody, BodiesPastMaxBodyProducersAre503) {
  Metrics metrics;
  HttpServer http(metrics);
  HttpServerLimits limits;
  limits.max_body_producers = 2;
  http.SetLimits(limits);
  std::mutex mu;
  std::vector<std::unique_ptr<Producer>> producers;
  http.Route("GET", "/file", [&](const HttpRequest&) {
    std::lock_guard lock(mu);
    producers.push_back(std::make_unique<Producer>());
    HttpResponse r{200, "application/octet-stream", ""};
    r.body_source = Source(*producers.back(), 256 * kChunk);
    return r;
  });
  absl::StatusOr<int> port = http.Start("127.0.0.1", 0, 2);
  ASSERT_TRUE(port.ok()) << port.status();
  RawClient a(*port, 64 << 10), b(*port, 64 << 10);
  a.Get("/file");
  EXPECT_EQ(ContentLength(a.ReadHead()), 256 * kChunk);
  b.Get("/file");
  EXPECT_EQ(ContentLength(b.ReadHead()), 256 * kChunk);
  {
    RawClient c(*port);
    c.Get("/file");
    const std::string head = c.ReadHead();
    EXPECT_NE(head.find("HTTP/1.1 503"), std::string::npos) << head;
    EXPECT_NE(head.find("Retry-After: 1"), std::string::npos) << head;
    EXPECT_NE(c.ReadBody(static_cast<size_t>(ContentLength(head))).find("max_body_producers"), std::string::npos);
  }
  EXPECT_TRUE(a.ReadBody(256 * kChunk) == Expected(0, 256 * kChunk));
  a.Close();
  {
    std::lock_guard lock(mu);
    EXPECT_TRUE(producers[0]->ended.get_future().get().ok());
  }
  // The slot is released after the producer returned; the next one may race it by a moment.
  std::string head;
  for (int i = 0; i < 200; ++i) {
    RawClient d(*port);
    d.Get("/file");
    head = d.ReadHead();
    if (head.find("HTTP/1.1 200") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_NE(head.find("HTTP/1.1 200"), std::string::npos) << head;
  b.Close();
  http.Stop();
}

}  // namespace
}  // namespace twinkle
