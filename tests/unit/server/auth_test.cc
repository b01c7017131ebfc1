#include "server/auth/authenticator.h"

#include <gmock/gmock.h>
#include <grpcpp/server_context.h>
#include <grpcpp/test/server_context_test_spouse.h>
#include <gtest/gtest.h>

#include <stdlib.h>

#include <filesystem>

#include "core/registry/registry.h"
#include "core/tenancy/sha256.h"
#include "server/auth/key_admin.h"
#include "server/auth/roles.h"

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

// ---- the runtime key set (KeyAdmin over a real registry) ------------------------------------

class KeyAdminTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (std::filesystem::temp_directory_path() / "twinkle-keys-XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    absl::StatusOr<std::unique_ptr<registry::Registry>> r = registry::Registry::Open(dir_ + "/registry.sqlite");
    ASSERT_TRUE(r.ok()) << r.status();
    registry_ = std::move(*r);
    config_ = AuthConfig();
    config_.auth.tenants[1].role = "admin";  // bob administers
    auth_ = Make(config_);
    keys_ = std::make_unique<KeyAdmin>(*registry_, *auth_, /*max_keys_per_tenant=*/3);
    ASSERT_TRUE(keys_->Bootstrap(config_).ok());
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  const Tenant& Who(const std::string& key) { return **auth_->AuthenticateKey(key); }

  std::string dir_;
  Config config_;
  std::unique_ptr<registry::Registry> registry_;
  std::unique_ptr<Authenticator> auth_;
  std::unique_ptr<KeyAdmin> keys_;
};

TEST_F(KeyAdminTest, BootstrapGivesConfigKeysIdsAndRoles) {
  EXPECT_GT(Who("tml-alice").key_id, 0);
  EXPECT_EQ(Who("tml-alice").role, tenancy::Role::kMember);
  EXPECT_EQ(Who("tml-bob").role, tenancy::Role::kAdmin);
  const int64_t id = Who("tml-alice").key_id;
  ASSERT_TRUE(keys_->Bootstrap(config_).ok());  // idempotent
  EXPECT_EQ(Who("tml-alice").key_id, id);
}

TEST_F(KeyAdminTest, CreateRevokeRotateTakeEffectAtOnce) {
  const Tenant& admin = Who("tml-bob");
  EXPECT_EQ(keys_->CreateKey(Who("tml-alice"), "alice", "member", "x", "p").status().code(),
            absl::StatusCode::kPermissionDenied);
  absl::StatusOr<NewKey> k = keys_->CreateKey(admin, "alice", "read-only", "ci", "127.0.0.1:1");
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_EQ(k->key.size(), 4u + 64u);
  absl::StatusOr<const Tenant*> who = auth_->AuthenticateKey(k->key);
  ASSERT_TRUE(who.ok());
  EXPECT_EQ((*who)->id, "alice");
  EXPECT_EQ((*who)->role, tenancy::Role::kReadOnly);
  absl::StatusOr<NewKey> rotated = keys_->RotateKey(admin, k->info.key_id, "p");
  ASSERT_TRUE(rotated.ok()) << rotated.status();
  EXPECT_FALSE(auth_->AuthenticateKey(k->key).ok());
  EXPECT_TRUE(auth_->AuthenticateKey(rotated->key).ok());
  ASSERT_TRUE(keys_->RevokeKey(admin, rotated->info.key_id, "p").ok());
  EXPECT_EQ(auth_->AuthenticateKey(rotated->key).status().code(), absl::StatusCode::kUnauthenticated);
  // The principal held by in-flight work outlives the revocation.
  EXPECT_EQ((*who)->id, "alice");
  // Every change is audited, by the admin's key id, without the keys.
  absl::StatusOr<std::vector<registry::AuditRecord>> rows =
      registry_->ListAudit("", absl::InfinitePast(), absl::InfiniteFuture(), 100);
  ASSERT_TRUE(rows.ok());
  ASSERT_EQ(rows->size(), 3u);
  for (const registry::AuditRecord& r : *rows) {
    EXPECT_EQ(r.key_id, admin.key_id);
    EXPECT_THAT(r.details_json, Not(HasSubstr(k->key)));
    EXPECT_THAT(r.details_json, Not(HasSubstr(rotated->key)));
  }
}

