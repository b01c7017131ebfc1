#include "server/auth/authenticator.h"

#include <gmock/gmock.h>
#include <grpcpp/server_context.h>
#include <grpcpp/test/server_context_test_spouse.h>
#include <gtest/gtest.h>

#include "core/tenancy/sha256.h"

namespace twinkle {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using tenancy::Sha256Hex;
using tenancy::Tenant;

Config AuthConfig() {
  Config c;
  c.limits.max_lora_rank = 32;
  c.auth.enabled = true;
  TenantConfig alice;
  alice.id = "alice";
  alice.key_sha256 = {Sha256Hex("tml-alice")};
  alice.quotas = c.limits;
  alice.quotas.max_adapters = 2;
  TenantConfig bob;
  bob.id = "bob";
  bob.key_sha256 = {Sha256Hex("tml-bob")};
  bob.quotas = c.limits;
  c.auth.tenants = {alice, bob};
  return c;
}

std::unique_ptr<Authenticator> Make(const Config& c) {
  absl::StatusOr<std::unique_ptr<Authenticator>> a = Authenticator::FromConfig(c);
  EXPECT_TRUE(a.ok()) << a.status();
  return a.ok() ? std::move(*a) : nullptr;
}

std::string IdOf(const absl::StatusOr<const Tenant*>& t) {
  return t.ok() ? (*t)->id : std::string(t.status().ToString());
}

TEST(AuthenticatorTest, HttpHeaderOrder) {
  std::unique_ptr<Authenticator> auth = Make(AuthConfig());
  ASSERT_NE(auth, nullptr);
  EXPECT_TRUE(auth->enabled());
  EXPECT_EQ(IdOf(auth->AuthenticateHttp({{"x-api-key", "tml-alice"}})), "alice");
  EXPECT_EQ(IdOf(auth->AuthenticateHttp({{"authorization", "Bearer tml-bob"}})), "bob");
  EXPECT_EQ(IdOf(auth->AuthenticateHttp({{"authorization", "bearer  tml-bob "}})), "bob");
  EXPECT_EQ(IdOf(auth->AuthenticateHttp({{"twinkle-authorization", "Bearer tml-bob"}})), "bob");
  // X-API-Key wins over Authorization.
  EXPECT_EQ(IdOf(auth->AuthenticateHttp(
                {{"x-api-key", "tml-alice"}, {"authorization", "Bearer tml-bob"}})),
            "alice");
  // Authorization wins over Twinkle-Authorization.
  EXPECT_EQ(IdOf(auth->AuthenticateHttp({{"authorization", "Bearer tml-bob"},
                                         {"twinkle-authorization", "Bearer tml-alice"}})),
            "bob");
  EXPECT_EQ(auth->failures(), 0);
}

TEST(AuthenticatorTest, HttpFailuresAreCountedAndNeverEchoTheKey) {
  std::unique_ptr<Authenticator> auth = Make(AuthConfig());
  ASSERT_NE(auth, nullptr);
  std::vector<absl::Status> seen;
  auth->SetFailureListener([&](const absl::Status& s) { seen.push_back(s); });

  absl::StatusOr<const Tenant*> missing = auth->AuthenticateHttp({});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(missing.status().message(), "missing API key");

  absl::StatusOr<const Tenant*> wrong = auth->AuthenticateHttp({{"x-api-key", "tml-secret-guess"}});
  EXPECT_EQ(wrong.status().message(), "invalid API key");

  absl::StatusOr<const Tenant*> basic =
      auth->AuthenticateHttp({{"authorization", "Basic dG1sLXNlY3JldA=="}});
  EXPECT_EQ(basic.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(std::string(basic.status().message()), HasSubstr("Bearer"));
  EXPECT_THAT(std::string(basic.status().message()), Not(HasSubstr("dG1s")));

  EXPECT_EQ(auth->failures(), 3);
  ASSERT_EQ(seen.size(), 3u);
  for (const absl::Status& s : seen) EXPECT_THAT(std::string(s.message()), Not(HasSubstr("secret")));
}

TEST(AuthenticatorTest, GrpcMetadata) {
  std::unique_ptr<Authenticator> auth = Make(AuthConfig());
  ASSERT_NE(auth, nullptr);
  {
    grpc::ServerContext context;
    grpc::testing::ServerContextTestSpouse spouse(&context);
    spouse.AddClientMetadata("authorization", "Bearer tml-alice");
    EXPECT_EQ(IdOf(auth->AuthenticateGrpc(context)), "alice");
  }
  {
    grpc::ServerContext context;
    grpc::testing::ServerContextTestSpouse spouse(&context);
    spouse.AddClientMetadata("x-api-key", "tml-bob");
    spouse.AddClientMetadata("authorization", "Bearer tml-alice");
    EXPECT_EQ(IdOf(auth->AuthenticateGrpc(context)), "bob");
  }
  {
    grpc::ServerContext context;
    absl::StatusOr<const Tenant*> none = auth->AuthenticateGrpc(context);
    EXPECT_EQ(none.status().message(), "missing API key");
  }
  {
    grpc::ServerContext context;
    grpc::testing::ServerContextTestSpouse spouse(&context);
    spouse.AddClientMetadata("x-api-key", "nope");
    EXPECT_EQ(auth->AuthenticateGrpc(context).status().message(), "invalid API key");
  }
  EXPECT_EQ(auth->failures(), 2);
}

TEST(AuthenticatorTest, AuthOffIsTheDefaultTenantWithLimits) {
  Config c;
  c.limits.max_lora_rank = 8;
  c.limits.tokens_per_s = 50;
  std::unique_ptr<Authenticator> auth = Make(c);
  ASSERT_NE(auth, nullptr);
  EXPECT_FALSE(auth->enabled());
  grpc::ServerContext context;
  absl::StatusOr<const Tenant*> t = auth->AuthenticateGrpc(context);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)->id, "default");
  EXPECT_EQ((*t)->quotas.max_lora_rank, 8);
  EXPECT_EQ((*t)->quotas.tokens_per_s, 50);
  EXPECT_EQ(IdOf(auth->AuthenticateHttp({{"x-api-key", "whatever"}})), "default");
  EXPECT_EQ(auth->failures(), 0);
}

TEST(AuthenticatorTest, TenantQuotasComeFromConfig) {
  std::unique_ptr<Authenticator> auth = Make(AuthConfig());
  ASSERT_NE(auth, nullptr);
  const Tenant* alice = auth->registry().Find("alice");
  ASSERT_NE(alice, nullptr);
  EXPECT_EQ(alice->quotas.max_adapters, 2);
  EXPECT_EQ(alice->quotas.max_lora_rank, 32);
  EXPECT_EQ(auth->registry().Find("bob")->quotas.max_adapters, 64);
}

TEST(ExtractApiKeyTest, EmptyValuesFallThrough) {
  std::map<std::string, std::string> h = {{"x-api-key", "  "}, {"authorization", "Bearer k"}};
  absl::StatusOr<std::string> key = ExtractApiKey([&](absl::string_view n) -> const std::string* {
    auto it = h.find(std::string(n));
    return it == h.end() ? nullptr : &it->second;
  });
  ASSERT_TRUE(key.ok());
  EXPECT_EQ(*key, "k");
}

}  // namespace
}  // namespace twinkle
