// server/auth/jwt.h and the Authenticator's token path. Signatures are checked against an
// HS256 computed here with OpenSSL's HMAC over the base64url parts (RFC 7515), independent of
// libjwt, which the issuer uses.
#include "server/auth/jwt.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdlib.h>

#include <filesystem>
#include <map>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/registry/registry.h"
#include "core/tenancy/sha256.h"
#include "server/auth/authenticator.h"
#include "server/auth/key_admin.h"
#include "server/auth/secret_file.h"

namespace twinkle {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using tenancy::Tenant;

const std::string kSecret(32, 's');

class FakeClock final : public Clock {
 public:
  absl::Time Now() const override { return now; }
  absl::Time now = absl::FromUnixSeconds(1'800'000'000);
};

std::string B64Url(const std::string& bytes) {
  std::string out;
  absl::WebSafeBase64Escape(bytes, &out);  // unpadded
  return out;
}

std::string Hs256(const std::string& secret, const std::string& signing_input) {
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
       reinterpret_cast<const unsigned char*>(signing_input.data()), signing_input.size(), mac, &len);
  return B64Url(std::string(reinterpret_cast<const char*>(mac), len));
}

// A token signed here: header and claims as given.
std::string Token(const nlohmann::json& header, const nlohmann::json& claims, const std::string& secret = kSecret) {
  const std::string input = absl::StrCat(B64Url(header.dump()), ".", B64Url(claims.dump()));
  return absl::StrCat(input, ".", Hs256(secret, input));
}

nlohmann::json Claims(int64_t exp) {
  return {{"iss", "twinkle-server"}, {"sub", "twinkle:key:7"}, {"org_id", "alice"}, {"email", ""},
          {"key_id", 7},             {"iat", exp - 3600},      {"exp", exp}};
}

nlohmann::json Payload(const std::string& token) {
  std::vector<std::string> parts = absl::StrSplit(token, '.');
  std::string json;
  EXPECT_TRUE(absl::WebSafeBase64Unescape(parts.at(1), &json));
  return nlohmann::json::parse(json);
}

TEST(JwtIssuerTest, IssuesHs256WithTheClaimsTheSdkReads) {
  FakeClock clock;
  JwtIssuer issuer(kSecret, absl::Hours(1), clock);
  Tenant alice{"alice", {}, 7, tenancy::Role::kMember};
  absl::StatusOr<std::string> token = issuer.Issue(alice);
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_TRUE(LooksLikeJwt(*token));
  // The signature is HS256 over the first two parts.
  const size_t dot = token->rfind('.');
  EXPECT_EQ(token->substr(dot + 1), Hs256(kSecret, token->substr(0, dot)));
  const nlohmann::json claims = Payload(*token);
  EXPECT_EQ(claims["sub"], "twinkle:key:7");  // RestClient.whoami's user_urn
  EXPECT_EQ(claims["org_id"], "alice");        // its org_urn: tml:organization:alice
  EXPECT_EQ(claims["iss"], "twinkle-server");
  EXPECT_EQ(claims["exp"].get<int64_t>() - claims["iat"].get<int64_t>(), 3600);
  EXPECT_EQ(claims["iat"].get<int64_t>(), absl::ToUnixSeconds(clock.now));
  absl::StatusOr<JwtClaims> back = issuer.Verify(*token);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->tenant, "alice");
  EXPECT_EQ(back->key_id, 7);
  // Only registered keys get tokens.
  EXPECT_EQ(issuer.Issue(Tenant{"alice", {}, 0}).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(JwtIssuerTest, VerifiesATokenSignedIndependently) {
  FakeClock clock;
  JwtIssuer issuer(kSecret, absl::Hours(1), clock);
  const int64_t exp = absl::ToUnixSeconds(clock.now) + 60;
  absl::StatusOr<JwtClaims> c = issuer.Verify(Token({{"alg", "HS256"}, {"typ", "JWT"}}, Claims(exp)));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->key_id, 7);
}

TEST(JwtIssuerTest, RefusesForgedExpiredAndMalformedTokens) {
  FakeClock clock;
  JwtIssuer issuer(kSecret, absl::Hours(1), clock);
  const int64_t exp = absl::ToUnixSeconds(clock.now) + 60;
  const nlohmann::json hs256 = {{"alg", "HS256"}, {"typ", "JWT"}};
  auto refused = [&](const std::string& token, const std::string& why) {
    absl::StatusOr<JwtClaims> c = issuer.Verify(token);
    EXPECT_TRUE(IsInvalidToken(c.status())) << why << ": " << c.status();
    EXPECT_THAT(std::string(c.status().message()), Not(HasSubstr(token))) << why;
  };
  refused(Token(hs256, Claims(exp), std::string(32, 'x')), "another secret");
  nlohmann::json bob = Claims(exp);
  bob["org_id"] = "bob";
  const std::string good = Token(hs256, Claims(exp));
  const std::vector<std::string> parts = absl::StrSplit(good, '.');
  refused(absl::StrCat(parts[0], ".", B64Url(bob.dump()), ".", parts[2]), "claims swapped under a valid signature");
  refused(absl::StrCat(B64Url(R"({"alg":"none","typ":"JWT"})"), ".", parts[1], "."), "alg none");
  refused(Token({{"alg", "HS384"}, {"typ", "JWT"}}, Claims(exp)), "another algorithm");
  refused(Token(hs256, Claims(absl::ToUnixSeconds(clock.now))), "expired now");
  nlohmann::json no_key = Claims(exp);
  no_key.erase("key_id");
  refused(Token(hs256, no_key), "no key_id");
  nlohmann::json other_issuer = Claims(exp);
  other_issuer["iss"] = "passport-x";
  refused(Token(hs256, other_issuer), "another issuer");
  refused("eyJ.not.base64!", "garbage");
  // The size bound, at the limit and one over it.
  const std::string at_limit = absl::StrCat("eyJ", std::string(kMaxJwtBytes - 7, 'a'), ".b.c");
  ASSERT_EQ(at_limit.size(), kMaxJwtBytes);
  EXPECT_THAT(std::string(issuer.Verify(at_limit).status().message()), Not(HasSubstr("longer than")));
  const std::string over = at_limit + "c";
  refused(over, "over kMaxJwtBytes");
  EXPECT_THAT(std::string(issuer.Verify(over).status().message()), HasSubstr("longer than 4096 bytes"));
  // The issuer's own token, once the clock passes its exp.
  absl::StatusOr<std::string> token = issuer.Issue(Tenant{"alice", {}, 7});
  ASSERT_TRUE(token.ok());
  clock.now += absl::Hours(1);
  absl::StatusOr<JwtClaims> late = issuer.Verify(*token);
  EXPECT_TRUE(IsInvalidToken(late.status()));
  EXPECT_THAT(std::string(late.status().message()), HasSubstr("expired"));
}

TEST(SecretFileTest, ConfiguredHexOrAKeyFileMadeOnce) {
  std::string tmpl = (std::filesystem::temp_directory_path() / "twinkle-secret-XXXXXX").string();
  ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
  const std::string file = tmpl + "/jwt_signing.key";
  absl::StatusOr<std::string> made = LoadOrCreateSecret("", "auth.jwt_signing_secret", file);
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ(made->size(), kMinSecretBytes);
  EXPECT_EQ((std::filesystem::status(file).permissions() & std::filesystem::perms::all),
            std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  EXPECT_EQ(*LoadOrCreateSecret("", "auth.jwt_signing_secret", file), *made);  // kept across restarts
  absl::StatusOr<std::string> short_hex = LoadOrCreateSecret(std::string(62, 'a'), "auth.jwt_signing_secret", file);
  EXPECT_EQ(short_hex.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(short_hex.status().message()), HasSubstr("auth.jwt_signing_secret"));
  EXPECT_EQ(LoadOrCreateSecret(std::string(64, 'a'), "x", file)->size(), 32u);
  std::filesystem::remove_all(tmpl);
}

// ---- the Authenticator with tokens, over a real registry's key set -------------------------

class TokenAuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (std::filesystem::temp_directory_path() / "twinkle-jwt-XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    absl::StatusOr<std::unique_ptr<registry::Registry>> r = registry::Registry::Open(dir_ + "/registry.sqlite");
    ASSERT_TRUE(r.ok()) << r.status();
    registry_ = std::move(*r);
    config_.auth.enabled = true;
    for (const char* id : {"alice", "bob"}) {
      TenantConfig t;
      t.id = id;
      t.key_sha256 = {tenancy::Sha256Hex(absl::StrCat("tml-", id))};
      t.quotas = config_.limits;
      t.role = std::string(id) == "bob" ? "admin" : "member";
      config_.auth.tenants.push_back(t);
    }
    absl::StatusOr<std::unique_ptr<Authenticator>> a = Authenticator::FromConfig(config_);
    ASSERT_TRUE(a.ok()) << a.status();
    auth_ = std::move(*a);
    keys_ = std::make_unique<KeyAdmin>(*registry_, *auth_, 10);
    ASSERT_TRUE(keys_->Bootstrap(config_).ok());
    auth_->SetJwtIssuer(&issuer_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  static std::map<std::string, std::string> Headers(const std::string& credential) {
    return {{"x-api-key", credential}};
  }
  std::string TokenFor(const std::string& key) {
    absl::StatusOr<std::string> t = auth_->IssueToken(Headers(key));
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *t : std::string();
  }

  std::string dir_;
  Config config_;
  FakeClock clock_;
  JwtIssuer issuer_{kSecret, absl::Hours(1), clock_};
  std::unique_ptr<registry::Registry> registry_;
  std::unique_ptr<Authenticator> auth_;
  std::unique_ptr<KeyAdmin> keys_;
};

TEST_F(TokenAuthTest, ATokenActsAsItsKeyWithTheKeysCurrentRole) {
  EXPECT_TRUE(auth_->jwt_enabled());
  const Tenant& bob = **auth_->AuthenticateKey("tml-bob");
  absl::StatusOr<NewKey> k = keys_->CreateKey(bob, "alice", "member", "ci", "p");
  ASSERT_TRUE(k.ok());
  const std::string token = TokenFor(k->key);
  absl::StatusOr<const Tenant*> who = auth_->AuthenticateHttp(Headers(token));
  ASSERT_TRUE(who.ok()) << who.status();
  EXPECT_EQ((*who)->id, "alice");
  EXPECT_EQ((*who)->key_id, k->info.key_id);
  EXPECT_EQ((*who)->role, tenancy::Role::kMember);
  // A role change applies to tokens already out.
  ASSERT_TRUE(keys_->SetRole(bob, k->info.key_id, "read-only", "p").ok());
  EXPECT_EQ((*auth_->AuthenticateHttp(Headers(token)))->role, tenancy::Role::kReadOnly);
  EXPECT_EQ((*auth_->Identify(Headers(token)))->id, "alice");
  // Revoking the key fails its tokens on their next call, as invalid_token (the SDK then
  // tries the exchange again, which the revoked key fails too).
  ASSERT_TRUE(keys_->RevokeKey(bob, k->info.key_id, "p").ok());
  absl::StatusOr<const Tenant*> after = auth_->AuthenticateHttp(Headers(token));
  EXPECT_TRUE(IsInvalidToken(after.status())) << after.status();
  EXPECT_EQ(auth_->IssueToken(Headers(k->key)).status().code(), absl::StatusCode::kUnauthenticated);
}

TEST_F(TokenAuthTest, ExpiryForgeryAndTokenForTokenAreRefused) {
  const std::string token = TokenFor("tml-alice");
  const int64_t failures = auth_->failures();
  // A token is not exchanged for a fresh one.
  absl::StatusOr<std::string> again = auth_->IssueToken(Headers(token));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(std::string(again.status().message()), HasSubstr("API key"));
  // Signed under another server's secret.
  FakeClock clock;
  JwtIssuer other(std::string(32, 'o'), absl::Hours(1), clock);
  const Tenant& alice = **auth_->AuthenticateKey("tml-alice");
  absl::StatusOr<const Tenant*> forged = auth_->AuthenticateHttp(Headers(*other.Issue(alice)));
  EXPECT_TRUE(IsInvalidToken(forged.status()));
  clock_.now += absl::Hours(1);
  EXPECT_THAT(std::string(auth_->AuthenticateHttp(Headers(token)).status().message()), HasSubstr("expired"));
  EXPECT_EQ(auth_->failures(), failures + 3);
  // Keys keep working beside tokens; missing credentials are refused as before.
  EXPECT_TRUE(auth_->AuthenticateHttp(Headers("tml-alice")).ok());
  EXPECT_EQ(auth_->IssueToken({}).status().code(), absl::StatusCode::kUnauthenticated);
}

TEST_F(TokenAuthTest, AConfiguredKeyShapedLikeATokenStillWorks) {
  // Keys are free-form in the config; one that looks like a JWT is still a key.
  const std::string odd = "eyJodd.key.value";
  config_.auth.tenants[0].key_sha256.push_back(tenancy::Sha256Hex(odd));
  absl::StatusOr<std::unique_ptr<Authenticator>> a = Authenticator::FromConfig(config_);
  ASSERT_TRUE(a.ok());
  KeyAdmin keys(*registry_, **a, 10);
  ASSERT_TRUE(keys.Bootstrap(config_).ok());
  (*a)->SetJwtIssuer(&issuer_);
  absl::StatusOr<const Tenant*> who = (*a)->AuthenticateHttp(Headers(odd));
  ASSERT_TRUE(who.ok()) << who.status();
  EXPECT_EQ((*who)->id, "alice");
}

TEST(TokenAuthOff, NoExchangeWithoutAuthOrIssuer) {
  Config c;
  absl::StatusOr<std::unique_ptr<Authenticator>> a = Authenticator::FromConfig(c);
  ASSERT_TRUE(a.ok());
  FakeClock clock;
  JwtIssuer issuer(kSecret, absl::Hours(1), clock);
  (*a)->SetJwtIssuer(&issuer);
  EXPECT_FALSE((*a)->jwt_enabled());
  EXPECT_EQ((*a)->IssueToken({{"x-api-key", "anything"}}).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace twinkle
