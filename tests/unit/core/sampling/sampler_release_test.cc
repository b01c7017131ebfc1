// SamplerCoordinator's release of sampling sessions and snapshots, in process against a fake
// EngineLink (no engine, no sleeps): live snapshots LRU-evicted at the per-tenant cap, with a
// clear error for a later use; sessions closed when their owning training session finishes or
// is gone; one implicit session per (tenant, model path); other tenants untouched.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/time/time.h"
#include "core/futures/future_store.h"
#include "core/sampling/sampler_coordinator.h"
#include "core/training/coordinator.h"
#include "tests/unit/core/fake_clock.h"
#include "tests/unit/core/sampling/fake_engine.h"

namespace twinkle::sampling {
namespace {

using ::twinkle::testing::FakeClock;
using ::twinkle::sampling::testing::FakeEngine;

constexpr absl::Duration kLong = absl::Seconds(30);

class SamplerReleaseTest : public ::testing::Test {
 protected:
  SamplerReleaseTest() {
    training_.Start();
    sampler_.Start();
  }
  ~SamplerReleaseTest() override {
    sampler_.Stop();
    training_.Stop();
  }

  static SamplerOptions Options() {
    SamplerOptions o;
    o.max_snapshots_per_tenant = 2;
    return o;
  }
  static training::TenantContext Tenant(const std::string& id) {
    training::TenantContext t;
    t.id = id;
    return t;
  }

  // A session and an adapter in it for `tenant`; returns the session id.
  std::string SessionWithAdapter(const training::TenantContext& tenant) {
    absl::StatusOr<std::string> created = training_.CreateSession(tenant);
    EXPECT_TRUE(created.ok()) << created.status();
    const std::string session = created.value_or("");
    training::AddAdapterArgs args;
    args.name = "a";
    args.session_id = session;
    EXPECT_TRUE(training_.AddAdapter(tenant, args).ok());
    return session;
  }

  // A live snapshot of the tenant's adapter "a", owned by `owner`; its sampling session id.
  std::string Snapshot(const training::TenantContext& tenant, const std::string& owner) {
    clock_.Advance(absl::Seconds(1));  // distinct last-use times
    absl::StatusOr<uint64_t> id = sampler_.SubmitSnapshotSession(tenant, "a", {}, owner);
    EXPECT_TRUE(id.ok()) << id.status();
    absl::StatusOr<FutureResult> got = futures_.Wait(*id, tenant.id, kLong);
    EXPECT_TRUE(got.ok() && got->ok()) << (got.ok() ? got->status() : got.status());
    return std::get<SnapshotSession>(**got).sampling_session_id;
  }

  absl::StatusCode Code(const training::TenantContext& tenant, const std::string& session) {
    return sampler_.GetSession(tenant, session).status().code();
  }

