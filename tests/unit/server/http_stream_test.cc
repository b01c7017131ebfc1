// HttpServer::RouteStreaming over real loopback sockets: chunks written from another thread
// arrive in order with chunked transfer encoding and the connection closes after End; a
// client that closes mid-stream is reported through OnClientGone and later writes fail; a
// streaming route may still answer whole.

#include <atomic>
#include <chrono>
#include <future>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "server/http/http_server.h"
#include "server/metrics.h"
#include "tests/unit/server/raw_http_client.h"

namespace twinkle {
namespace {

using RawClient = ::twinkle::testing::RawHttpClient;

constexpr char kRequest[] = "POST /stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n{}";

TEST(HttpStream, ChunksFromAnotherThreadArriveInOrderThenTheConnectionCloses) {
  Metrics metrics;
  HttpServer http(metrics);
  // The writer thread is handed over through a promise: the test may read everything it
  // wrote before the handler's thread has finished storing it anywhere else.
  std::promise<std::thread> writer;
  http.RouteStreaming("POST", "/stream", [&writer](const HttpRequest&, HttpResponder, HttpStreamer streamer) {
    std::shared_ptr<HttpStream> stream = streamer({200, "text/event-stream", "", {{"X-Test", "1"}}});
    writer.set_value(std::thread([stream] {
      for (int i = 0; i < 5; ++i) EXPECT_TRUE(stream->Write("data: " + std::to_string(i) + "\n\n"));
      stream->End();
      EXPECT_FALSE(stream->Write("late"));
    }));
  });
  absl::StatusOr<int> port = http.Start("127.0.0.1", 0, 2);
  ASSERT_TRUE(port.ok()) << port.status();
  RawClient client(*port);
  client.Send(kRequest);
  const std::string got = client.ReadUntil("\r\n0\r\n\r\n");
  EXPECT_NE(got.find("HTTP/1.1 200"), std::string::npos) << got;
  EXPECT_NE(got.find("Transfer-Encoding: chunked"), std::string::npos) << got;
  EXPECT_NE(got.find("Content-Type: text/event-stream"), std::string::npos) << got;
  EXPECT_NE(got.find("X-Test: 1"), std::string::npos) << got;
  size_t at = 0;
  for (int i = 0; i < 5; ++i) {
    const size_t next = got.find("data: " + std::to_string(i) + "\n\n", at);
    ASSERT_NE(next, std::string::npos) << i << ": " << got;
    at = next;
  }
  EXPECT_EQ(got.find("late"), std::string::npos);
  EXPECT_TRUE(client.ServerClosed());
  writer.get_future().get().join();
  http.Stop();
}

TEST(HttpStream, AClientThatClosesIsReportedAndWritesThenFail) {
  Metrics metrics;
  HttpServer http(metrics);
  std::promise<std::shared_ptr<HttpStream>> opened;
  std::promise<void> gone;
  http.RouteStreaming("POST", "/stream", [&](const HttpRequest&, HttpResponder, HttpStreamer streamer) {
    std::shared_ptr<HttpStream> stream = streamer({200, "text/event-stream", ""});
    stream->OnClientGone([&gone] { gone.set_value(); });
    EXPECT_TRUE(stream->Write("data: first\n\n"));
    opened.set_value(stream);
  });
  absl::StatusOr<int> port = http.Start("127.0.0.1", 0, 2);
  ASSERT_TRUE(port.ok()) << port.status();
  RawClient client(*port);
  client.Send(kRequest);
  EXPECT_NE(client.ReadUntil("data: first").find("data: first"), std::string::npos);
  std::shared_ptr<HttpStream> stream = opened.get_future().get();
  client.Close();  // nothing is being written: the server notices through its pending read
  ASSERT_EQ(gone.get_future().wait_for(std::chrono::seconds(30)), std::future_status::ready);
  EXPECT_TRUE(stream->client_gone());
  EXPECT_FALSE(stream->Write("data: after\n\n"));
  stream.reset();
  http.Stop();
}

TEST(HttpStream, AClientThatStopsReadingIsDroppedPastTheBacklogLimit) {
  Metrics metrics;
  HttpServer http(metrics);
  HttpServerLimits limits;
  limits.max_stream_backlog_bytes = 1 << 20;
  http.SetLimits(limits);
  std::promise<void> gone;
  std::promise<int> written;
  std::promise<std::thread> writer;  // handed over as in the first test
  http.RouteStreaming("POST", "/stream", [&](const HttpRequest&, HttpResponder, HttpStreamer streamer) {
    std::shared_ptr<HttpStream> stream = streamer({200, "text/event-stream", ""});
    stream->OnClientGone([&gone] { gone.set_value(); });
    writer.set_value(std::thread([stream, &written] {
      // 256 MiB in all, far past what the socket buffers take: the backlog limit must trip.
      int n = 0;
      while (n < 256 && stream->Write(std::string(1 << 20, 'x'))) {
        ++n;
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      written.set_value(n);
    }));
  });
  absl::StatusOr<int> port = http.Start("127.0.0.1", 0, 2);
  ASSERT_TRUE(port.ok()) << port.status();
  RawClient client(*port);
  client.Send(kRequest);  // and never reads
  ASSERT_EQ(gone.get_future().wait_for(std::chrono::seconds(60)), std::future_status::ready);
  EXPECT_LT(written.get_future().get(), 256);  // the writer was told to stop
  writer.get_future().get().join();
  http.Stop();
}

TEST(HttpStream, AStreamingRouteMayAnswerWholeAndThenCannotStream) {
  Metrics metrics;
  HttpServer http(metrics);
  http.RouteStreaming("POST", "/stream", [](const HttpRequest&, HttpResponder respond, HttpStreamer streamer) {
    respond({400, "application/json", R"({"error":"no"})"});
    std::shared_ptr<HttpStream> late = streamer({200, "text/event-stream", ""});
    EXPECT_TRUE(late->client_gone());
    EXPECT_FALSE(late->Write("x"));
  });
  absl::StatusOr<int> port = http.Start("127.0.0.1", 0, 2);
  ASSERT_TRUE(port.ok()) << port.status();
  RawClient client(*port);
  client.Send(kRequest);
  const std::string got = client.ReadUntil(R"({"error":"no"})");
  EXPECT_NE(got.find("HTTP/1.1 400"), std::string::npos) << got;
  EXPECT_NE(got.find("Content-Length: 14"), std::string::npos) << got;
  http.Stop();
}

// HttpRequest::on_client_gone: a client that closes while a streaming route's answer is
// pending is reported; one that waits gets its answer, and its keep-alive connection then
// serves a second request (the watch reads nothing from the socket).
TEST(HttpStream, AClientThatClosesWhileTheAnswerIsPendingIsReported) {
  Metrics metrics;
  HttpServer http(metrics);
  std::promise<void> gone;
  std::promise<HttpResponder> pending;
  http.RouteStreaming("POST", "/stream", [&](const HttpRequest& request, HttpResponder respond, HttpStreamer) {
    ASSERT_TRUE(request.on_client_gone);
    request.on_client_gone([&gone] { gone.set_value(); });
    pending.set_value(std::move(respond));  // answered later, if ever
  });
  absl::StatusOr<int> port = http.Start("127.0.0.1", 0, 2);
  ASSERT_TRUE(port.ok()) << port.status();
  RawClient client(*port);
  client.Send(kRequest);
  HttpResponder respond = pending.get_future().get();
  client.Close();
  ASSERT_EQ(gone.get_future().wait_for(std::chrono::seconds(30)), std::future_status::ready);
  respond({200, "application/json", "{}"});  // to nobody: harmless
  http.Stop();
}

TEST(HttpStream, AnAnsweredRequestIsNotReportedAndKeepAliveGoesOn) {
  Metrics metrics;
  HttpServer http(metrics);
  std::atomic<int> gone{0};
  std::atomic<int> calls{0};
  http.RouteStreaming("POST", "/stream", [&](const HttpRequest& request, HttpResponder respond, HttpStreamer) {
    request.on_client_gone([&gone] { ++gone; });
    const int n = ++calls;
    std::thread([respond = std::move(respond), n] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      respond({200, "application/json", "{\"n\":" + std::to_string(n) + "}"});
    }).detach();
  });
  absl::StatusOr<int> port = http.Start("127.0.0.1", 0, 2);
  ASSERT_TRUE(port.ok()) << port.status();
  RawClient client(*port);
  client.Send(kRequest);
  EXPECT_NE(client.ReadUntil("{\"n\":1}").find("{\"n\":1}"), std::string::npos);
  client.Send(kRequest);  // the same connection
  EXPECT_NE(client.ReadUntil("{\"n\":2}").find("{\"n\":2}"), std::string::npos);
  client.Close();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(gone.load(), 0);  // both were answered before the close
  http.Stop();
}

// An answer that comes later than the idle timeout (a long generation) is still written: the
// idle timeout is for waiting on the client's next request, not on the server's answer.
TEST(HttpStream, AnAnswerLaterThanTheIdleTimeoutIsStillWritten) {
  Metrics metrics;
  HttpServer http(metrics);
  HttpServerLimits limits;
  limits.idle_timeout_s = 1;
  http.SetLimits(limits);
  http.RouteStreaming("POST", "/stream", [](const HttpRequest&, HttpResponder respond, HttpStreamer) {
    std::thread([respond = std::move(respond)] {
      std::this_thread::sleep_for(std::chrono::milliseconds(2500));
      respond({200, "application/json", R"({"late":true})"});
    }).detach();
  });
  absl::StatusOr<int> port = http.Start("127.0.0.1", 0, 2);
  ASSERT_TRUE(port.ok()) << port.status();
  RawClient client(*port);
  client.Send(kRequest);
  const std::string got = client.ReadUntil(R"({"late":true})");
  EXPECT_NE(got.find(R"({"late":true})"), std::string::npos) << got;
  http.Stop();
}

}  // namespace
}  // namespace twinkle
