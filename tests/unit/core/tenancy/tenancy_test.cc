#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/tenancy/rate_limiter.h"
#include "core/tenancy/sha256.h"
#include "core/tenancy/tenant_registry.h"
#include "tests/unit/core/fake_clock.h"

namespace twinkle::tenancy {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

using ::twinkle::testing::FakeClock;

TEST(Sha256Test, KnownVectors) {
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(Sha256Test, ParseHex) {
  const std::string hex = Sha256Hex("tml-tenant-a");
  ASSERT_TRUE(ParseSha256Hex(hex).has_value());
  EXPECT_EQ(*ParseSha256Hex(hex), Sha256("tml-tenant-a"));
  std::string upper = hex;
  for (char& c : upper) c = static_cast<char>(std::toupper(c));
  EXPECT_EQ(ParseSha256Hex(upper), ParseSha256Hex(hex));
  EXPECT_FALSE(ParseSha256Hex(hex.substr(1)).has_value());
  EXPECT_FALSE(ParseSha256Hex(hex.substr(1) + "g").has_value());
  EXPECT_FALSE(ParseSha256Hex("").has_value());
}

std::vector<TenantSpec> TwoTenants() {
  Quotas alice_q;
  alice_q.max_adapters = 4;
  Quotas bob_q;
  bob_q.max_lora_rank = 8;
  return {
      {"alice", {Sha256Hex("tml-alice-1"), Sha256Hex("tml-alice-2")}, alice_q},
      {"bob", {Sha256Hex("tml-bob")}, bob_q},
  };
}

TEST(TenantRegistryTest, RightKeyFindsItsTenant) {
  absl::StatusOr<TenantRegistry> r = TenantRegistry::WithKeys(TwoTenants());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->auth_enabled());
  for (const char* key : {"tml-alice-1", "tml-alice-2"}) {
    absl::StatusOr<const Tenant*> t = r->Authenticate(key);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ((*t)->id, "alice");
    EXPECT_EQ((*t)->quotas.max_adapters, 4);
  }
  absl::StatusOr<const Tenant*> bob = r->Authenticate("tml-bob");
  ASSERT_TRUE(bob.ok());
  EXPECT_EQ((*bob)->id, "bob");
  EXPECT_EQ((*bob)->quotas.max_lora_rank, 8);
  EXPECT_EQ((*bob)->quotas.max_adapters, 64);
}

TEST(TenantRegistryTest, WrongOrMissingKeyIsUnauthenticated) {
  absl::StatusOr<TenantRegistry> r = TenantRegistry::WithKeys(TwoTenants());
  ASSERT_TRUE(r.ok());
  absl::StatusOr<const Tenant*> missing = r->Authenticate("");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(missing.status().message(), "missing API key");
  for (const char* key : {"tml-alice", "tml-alice-1 ", "TML-BOB", "x"}) {
    absl::StatusOr<const Tenant*> wrong = r->Authenticate(key);
    EXPECT_EQ(wrong.status().code(), absl::StatusCode::kUnauthenticated) << key;
    EXPECT_EQ(wrong.status().message(), "invalid API key");
    EXPECT_THAT(std::string(wrong.status().ToString()), Not(HasSubstr(key)));
  }
  // The digest itself is not a key.
  EXPECT_FALSE(r->Authenticate(Sha256Hex("tml-bob")).ok());
}

TEST(TenantRegistryTest, TenantsAreIsolated) {
  absl::StatusOr<TenantRegistry> r = TenantRegistry::WithKeys(TwoTenants());
  ASSERT_TRUE(r.ok());
  const Tenant* alice = r->Find("alice");
  const Tenant* bob = r->Find("bob");
  ASSERT_NE(alice, nullptr);
  ASSERT_NE(bob, nullptr);
  EXPECT_NE(alice, bob);
  // Authenticate answers the key's principal: its tenant's id and quotas.
  EXPECT_EQ((*r->Authenticate("tml-alice-1"))->id, alice->id);
  EXPECT_EQ((*r->Authenticate("tml-bob"))->id, bob->id);
  EXPECT_EQ(r->Find("carol"), nullptr);
  EXPECT_EQ(r->Find("default"), nullptr);
  ASSERT_EQ(r->tenants().size(), 2u);
  EXPECT_EQ(r->tenants()[0]->id, "alice");

  // Pointers survive moving the registry.
  TenantRegistry moved = std::move(*r);
  EXPECT_EQ(moved.Find("alice"), alice);
  EXPECT_EQ((*moved.Authenticate("tml-bob"))->id, "bob");
}

TEST(TenantRegistryTest, BadSpecsAreRefusedWithoutDigestsInMessages) {
  EXPECT_EQ(TenantRegistry::WithKeys({}).status().code(), absl::StatusCode::kInvalidArgument);

  std::vector<TenantSpec> bad_id = TwoTenants();
  bad_id[0].id = "Alice";
  EXPECT_THAT(std::string(TenantRegistry::WithKeys(bad_id).status().message()),
              HasSubstr("'Alice'"));

  std::vector<TenantSpec> dup_id = TwoTenants();
  dup_id[1].id = "alice";
  EXPECT_THAT(std::string(TenantRegistry::WithKeys(dup_id).status().message()),
              HasSubstr("defined twice"));

  std::vector<TenantSpec> dup_key = TwoTenants();
  dup_key[1].key_sha256.push_back(Sha256Hex("tml-alice-2"));
  const std::string message(TenantRegistry::WithKeys(dup_key).status().message());
  EXPECT_THAT(message, HasSubstr("more than once"));
  EXPECT_THAT(message, Not(HasSubstr(Sha256Hex("tml-alice-2"))));

  std::vector<TenantSpec> bad_hex = TwoTenants();
  bad_hex[0].key_sha256[0] = "abc";
  EXPECT_THAT(std::string(TenantRegistry::WithKeys(bad_hex).status().message()),
              HasSubstr("64 hex digits"));

  std::vector<TenantSpec> no_key = TwoTenants();
  no_key[1].key_sha256.clear();
  EXPECT_THAT(std::string(TenantRegistry::WithKeys(no_key).status().message()),
              HasSubstr("has no key"));
}

TEST(TenantRegistryTest, AuthOffHasOnlyTheDefaultTenant) {
  Quotas limits;
  limits.max_lora_rank = 16;
  TenantRegistry r = TenantRegistry::Open(limits);
  EXPECT_FALSE(r.auth_enabled());
  for (const char* key : {"", "anything", "tml-alice-1"}) {
    absl::StatusOr<const Tenant*> t = r.Authenticate(key);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ((*t)->id, "default");
    EXPECT_EQ((*t)->quotas.max_lora_rank, 16);
  }
  EXPECT_EQ(r.Find("default"), *r.Authenticate(""));
  EXPECT_EQ(r.tenants().size(), 1u);
}

TEST(TenantRegistryTest, SetKeysAddsRevokesAndKeepsPrincipalsAlive) {
  absl::StatusOr<TenantRegistry> r = TenantRegistry::WithKeys(TwoTenants());
  ASSERT_TRUE(r.ok());
  Quotas defaults;
  defaults.max_adapters = 3;
  r->SetKeys({{*ParseSha256Hex(Sha256Hex("tml-alice-1")), "alice", 1, Role::kMember},
              {*ParseSha256Hex(Sha256Hex("tml-carol")), "carol", 7, Role::kReadOnly}},
             defaults);
  absl::StatusOr<const Tenant*> alice = r->Authenticate("tml-alice-1");
  ASSERT_TRUE(alice.ok());
  EXPECT_EQ((*alice)->key_id, 1);
  EXPECT_EQ((*alice)->role, Role::kMember);
  absl::StatusOr<const Tenant*> carol = r->Authenticate("tml-carol");
  ASSERT_TRUE(carol.ok());
  EXPECT_EQ((*carol)->id, "carol");
  EXPECT_EQ((*carol)->role, Role::kReadOnly);
  EXPECT_EQ((*carol)->quotas.max_adapters, 3);  // a runtime tenant gets the defaults
  ASSERT_NE(r->Find("carol"), nullptr);
  // Keys left out no longer authenticate; the old principal stays readable.
  EXPECT_EQ(r->Authenticate("tml-bob").status().message(), "invalid API key");
  EXPECT_EQ(r->Authenticate("tml-alice-2").status().message(), "invalid API key");
  const Tenant* held = *carol;
  r->SetKeys({{*ParseSha256Hex(Sha256Hex("tml-alice-1")), "alice", 1, Role::kMember}}, defaults);
  EXPECT_EQ(r->Authenticate("tml-carol").status().message(), "invalid API key");
  EXPECT_EQ(held->id, "carol");
  EXPECT_EQ(*r->Authenticate("tml-alice-1"), *alice);  // unchanged (id, role): same principal
  // A role change makes a new principal.
  r->SetKeys({{*ParseSha256Hex(Sha256Hex("tml-alice-1")), "alice", 1, Role::kAdmin}}, defaults);
  EXPECT_EQ((*r->Authenticate("tml-alice-1"))->role, Role::kAdmin);
  EXPECT_EQ((*alice)->role, Role::kMember);
}

TEST(TenantIdTest, Pattern) {
  EXPECT_TRUE(IsValidTenantId("a"));
  EXPECT_TRUE(IsValidTenantId("team-1_x"));
  EXPECT_TRUE(IsValidTenantId(std::string(64, 'z')));
  EXPECT_FALSE(IsValidTenantId(std::string(65, 'z')));
  EXPECT_FALSE(IsValidTenantId(""));
  EXPECT_FALSE(IsValidTenantId("A"));
  EXPECT_FALSE(IsValidTenantId("a.b"));
  EXPECT_FALSE(IsValidTenantId("a b"));
}

Tenant Limited(const std::string& id, double rate, int64_t burst) {
  Tenant t{id, {}};
  t.quotas.tokens_per_s = rate;
  t.quotas.burst_tokens = burst;
  return t;
}

TEST(TokenRateLimiterTest, UnlimitedByDefault) {
  FakeClock clock;
  TokenRateLimiter limiter(clock);
  Tenant t{"t", {}};
  for (int i = 0; i < 100; ++i) EXPECT_TRUE(limiter.Acquire(t, 1'000'000).ok());
}

TEST(TokenRateLimiterTest, BurstThenRefillMath) {
  FakeClock clock;
  TokenRateLimiter limiter(clock);
  const Tenant t = Limited("t", /*rate=*/100, /*burst=*/1000);
  EXPECT_DOUBLE_EQ(limiter.available(t), 1000);
  EXPECT_TRUE(limiter.Acquire(t, 600).ok());
  EXPECT_TRUE(limiter.Acquire(t, 400).ok());
  EXPECT_DOUBLE_EQ(limiter.available(t), 0);

  absl::Status refused = limiter.Acquire(t, 250);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.message()), HasSubstr("2.500 s"));
  ASSERT_TRUE(RetryAfter(refused).has_value());
  EXPECT_EQ(*RetryAfter(refused), absl::Milliseconds(2500));
  EXPECT_EQ(RetryAfterSeconds(refused), 3);
  EXPECT_DOUBLE_EQ(limiter.available(t), 0);  // a refusal takes nothing

  clock.Advance(absl::Seconds(1));
  EXPECT_DOUBLE_EQ(limiter.available(t), 100);
  refused = limiter.Acquire(t, 250);
  EXPECT_EQ(*RetryAfter(refused), absl::Milliseconds(1500));
  clock.Advance(absl::Milliseconds(1500));
  EXPECT_TRUE(limiter.Acquire(t, 250).ok());
  EXPECT_NEAR(limiter.available(t), 0, 1e-9);

  // Refill stops at the burst.
  clock.Advance(absl::Hours(1));
  EXPECT_DOUBLE_EQ(limiter.available(t), 1000);
}

