// Sampling sessions across a restart of the server, in process: two "boots" of the training
// and sampler coordinators over one registry file (real SQLite), a fake EngineLink and a fake
// clock. Sessions on the base model come back under their ids on first use; live snapshots'
// sessions and closed ones get a clear "lost in a server restart"; another tenant never
// reopens someone's session; journaled sessions nobody uses again are dropped with their rows
// session_timeout after the start. An earlier run's training session resumes on its first
// heartbeat (once), and the sampling sessions it owned come back owned by it.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "core/futures/future_store.h"
#include "core/registry/registry.h"
#include "core/sampling/sampler_coordinator.h"
#include "core/training/coordinator.h"
#include "tests/unit/core/fake_clock.h"
#include "tests/unit/core/sampling/fake_engine.h"
#include "tests/unit/core/storage/temp_dir.h"

namespace twinkle::sampling {
namespace {

using ::twinkle::testing::FakeClock;
using ::twinkle::sampling::testing::FakeEngine;

constexpr absl::Duration kTimeout = absl::Minutes(30);

training::TenantContext Tenant(const std::string& id) {
  training::TenantContext t;
  t.id = id;
  return t;
}

// The base model a boot's sampler serves (a default model takes journal rows that name
// none, and drops those of a model not among `others`).
struct BootModel {
  std::string name = "m";
  bool is_default = true;
  std::vector<std::string> others;
};

// One run of the server: its coordinators over the registry file, started.
struct Boot {
  using Model = BootModel;
  Boot(const std::string& registry_path, FakeClock& clock, int32_t max_sessions_per_tenant, Model model = {})
      : clock(clock) {
    registry = std::move(registry::Registry::Open(registry_path)).value();
    SamplerOptions o;
    o.base_model = model.name;
    o.default_model = model.is_default;
    o.other_models = model.others;
    o.session_timeout = kTimeout;
    o.max_sessions_per_tenant = max_sessions_per_tenant;
    o.registry = registry.get();
    training::CoordinatorOptions co;
    co.registry = registry.get();
    training = std::make_unique<training::TrainingCoordinator>(co, engine, futures, clock);
    sampler = std::make_unique<SamplerCoordinator>(o, std::vector<training::EngineLink*>{&engine}, *training, nullptr,
                                                   futures, clock);
    training->Start();
    sampler->Start();
  }
  ~Boot() {
    sampler->Stop();
    training->Stop();
  }
  size_t JournalRows() { return registry->ListSamplingSessions().value().size(); }

  FakeClock& clock;
  std::unique_ptr<registry::Registry> registry;
  FakeEngine engine;
  FutureStore futures{absl::Hours(1), clock};
  std::unique_ptr<training::TrainingCoordinator> training;
  std::unique_ptr<SamplerCoordinator> sampler;
};

class SamplerRestartTest : public ::testing::Test {
 protected:
  // A run of the server; the clock moves on between runs, as a restart's does.
  std::unique_ptr<Boot> Launch(int32_t max_sessions_per_tenant = 64, Boot::Model model = {}) {
    clock_.Advance(absl::Seconds(5));
    return std::make_unique<Boot>((dir_.path() / "registry.sqlite").string(), clock_, max_sessions_per_tenant,
                                  std::move(model));
  }

  // A live snapshot session of `tenant`'s adapter "a" (made with its training session).
  static std::string LiveSnapshot(Boot& boot, const training::TenantContext& tenant) {
    const std::string session = boot.training->CreateSession(tenant).value();
    training::AddAdapterArgs args;
    args.name = "a";
    args.session_id = session;
    EXPECT_TRUE(boot.training->AddAdapter(tenant, args).ok());
    absl::StatusOr<uint64_t> id = boot.sampler->SubmitSnapshotSession(tenant, "a", {}, session);
    EXPECT_TRUE(id.ok()) << id.status();
    absl::StatusOr<FutureResult> got = boot.futures.Wait(*id, tenant.id, absl::Seconds(30));
    EXPECT_TRUE(got.ok() && got->ok());
    return std::get<SnapshotSession>(**got).sampling_session_id;
  }

