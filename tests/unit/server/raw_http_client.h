#pragma once
// A raw HTTP/1.1 client over one loopback connection, for tests of HttpServer that need to
// see the bytes on the wire (heads, chunked framing, Content-Length, early closes) or to stop
// reading (flow control).

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include <gtest/gtest.h>

namespace twinkle::testing {

class RawHttpClient {
 public:
  // `receive_buffer` > 0: the socket's SO_RCVBUF (small, so a client that stops reading
  // pushes back soon).
  explicit RawHttpClient(int port, int receive_buffer = 0) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    if (receive_buffer > 0) setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof(receive_buffer));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    EXPECT_EQ(connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  }
  ~RawHttpClient() { Close(); }
  RawHttpClient(const RawHttpClient&) = delete;
  RawHttpClient& operator=(const RawHttpClient&) = delete;

  void Send(const std::string& text) {
    ASSERT_EQ(write(fd_, text.data(), text.size()), static_cast<ssize_t>(text.size()));
  }
  void Get(const std::string& path) { Send("GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"); }

  // Reads until `needle` has arrived or the server closed; returns everything not consumed
  // by ReadHead / ReadBody (all that was read, when only this is used).
  std::string ReadUntil(const std::string& needle) {
    while (buffered_.find(needle) == std::string::npos && Fill()) {
    }
    return buffered_;
  }
  // Reads the response head (through the blank line); leftover body bytes stay buffered.
  std::string ReadHead() {
    ReadUntil("\r\n\r\n");
    const size_t end = buffered_.find("\r\n\r\n");
    if (end == std::string::npos) return std::exchange(buffered_, std::string());
    std::string head = buffered_.substr(0, end + 4);
    buffered_.erase(0, end + 4);
    return head;
  }
  // Reads up to `n` body bytes (fewer when the server closes first).
  std::string ReadBody(size_t n) {
    while (buffered_.size() < n && Fill()) {
    }
    std::string body = buffered_.substr(0, std::min(n, buffered_.size()));
    buffered_.erase(0, body.size());
    return body;
  }
  // True once the server has closed its side (reads what is left).
  bool ServerClosed() {
    while (Fill()) {
    }
    return closed_;
  }
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  bool Fill() {
    char buf[65536];
    const ssize_t n = read(fd_, buf, sizeof(buf));
    if (n <= 0) {
      closed_ = n == 0;
      return false;
    }
    buffered_.append(buf, static_cast<size_t>(n));
    return true;
  }
  int fd_ = -1;
  bool closed_ = false;
  std::string buffered_;
};

}  // namespace twinkle::testing