TEST_F(KeyAdminTest, LimitsAndBadInput) {
  const Tenant& admin = Who("tml-bob");
  EXPECT_EQ(keys_->CreateKey(admin, "alice", "root", "", "p").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(keys_->CreateKey(admin, "alice", "member", std::string(kMaxKeyNameBytes + 1, 'n'), "p").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(keys_->CreateKey(admin, "nobody", "member", "", "p").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(keys_->CreateTenant(admin, "Bad Id", "p").status().code(), absl::StatusCode::kInvalidArgument);
  // alice holds 1 config key; the limit is 3 active keys.
  ASSERT_TRUE(keys_->CreateKey(admin, "alice", "member", "", "p").ok());
  ASSERT_TRUE(keys_->CreateKey(admin, "alice", "member", "", "p").ok());
  absl::StatusOr<NewKey> over = keys_->CreateKey(admin, "alice", "member", "", "p");
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(over.status().message()), HasSubstr("auth.max_keys_per_tenant"));
  // A new tenant and its key.
  ASSERT_TRUE(keys_->CreateTenant(admin, "carol", "p").ok());
  absl::StatusOr<NewKey> carol = keys_->CreateKey(admin, "carol", "member", "", "p");
  ASSERT_TRUE(carol.ok());
  EXPECT_EQ(IdOf(auth_->AuthenticateKey(carol->key)), "carol");
  EXPECT_NE(auth_->registry().Find("carol"), nullptr);
}

TEST(KeyAdminAuthOff, ChangesAreRefused) {
  std::string tmpl = (std::filesystem::temp_directory_path() / "twinkle-keys-XXXXXX").string();
  ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
  absl::StatusOr<std::unique_ptr<registry::Registry>> r = registry::Registry::Open(tmpl + "/registry.sqlite");
  ASSERT_TRUE(r.ok());
  Config c;
  std::unique_ptr<Authenticator> auth = Make(c);
  KeyAdmin keys(**r, *auth, 10);
  ASSERT_TRUE(keys.Bootstrap(c).ok());
  const Tenant& who = **auth->AuthenticateKey("");
  EXPECT_EQ(who.role, tenancy::Role::kAdmin);
  EXPECT_EQ(keys.CreateKey(who, "default", "member", "", "p").status().code(), absl::StatusCode::kFailedPrecondition);
  std::filesystem::remove_all(tmpl);
}

TEST(RolesTest, ReadOnlyAndMemberRefusals) {
  Tenant viewer{"alice", {}, 1, tenancy::Role::kReadOnly};
  Tenant member{"alice", {}, 2, tenancy::Role::kMember};
  EXPECT_TRUE(CheckHttpRole(viewer, "GET", "/api/v1/training_runs").ok());
  EXPECT_TRUE(CheckHttpRole(viewer, "POST", "/api/v1/asample").ok());
  EXPECT_TRUE(CheckHttpRole(viewer, "POST", "/api/v1/sessions/s1-x/finish").ok());
  EXPECT_TRUE(CheckHttpRole(viewer, "POST", "/api/v1/auth/token").ok());  // its token stays read-only
  absl::Status s = CheckHttpRole(viewer, "POST", "/api/v1/forward_backward");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(s.message(), "POST /api/v1/forward_backward needs role member; this API key has role read-only");
  EXPECT_EQ(CheckHttpRole(member, "GET", "/api/v1/audit").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(CheckHttpRole(member, "POST", "/api/v1/forward_backward").ok());
  EXPECT_TRUE(CheckGrpcRole(viewer, "SamplerService/Sample").ok());
  EXPECT_EQ(CheckGrpcRole(viewer, "TrainingService/ForwardBackward").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(CheckGrpcRole(member, "AdminService/CreateKey").code(), absl::StatusCode::kPermissionDenied);
}

}  // namespace
}  // namespace twinkle