  storage::testing::TempDir dir_;
  FakeClock clock_;
};

TEST_F(SamplerRestartTest, BaseModelSessionsAreReopenedUnderTheirIdsAfterARestart) {
  const training::TenantContext alice = Tenant("alice"), bob = Tenant("bob");
  std::string alices, bobs, live, closed;
  {
    std::unique_ptr<Boot> first = Launch();
    alices = first->sampler->CreateSession(alice, "").value();
    bobs = first->sampler->CreateSession(bob, "").value();
    closed = first->sampler->CreateSession(alice, "").value();
    live = LiveSnapshot(*first, alice);
    ASSERT_TRUE(first->sampler->CloseSession(alice, closed).ok());
    EXPECT_EQ(first->JournalRows(), 2u);  // alice's and bob's open base sessions; no live, no closed
  }
  std::unique_ptr<Boot> second = Launch();
  EXPECT_EQ(second->sampler->stats().sessions, 0);  // reopened on use, not at start

  // Another tenant naming alice's id is answered as for any unknown id of an earlier run, and
  // does not use up her reopening.
  EXPECT_EQ(second->sampler->GetSession(bob, alices).status().code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<SamplingSessionInfo> back = second->sampler->GetSession(alice, alices);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->id, alices);
  EXPECT_EQ(back->model_path, "");
  EXPECT_TRUE(second->sampler->GetSession(bob, bobs).ok());
  EXPECT_EQ(second->sampler->stats().sessions, 2);
  // Reopened, still not bob's; a session of this run that is not his is unknown to him.
  EXPECT_EQ(second->sampler->GetSession(bob, alices).status().code(), absl::StatusCode::kFailedPrecondition);
  const std::string new_one = second->sampler->CreateSession(alice, "").value();
  EXPECT_EQ(second->sampler->GetSession(bob, new_one).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(second->sampler->CloseSession(alice, new_one).ok());
  EXPECT_EQ(second->JournalRows(), 2u);

  // The live snapshot's session and the closed one were not kept: a clear, non-retryable error.
  for (const std::string& gone : {live, closed}) {
    absl::Status s = second->sampler->GetSession(alice, gone).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << gone << ": " << s;
    EXPECT_NE(s.message().find("lost in a server restart"), std::string::npos) << s;
  }
  // Ids this server never issued stay unknown; new sessions never reuse an earlier boot's id.
  EXPECT_EQ(second->sampler->GetSession(alice, "sampler-1").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(second->sampler->GetSession(alice, "sampler-zzzzzzzz-1").status().code(),
            absl::StatusCode::kFailedPrecondition);
  for (int i = 0; i < 8; ++i) {
    const std::string fresh = second->sampler->CreateSession(alice, "").value();
    EXPECT_NE(fresh, alices);
    EXPECT_NE(fresh, live);
    EXPECT_NE(fresh, closed);
  }

  // Closing a reopened session deletes its row: a third boot does not bring it back.
  ASSERT_TRUE(second->sampler->CloseSession(alice, alices).ok());
  second.reset();
  std::unique_ptr<Boot> third = Launch();
  EXPECT_EQ(third->sampler->GetSession(alice, alices).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(third->sampler->GetSession(bob, bobs).ok());
}

TEST_F(SamplerRestartTest, EachModelReopensOnlyItsOwnSessions) {
  const training::TenantContext alice = Tenant("alice");
  const Boot::Model a{"model-a", true, {"model-b"}}, b{"model-b", false, {}};
  std::string on_b;
  {
    std::unique_ptr<Boot> first = Launch(64, b);
    on_b = first->sampler->CreateSession(alice, "").value();
    // A row journaled before the registry knew models (schema v6), and one of a model that
    // the next boots no longer serve.
    registry::SamplingSessionRecord legacy{"sampler-0000000a-1", "alice", "", "", false, clock_.Now(), ""};
    registry::SamplingSessionRecord unserved{"sampler-0000000a-2", "alice", "", "", false, clock_.Now(), "gone"};
    ASSERT_TRUE(first->registry->PutSamplingSession(legacy).ok());
    ASSERT_TRUE(first->registry->PutSamplingSession(unserved).ok());
    for (const registry::SamplingSessionRecord& row : first->registry->ListSamplingSessions().value()) {
      if (row.id == on_b) EXPECT_EQ(row.base_model, "model-b");
    }
    EXPECT_EQ(first->JournalRows(), 3u);
  }
  {
    std::unique_ptr<Boot> default_model = Launch(64, a);
    EXPECT_FALSE(default_model->sampler->HoldsSession("alice", on_b));  // model-b's: not here
    EXPECT_TRUE(default_model->sampler->HoldsSession("alice", "sampler-0000000a-1"));
    EXPECT_FALSE(default_model->sampler->HoldsSession("bob", "sampler-0000000a-1"));
    EXPECT_FALSE(default_model->sampler->HoldsSession("alice", "sampler-0000000a-2"));
    EXPECT_EQ(default_model->JournalRows(), 2u);  // the unserved model's row is gone
    EXPECT_TRUE(default_model->sampler->GetSession(alice, "sampler-0000000a-1").ok());
  }
  std::unique_ptr<Boot> second_model = Launch(64, b);
  EXPECT_TRUE(second_model->sampler->HoldsSession("alice", on_b));
  absl::StatusOr<SamplingSessionInfo> back = second_model->sampler->GetSession(alice, on_b);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->base_model, "model-b");
  EXPECT_FALSE(second_model->sampler->HoldsSession("alice", "sampler-0000000a-1"));
}

TEST_F(SamplerRestartTest, AReopeningOverTheSessionLimitIsRefusedAndKeptForLater) {
  const training::TenantContext alice = Tenant("alice");
  std::string kept;
  {
    std::unique_ptr<Boot> first = Launch(/*max_sessions_per_tenant=*/2);
    kept = first->sampler->CreateSession(alice, "").value();
  }
  std::unique_ptr<Boot> second = Launch(/*max_sessions_per_tenant=*/2);
  const std::string a = second->sampler->CreateSession(alice, "").value();
  ASSERT_TRUE(second->sampler->CreateSession(alice, "").ok());  // at the limit
  // limit + 1: the reopening is refused naming the limit, and the session is not dropped.
  absl::Status over = second->sampler->GetSession(alice, kept).status();
  EXPECT_EQ(over.code(), absl::StatusCode::kFailedPrecondition) << over;
  EXPECT_NE(over.message().find("the limit is 2"), std::string::npos) << over;
  EXPECT_EQ(over.message().find("could not be reopened"), std::string::npos) << over;
  EXPECT_EQ(second->JournalRows(), 3u);
  // Room again: it comes back under its id.
  ASSERT_TRUE(second->sampler->CloseSession(alice, a).ok());
  absl::StatusOr<SamplingSessionInfo> back = second->sampler->GetSession(alice, kept);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->id, kept);
}

TEST_F(SamplerRestartTest, JournaledSessionsNobodyUsesAreDroppedSessionTimeoutAfterTheStart) {
  const training::TenantContext alice = Tenant("alice");
  std::string kept, idle;
  {
    std::unique_ptr<Boot> first = Launch();
    kept = first->sampler->CreateSession(alice, "").value();
    idle = first->sampler->CreateSession(alice, "").value();
  }
  std::unique_ptr<Boot> second = Launch();
  clock_.Advance(kTimeout - absl::Seconds(1));
  second->sampler->Housekeep();
  ASSERT_TRUE(second->sampler->GetSession(alice, kept).ok());  // still in time
  clock_.Advance(absl::Seconds(2));
  second->sampler->Housekeep();
  EXPECT_EQ(second->JournalRows(), 1u);  // only the reopened one
  absl::Status s = second->sampler->GetSession(alice, idle).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(second->sampler->GetSession(alice, kept).ok());
}

TEST_F(SamplerRestartTest, AnEarlierRunsTrainingSessionResumesOnItsFirstHeartbeatOnce) {
  const training::TenantContext alice = Tenant("alice"), bob = Tenant("bob");
  std::string session, finished, sampling;
  {
    std::unique_ptr<Boot> first = Launch();
    session = first->training->CreateSession(alice).value();
    finished = first->training->CreateSession(alice).value();
    ASSERT_TRUE(first->registry->FinishSession(finished, "alice", clock_.Now()).ok());
    sampling = first->sampler->CreateSession(alice, "", session).value();
  }
  std::unique_ptr<Boot> second = Launch();
  EXPECT_FALSE(second->training->SessionAlive("alice", session));
  EXPECT_EQ(second->training->Heartbeat(bob, session).code(), absl::StatusCode::kNotFound);  // not bob's
  ASSERT_TRUE(second->training->Heartbeat(alice, session).ok());
  EXPECT_TRUE(second->training->SessionAlive("alice", session));
  EXPECT_EQ(second->training->Heartbeat(alice, finished).code(), absl::StatusCode::kNotFound);  // it finished
  // The sampling session it owned comes back owned by it, and closes when it ends.
  absl::StatusOr<SamplingSessionInfo> info = second->sampler->GetSession(alice, sampling);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->owner, session);
  ASSERT_TRUE(second->training->EndSession(alice, session).ok());
  second->sampler->Housekeep();
  EXPECT_EQ(second->sampler->GetSession(alice, sampling).status().code(), absl::StatusCode::kFailedPrecondition);
  // Resumed once: ended again, it stays ended; so does a session of this run that ended.
  EXPECT_EQ(second->training->Heartbeat(alice, session).code(), absl::StatusCode::kNotFound);
  const std::string current = second->training->CreateSession(alice).value();
  ASSERT_TRUE(second->training->EndSession(alice, current).ok());
  EXPECT_EQ(second->training->Heartbeat(alice, current).code(), absl::StatusCode::kNotFound);

  // An id found not resumable is remembered: heartbeating it again reads no registry row (here:
  // a row that appears afterwards is not seen), while an id never heartbeated still resumes.
  EXPECT_EQ(second->training->Heartbeat(alice, "ghost").code(), absl::StatusCode::kNotFound);
  const absl::Time before_start = clock_.Now() - absl::Hours(1);
  ASSERT_TRUE(second->registry->PutSession("ghost", "alice", before_start).ok());
  ASSERT_TRUE(second->registry->PutSession("late", "alice", before_start).ok());
  EXPECT_EQ(second->training->Heartbeat(alice, "ghost").code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(second->training->Heartbeat(alice, "late").ok());
}

}  // namespace
}  // namespace twinkle::sampling