TEST(TokenRateLimiterTest, OversizedRequestNeedsAFullBucketAndLeavesDebt) {
  FakeClock clock;
  TokenRateLimiter limiter(clock);
  const Tenant t = Limited("t", 100, 1000);
  EXPECT_TRUE(limiter.Acquire(t, 1500).ok());
  EXPECT_DOUBLE_EQ(limiter.available(t), -500);
  absl::Status refused = limiter.Acquire(t, 1);
  EXPECT_EQ(*RetryAfter(refused), absl::Milliseconds(5010));
  clock.Advance(absl::Seconds(15));
  EXPECT_TRUE(limiter.Acquire(t, 1500).ok());
}

TEST(TokenRateLimiterTest, TenantsHaveTheirOwnBuckets) {
  FakeClock clock;
  TokenRateLimiter limiter(clock);
  const Tenant a = Limited("a", 10, 100);
  const Tenant b = Limited("b", 10, 100);
  EXPECT_TRUE(limiter.Acquire(a, 100).ok());
  EXPECT_FALSE(limiter.Acquire(a, 1).ok());
  EXPECT_TRUE(limiter.Acquire(b, 100).ok());
}

TEST(TokenRateLimiterTest, RefundAndZeroTokens) {
  FakeClock clock;
  TokenRateLimiter limiter(clock);
  const Tenant t = Limited("t", 10, 100);
  EXPECT_TRUE(limiter.Acquire(t, 0).ok());
  EXPECT_TRUE(limiter.Acquire(t, 80).ok());
  limiter.Refund(t, 500);
  EXPECT_DOUBLE_EQ(limiter.available(t), 100);
}

TEST(RetryAfterTest, OnlyOnStatusesThatCarryIt) {
  EXPECT_FALSE(RetryAfter(absl::OkStatus()).has_value());
  EXPECT_FALSE(RetryAfter(absl::ResourceExhaustedError("queue full")).has_value());
  absl::Status s = absl::ResourceExhaustedError("queue full");
  SetRetryAfter(s, absl::Milliseconds(10));
  EXPECT_EQ(RetryAfterSeconds(s), 1);
  absl::Status ok = absl::OkStatus();
  SetRetryAfter(ok, absl::Seconds(1));
  EXPECT_TRUE(ok.ok());
}

}  // namespace
}  // namespace twinkle::tenancy
