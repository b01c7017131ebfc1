#include "server/http/request_guard.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace twinkle {
namespace {

using ::testing::HasSubstr;

HttpRequest Head(std::optional<std::string> host, std::optional<std::string> origin = std::nullopt) {
  HttpRequest r;
  r.method = "POST";
  r.path = "/api/v1/forward_backward";
  if (host) r.headers["host"] = *host;
  if (origin) r.headers["origin"] = *origin;
  return r;
}

TEST(RequestGuardTest, HostNameDropsPortAndBrackets) {
  EXPECT_EQ(HostName("[::1]:8000"), "::1");
  EXPECT_EQ(HostName("Example.COM:80"), "example.com");
  EXPECT_EQ(HostName("127.0.0.1"), "127.0.0.1");
  EXPECT_EQ(HostName(" localhost:1 "), "localhost");
  EXPECT_EQ(HostName("fe80::1"), "fe80::1");
}

TEST(RequestGuardTest, LoopbackBindAcceptsLoopbackNamesAndListedOnesOnly) {
  const RequestGuardOptions o{"127.0.0.1", {"twinkle.internal"}, {}};
  for (const char* ok : {"127.0.0.1:8000", "localhost:8000", "[::1]:8000", "127.5.6.7", "TWINKLE.internal:8000"}) {
    EXPECT_EQ(CheckHostAndOrigin(o, Head(ok)), std::nullopt) << ok;
  }
  EXPECT_EQ(CheckHostAndOrigin(o, Head(std::nullopt)), std::nullopt);
  // DNS rebinding: the attacker's name resolves to 127.0.0.1, the browser sends it as Host.
  std::optional<HttpResponse> r = CheckHostAndOrigin(o, Head("evil.example:8000"));
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status, 403);
  EXPECT_THAT(r->body, HasSubstr("evil.example"));
  EXPECT_THAT(r->body, HasSubstr("server.allowed_hosts"));
}

TEST(RequestGuardTest, PublicBindChecksHostsOnlyWhenListed) {
  EXPECT_EQ(CheckHostAndOrigin({"0.0.0.0", {}, {}}, Head("anything.example")), std::nullopt);
  const RequestGuardOptions listed{"10.1.2.3", {"api.example.com"}, {}};
  EXPECT_EQ(CheckHostAndOrigin(listed, Head("api.example.com:443")), std::nullopt);
  EXPECT_EQ(CheckHostAndOrigin(listed, Head("10.1.2.3:8000")), std::nullopt);
  ASSERT_TRUE(CheckHostAndOrigin(listed, Head("other.example")).has_value());
}

TEST(RequestGuardTest, AnyBrowserOriginNotListedIsRefused) {
  const RequestGuardOptions o{"127.0.0.1", {}, {"https://app.example.com"}};
  std::optional<HttpResponse> r = CheckHostAndOrigin(o, Head("127.0.0.1:8000", "https://evil.example"));
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status, 403);
  EXPECT_THAT(r->body, HasSubstr("server.allowed_origins"));
  EXPECT_TRUE(CheckHostAndOrigin(o, Head("127.0.0.1:8000", "null")).has_value());  // sandboxed iframes, file://
  EXPECT_EQ(CheckHostAndOrigin(o, Head("127.0.0.1:8000", "https://app.example.com")), std::nullopt);
  EXPECT_EQ(CheckHostAndOrigin(o, Head("127.0.0.1:8000")), std::nullopt);  // SDKs send no Origin
}

}  // namespace
}  // namespace twinkle