  FakeClock clock_;
  FutureStore futures_{absl::Hours(1), clock_};
  FakeEngine engine_;
  training::TrainingCoordinator training_{training::CoordinatorOptions{}, engine_, futures_, clock_};
  SamplerCoordinator sampler_{Options(), {&engine_}, training_, nullptr, futures_, clock_};
};

TEST_F(SamplerReleaseTest, ALiveSnapshotBeyondTheTenantsCapEvictsItsLeastRecentlyUsedOne) {
  const training::TenantContext alice = Tenant("alice"), bob = Tenant("bob");
  const std::string alice_session = SessionWithAdapter(alice);
  const std::string bob_session = SessionWithAdapter(bob);
  const std::string bobs = Snapshot(bob, bob_session);
  const std::string s1 = Snapshot(alice, alice_session);
  const std::string s2 = Snapshot(alice, alice_session);
  clock_.Advance(absl::Seconds(1));
  ASSERT_TRUE(sampler_.GetSession(alice, s1).ok());  // s1 used after s2: s2 is the LRU one
  EXPECT_EQ(sampler_.stats().snapshots, 3);

  const std::string s3 = Snapshot(alice, alice_session);  // cap 2: evicts s2
  absl::Status evicted = sampler_.GetSession(alice, s2).status();
  EXPECT_EQ(evicted.code(), absl::StatusCode::kFailedPrecondition) << evicted;
  EXPECT_NE(evicted.message().find("was released"), std::string::npos) << evicted;
  EXPECT_NE(evicted.message().find("max_snapshots_per_tenant"), std::string::npos) << evicted;
  EXPECT_TRUE(sampler_.GetSession(alice, s1).ok());
  EXPECT_TRUE(sampler_.GetSession(alice, s3).ok());
  // The other tenant's snapshot is untouched, and the released id is still nobody else's.
  EXPECT_TRUE(sampler_.GetSession(bob, bobs).ok());
  EXPECT_EQ(Code(bob, s2), absl::StatusCode::kNotFound);
  EXPECT_EQ(sampler_.stats().snapshots, 3);
  EXPECT_EQ(sampler_.stats().sessions, 3);

  // A loop of many more holds the cap.
  for (int i = 0; i < 20; ++i) Snapshot(alice, alice_session);
  EXPECT_EQ(sampler_.stats().snapshots, 3);  // alice's 2 + bob's 1
}

TEST_F(SamplerReleaseTest, SessionsCloseWhenTheirOwnerFinishesOrIsGone) {
  const training::TenantContext alice = Tenant("alice"), bob = Tenant("bob");
  const std::string alice_session = SessionWithAdapter(alice);
  const std::string bob_session = SessionWithAdapter(bob);
  const std::string a1 = Snapshot(alice, alice_session);
  absl::StatusOr<std::string> base = sampler_.CreateSession(alice, "", alice_session);
  ASSERT_TRUE(base.ok());
  const std::string b1 = Snapshot(bob, bob_session);

  // Finishing alice's session closes both of hers (and only hers).
  EXPECT_EQ(sampler_.CloseOwnedBy(bob, alice_session), 0);  // not bob's to finish
  EXPECT_EQ(sampler_.CloseOwnedBy(alice, alice_session), 2);
  EXPECT_EQ(Code(alice, a1), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Code(alice, *base), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(sampler_.GetSession(bob, b1).ok());
  EXPECT_EQ(sampler_.stats().snapshots, 1);

  // Bob's session ends on the training side (it stopped heartbeating, or finished there):
  // the next housekeeping closes the sampling session it owned.
  ASSERT_TRUE(training_.EndSession(bob, bob_session).ok());
  EXPECT_FALSE(training_.SessionAlive("bob", bob_session));
  sampler_.Housekeep();
  absl::Status gone = sampler_.GetSession(bob, b1).status();
  EXPECT_EQ(gone.code(), absl::StatusCode::kFailedPrecondition) << gone;
  EXPECT_NE(gone.message().find("ended"), std::string::npos) << gone;
  EXPECT_EQ(sampler_.stats().snapshots, 0);
  EXPECT_EQ(sampler_.stats().sessions, 0);
}

TEST_F(SamplerReleaseTest, RequestsWithoutASessionShareOneImplicitSessionPerTenantAndPath) {
  const training::TenantContext alice = Tenant("alice"), bob = Tenant("bob");
  absl::StatusOr<std::string> first = sampler_.ImplicitSession(alice, "");
  ASSERT_TRUE(first.ok()) << first.status();
  for (int i = 0; i < 100; ++i) EXPECT_EQ(*sampler_.ImplicitSession(alice, ""), *first);
  absl::StatusOr<std::string> bobs = sampler_.ImplicitSession(bob, "");
  ASSERT_TRUE(bobs.ok());
  EXPECT_NE(*bobs, *first);
  EXPECT_EQ(sampler_.stats().sessions, 2);
  // Closed: the next request makes a new one.
  ASSERT_TRUE(sampler_.CloseSession(alice, *first).ok());
  absl::StatusOr<std::string> again = sampler_.ImplicitSession(alice, "");
  ASSERT_TRUE(again.ok());
  EXPECT_NE(*again, *first);
}

TEST_F(SamplerReleaseTest, AHybridModelsSamplesMustFitItsStateSlotsAtLimitPlusOne) {
  engine_.state_slots_ = 4;
  const training::TenantContext alice = Tenant("alice");
  absl::StatusOr<std::string> session = sampler_.CreateSession(alice, "");
  ASSERT_TRUE(session.ok()) << session.status();
  SamplingParams params;
  params.max_tokens = 2;
  params.num_samples = 5;
  absl::StatusOr<uint64_t> refused = sampler_.SubmitSample(alice, *session, {{1, 2, 3}}, params, {});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), ::testing::HasSubstr("num_samples: 5 exceeds the 4 recurrent state slots"));
  EXPECT_EQ(sampler_.stats().waiting, 0);  // refused before anything was queued
  params.num_samples = 4;
  EXPECT_TRUE(sampler_.SubmitSample(alice, *session, {{1, 2, 3}}, params, {}).ok());
  engine_.state_slots_ = 0;  // a dense model: only max_num_samples bounds it
  params.num_samples = 100;
  EXPECT_TRUE(sampler_.SubmitSample(alice, *session, {{1, 2, 3}}, params, {}).ok());
}

}  // namespace
}  // namespace twinkle::sampling
