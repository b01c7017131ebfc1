#include "core/registry/registry.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sqlite3.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace twinkle::registry {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A fresh directory per test, removed afterwards.
class RegistryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "twinkle-registry-XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    path_ = (dir_ / "registry.sqlite").string();
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  std::unique_ptr<Registry> OpenOrDie() {
    absl::StatusOr<std::unique_ptr<Registry>> r = Registry::Open(path_);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? std::move(*r) : nullptr;
  }

  // A raw connection for what the API does not show (pragmas, tables, user_version).
  int64_t RawInt(const std::string& sql) {
    sqlite3* db = nullptr;
    EXPECT_EQ(sqlite3_open_v2(path_.c_str(), &db, SQLITE_OPEN_READWRITE, nullptr), SQLITE_OK);
    sqlite3_stmt* st = nullptr;
    EXPECT_EQ(sqlite3_prepare_v2(db, sql.c_str(), -1, &st, nullptr), SQLITE_OK) << sqlite3_errmsg(db);
    int64_t v = -1;
    if (sqlite3_step(st) == SQLITE_ROW) v = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    sqlite3_close(db);
    return v;
  }
  std::string RawText(const std::string& sql) {
    sqlite3* db = nullptr;
    EXPECT_EQ(sqlite3_open_v2(path_.c_str(), &db, SQLITE_OPEN_READWRITE, nullptr), SQLITE_OK);
    sqlite3_stmt* st = nullptr;
    EXPECT_EQ(sqlite3_prepare_v2(db, sql.c_str(), -1, &st, nullptr), SQLITE_OK) << sqlite3_errmsg(db);
    std::string v;
    if (sqlite3_step(st) == SQLITE_ROW) v = reinterpret_cast<const char*>(sqlite3_column_text(st, 0));
    sqlite3_finalize(st);
    sqlite3_close(db);
    return v;
  }
  void RawExec(const std::string& sql) {
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open_v2(path_.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, nullptr), SQLITE_OK);
    char* err = nullptr;
    EXPECT_EQ(sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &err), SQLITE_OK) << (err ? err : "");
    sqlite3_free(err);
    sqlite3_close(db);
  }

  fs::path dir_;
  std::string path_;
};

absl::Time T(int64_t seconds) { return absl::FromUnixSeconds(1'700'000'000 + seconds); }

RunRecord MakeRun(const std::string& tenant, const std::string& run_id, absl::Time created) {
  RunRecord r;
  r.run_id = run_id;
  r.tenant = tenant;
  r.adapter_name = "adapter-" + run_id;
  r.base_model = "Qwen/Qwen3-0.6B";
  r.lora_config_json = R"({"r":8,"lora_alpha":32,"target_modules":["all-linear"]})";
  r.created = created;
  r.last_request = created + absl::Seconds(1);
  r.last_step = 3;
  return r;
}

CheckpointRecord MakeCheckpoint(const std::string& tenant, const std::string& run_id, const std::string& name,
                            absl::Time created) {
  CheckpointRecord c;
  c.tenant = tenant;
  c.run_id = run_id;
  c.checkpoint_id = "weights/" + name;
  c.kind = "training";
  c.path = "/data/tenants/" + tenant + "/runs/" + run_id + "/weights/" + name;
  c.size_bytes = 123456789012;
  c.created = created;
  return c;
}

FutureRecord MakeFuture(uint64_t id, const std::string& tenant, const std::string& state, absl::Time t) {
  FutureRecord f;
  f.id = id;
  f.tenant = tenant;
  f.state = state;
  f.created = t;
  f.updated = t;
  return f;
}

void ExpectRunEq(const RunRecord& a, const RunRecord& b) {
  EXPECT_EQ(a.run_id, b.run_id);
  EXPECT_EQ(a.tenant, b.tenant);
  EXPECT_EQ(a.adapter_name, b.adapter_name);
  EXPECT_EQ(a.base_model, b.base_model);
  EXPECT_EQ(a.lora_config_json, b.lora_config_json);
  EXPECT_EQ(a.created, b.created);
  EXPECT_EQ(a.last_request, b.last_request);
  EXPECT_EQ(a.last_step, b.last_step);
}

void ExpectCheckpointEq(const CheckpointRecord& a, const CheckpointRecord& b) {
  EXPECT_EQ(a.tenant, b.tenant);
  EXPECT_EQ(a.run_id, b.run_id);
  EXPECT_EQ(a.checkpoint_id, b.checkpoint_id);
  EXPECT_EQ(a.kind, b.kind);
  EXPECT_EQ(a.path, b.path);
  EXPECT_EQ(a.size_bytes, b.size_bytes);
  EXPECT_EQ(a.created, b.created);
}

void ExpectFutureEq(const FutureRecord& a, const FutureRecord& b) {
  EXPECT_EQ(a.id, b.id);
  EXPECT_EQ(a.tenant, b.tenant);
  EXPECT_EQ(a.state, b.state);
  EXPECT_EQ(a.result, b.result);
  EXPECT_EQ(a.error_code, b.error_code);
  EXPECT_EQ(a.error_message, b.error_message);
  EXPECT_EQ(a.created, b.created);
  EXPECT_EQ(a.updated, b.updated);
}

// ------------------------------------------------------------------------------------------ //
// Opening, schema, migrations

TEST_F(RegistryTest, CreateThenReopenKeepsEveryTable) {
  const RunRecord run = MakeRun("alice", "run-1", T(10));
  const CheckpointRecord ckpt = MakeCheckpoint("alice", "run-1", "step-5", T(20));
  FutureRecord future = MakeFuture(42, "alice", "done", T(30));
  future.result = std::string("\x00\x01\xffpayload", 10);
  {
    std::unique_ptr<Registry> reg = OpenOrDie();
    ASSERT_NE(reg, nullptr);
    ASSERT_TRUE(reg->PutSession("sess-1", "alice", T(1)).ok());
    ASSERT_TRUE(reg->TouchSession("sess-1", "alice", T(5)).ok());
    ASSERT_TRUE(reg->PutRun(run).ok());
    ASSERT_TRUE(reg->PutCheckpoint(ckpt).ok());
    ASSERT_TRUE(reg->PutFuture(future).ok());
  }  // destroyed: the connection closes
  EXPECT_EQ(RawInt("PRAGMA user_version"), Registry::kSchemaVersion);
  EXPECT_EQ(RawText("PRAGMA journal_mode"), "wal");  // persistent in the file

  std::unique_ptr<Registry> reg = OpenOrDie();
  ASSERT_NE(reg, nullptr);
  absl::StatusOr<SessionRecord> sess = reg->GetSession("sess-1", "alice");
  ASSERT_TRUE(sess.ok()) << sess.status();
  EXPECT_EQ(sess->id, "sess-1");
  EXPECT_EQ(sess->tenant, "alice");
  EXPECT_EQ(sess->created, T(1));
  EXPECT_EQ(sess->last_heartbeat, T(5));

  absl::StatusOr<RunRecord> got_run = reg->GetRun("alice", "run-1");
  ASSERT_TRUE(got_run.ok()) << got_run.status();
  ExpectRunEq(*got_run, run);

  absl::StatusOr<CheckpointRecord> got_ckpt = reg->GetCheckpoint("alice", "run-1", "weights/step-5");
  ASSERT_TRUE(got_ckpt.ok()) << got_ckpt.status();
  ExpectCheckpointEq(*got_ckpt, ckpt);

  absl::StatusOr<FutureRecord> got_future = reg->GetFuture(42, "alice");
  ASSERT_TRUE(got_future.ok()) << got_future.status();
  ExpectFutureEq(*got_future, future);
  EXPECT_EQ(got_future->result.size(), 10u);

  absl::StatusOr<uint64_t> max_id = reg->MaxFutureId();
  ASSERT_TRUE(max_id.ok());
  EXPECT_EQ(*max_id, 42u);
}

TEST_F(RegistryTest, TimesAreStoredAsMicrosecondsRoundedDown) {
  std::unique_ptr<Registry> reg = OpenOrDie();
  ASSERT_NE(reg, nullptr);
  RunRecord run = MakeRun("alice", "r", T(0) + absl::Nanoseconds(1999));
  run.last_request = absl::FromUnixMicros(-5);  // before the epoch stays exact
  ASSERT_TRUE(reg->PutRun(run).ok());
  absl::StatusOr<RunRecord> got = reg->GetRun("alice", "r");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->created, T(0) + absl::Microseconds(1));
  EXPECT_EQ(got->last_request, absl::FromUnixMicros(-5));
  EXPECT_EQ(RawInt("SELECT created_us FROM runs"), absl::ToUnixMicros(T(0)) + 1);
}

TEST_F(RegistryTest, MigratesAnEmptyFile) {
  { std::ofstream(path_).flush(); }  // a zero-byte file: user_version 0, no tables
  ASSERT_EQ(fs::file_size(path_), 0u);
  std::unique_ptr<Registry> reg = OpenOrDie();
  ASSERT_NE(reg, nullptr);
  EXPECT_EQ(RawInt("PRAGMA user_version"), Registry::kSchemaVersion);
  for (const char* table : {"sessions", "runs", "checkpoints", "futures", "counters"}) {
    EXPECT_EQ(RawInt(std::string("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = '") + table + "'"),
              1)
        << table;
  }
  EXPECT_TRUE(reg->PutRun(MakeRun("alice", "r", T(0))).ok());
  // Reopening an up-to-date file migrates nothing (a rerun of v1 would fail on CREATE TABLE).
  reg.reset();
  reg = OpenOrDie();
  ASSERT_NE(reg, nullptr);
  EXPECT_TRUE(reg->GetRun("alice", "r").ok());
}

TEST_F(RegistryTest, MigratesAFileThatHasNoPathYet) {
  ASSERT_FALSE(fs::exists(path_));
  std::unique_ptr<Registry> reg = OpenOrDie();
  ASSERT_NE(reg, nullptr);
  EXPECT_TRUE(fs::exists(path_));
  EXPECT_EQ(RawInt("PRAGMA user_version"), Registry::kSchemaVersion);
}

TEST_F(RegistryTest, RefusesANewerSchemaVersion) {
  RawExec("CREATE TABLE future_stuff (x INTEGER); PRAGMA user_version = 7;");
  absl::StatusOr<std::unique_ptr<Registry>> reg = Registry::Open(path_);
  ASSERT_FALSE(reg.ok());
  EXPECT_EQ(reg.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(reg.status().message(), HasSubstr("schema version 7"));
  EXPECT_THAT(reg.status().message(), HasSubstr(absl::StrCat("this binary's ", Registry::kSchemaVersion)));
  EXPECT_THAT(reg.status().message(), HasSubstr(path_));
  // Untouched: still version 7, nothing of ours created.
  EXPECT_EQ(RawInt("PRAGMA user_version"), 7);
  EXPECT_EQ(RawInt("SELECT COUNT(*) FROM sqlite_master WHERE name = 'runs'"), 0);
}

TEST_F(RegistryTest, MissingParentDirectoryIsNamed) {
  const std::string path = (dir_ / "no" / "such" / "dir" / "registry.sqlite").string();
  absl::StatusOr<std::unique_ptr<Registry>> reg = Registry::Open(path);
  ASSERT_FALSE(reg.ok());
  EXPECT_EQ(reg.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(reg.status().message(), HasSubstr(path));
  EXPECT_THAT(reg.status().message(), HasSubstr("does not exist"));
  EXPECT_FALSE(fs::exists(dir_ / "no"));
}

TEST_F(RegistryTest, RefusesAFileThatIsNotADatabase) {
  {
    std::ofstream out(path_, std::ios::binary);
    out << std::string(4096, 'x');
  }
  absl::StatusOr<std::unique_ptr<Registry>> reg = Registry::Open(path_);
  ASSERT_FALSE(reg.ok());
  EXPECT_EQ(reg.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(reg.status().message(), HasSubstr(path_));
  EXPECT_THAT(reg.status().message(), HasSubstr("not a SQLite database"));
}

TEST_F(RegistryTest, RefusesADirectoryAsThePath) {
  absl::StatusOr<std::unique_ptr<Registry>> reg = Registry::Open(dir_.string());
  ASSERT_FALSE(reg.ok());
  EXPECT_EQ(reg.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(reg.status().message(), HasSubstr(dir_.string()));
}

// ------------------------------------------------------------------------------------------ //
// Tenant isolation

TEST_F(RegistryTest, AnotherTenantsRowsAreNotFoundLikeUnknownOnes) {
  std::unique_ptr<Registry> reg = OpenOrDie();
  ASSERT_NE(reg, nullptr);
  ASSERT_TRUE(reg->PutSession("s", "alice", T(0)).ok());
  ASSERT_TRUE(reg->PutRun(MakeRun("alice", "r", T(0))).ok());
  ASSERT_TRUE(reg->PutCheckpoint(MakeCheckpoint("alice", "r", "c", T(1))).ok());
  ASSERT_TRUE(reg->PutFuture(MakeFuture(7, "alice", "done", T(2))).ok());

  // Each pair: bob on alice's id vs a tenant for whom the same id is simply unknown → same
  // code, same message.
  auto same = [](const absl::Status& theirs, const absl::Status& unknown) {
    EXPECT_EQ(theirs.code(), absl::StatusCode::kNotFound) << theirs;
    EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound) << unknown;
    EXPECT_EQ(theirs.message(), unknown.message());
  };
  same(reg->GetSession("s", "bob").status(), reg->GetSession("s", "nobody").status());
  same(reg->TouchSession("s", "bob", T(9)), reg->TouchSession("s", "nobody", T(9)));
  same(reg->DeleteSession("s", "bob"), reg->DeleteSession("s", "nobody"));
  same(reg->GetRun("bob", "r").status(), reg->GetRun("nobody", "r").status());
  same(reg->TouchRun("bob", "r", T(9), 99), reg->TouchRun("nobody", "r", T(9), 99));
  same(reg->ListCheckpoints("bob", "r").status(), reg->ListCheckpoints("nobody", "r").status());
  same(reg->GetCheckpoint("bob", "r", "weights/c").status(), reg->GetCheckpoint("nobody", "r", "weights/c").status());
  same(reg->DeleteCheckpoint("bob", "r", "weights/c"), reg->DeleteCheckpoint("nobody", "r", "weights/c"));
  same(reg->PutCheckpoint(MakeCheckpoint("bob", "r", "c2", T(3))), reg->PutCheckpoint(MakeCheckpoint("nobody", "r", "c2", T(3))));
  same(reg->GetFuture(7, "bob").status(), reg->GetFuture(7, "nobody").status());

  // Messages name only the id, never the owner.
  EXPECT_EQ(reg->GetRun("bob", "r").status().message(), "run 'r' not found");
  EXPECT_EQ(reg->GetFuture(7, "bob").status().message(), "future 7 not found");
  EXPECT_EQ(reg->GetSession("s", "bob").status().message(), "session 's' not found");

  absl::StatusOr<std::vector<RunRecord>> bob_runs;
  int32_t total = -1;
  bob_runs = reg->ListRuns("bob", Page{}, &total);
  ASSERT_TRUE(bob_runs.ok());
  EXPECT_TRUE(bob_runs->empty());
  EXPECT_EQ(total, 0);

  // Nothing of alice's changed.
  absl::StatusOr<SessionRecord> s = reg->GetSession("s", "alice");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->last_heartbeat, T(0));
  absl::StatusOr<RunRecord> r = reg->GetRun("alice", "r");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->last_step, 3);
  EXPECT_EQ(r->last_request, T(1));
  EXPECT_TRUE(reg->GetCheckpoint("alice", "r", "weights/c").ok());
  EXPECT_TRUE(reg->GetFuture(7, "alice").ok());
  absl::StatusOr<std::vector<CheckpointRecord>> all = reg->AllCheckpoints();
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->size(), 1u);
  EXPECT_EQ((*all)[0].tenant, "alice");
}

TEST_F(RegistryTest, WritesNeverTakeOverAnotherTenantsId) {
  std::unique_ptr<Registry> reg = OpenOrDie();
  ASSERT_NE(reg, nullptr);
  ASSERT_TRUE(reg->PutSession("s", "alice", T(0)).ok());
  ASSERT_TRUE(reg->PutRun(MakeRun("alice", "r", T(0))).ok());
  FutureRecord f = MakeFuture(7, "alice", "pending", T(0));
  ASSERT_TRUE(reg->PutFuture(f).ok());

  absl::Status s = reg->PutSession("s", "bob", T(5));
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  RunRecord hijack = MakeRun("bob", "r", T(5));
  hijack.adapter_name = "bob's";
  s = reg->PutRun(hijack);
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  EXPECT_THAT(s.message(), ::testing::Not(HasSubstr("alice")));
  FutureRecord f2 = MakeFuture(7, "bob", "done", T(5));
  f2.result = "bob's";
  s = reg->PutFuture(f2);
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;

  absl::StatusOr<SessionRecord> sess = reg->GetSession("s", "alice");
  ASSERT_TRUE(sess.ok());
  EXPECT_EQ(sess->last_heartbeat, T(0));
  EXPECT_FALSE(reg->GetSession("s", "bob").ok());
  absl::StatusOr<RunRecord> run = reg->GetRun("alice", "r");
  ASSERT_TRUE(run.ok());
  ExpectRunEq(*run, MakeRun("alice", "r", T(0)));
  EXPECT_FALSE(reg->GetRun("bob", "r").ok());
  absl::StatusOr<FutureRecord> fut = reg->GetFuture(7, "alice");
  ASSERT_TRUE(fut.ok());
  ExpectFutureEq(*fut, f);
}

// ------------------------------------------------------------------------------------------ //
// Sessions and runs

TEST_F(RegistryTest, SessionPutTouchDelete) {
  std::unique_ptr<Registry> reg = OpenOrDie();
  ASSERT_NE(reg, nullptr);
  ASSERT_TRUE(reg->PutSession("s", "alice", T(0)).ok());
  ASSERT_TRUE(reg->PutSession("s", "alice", T(4)).ok());  // same tenant: a heartbeat, created kept
  absl::StatusOr<SessionRecord> sess = reg->GetSession("s", "alice");
  ASSERT_TRUE(sess.ok());
  EXPECT_EQ(sess->created, T(0));
  EXPECT_EQ(sess->last_heartbeat, T(4));
  ASSERT_TRUE(reg->TouchSession("s", "alice", T(8)).ok());
  EXPECT_EQ(reg->GetSession("s", "alice")->last_heartbeat, T(8));
  ASSERT_TRUE(reg->DeleteSession("s", "alice").ok());
  EXPECT_EQ(reg->GetSession("s", "alice").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(reg->DeleteSession("s", "alice").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(reg->TouchSession("s", "alice", T(9)).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(reg->PutSession("", "alice", T(0)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reg->PutSession("s", "", T(0)).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(RegistryTest, PutRunOverwritesTheSameTenantsRowAndTouchRunUpdatesProgress) {
  std::unique_ptr<Registry> reg = OpenOrDie();
  ASSERT_NE(reg, nullptr);
  ASSERT_TRUE(reg->PutRun(MakeRun("alice", "r", T(0))).ok());
  RunRecord updated = MakeRun("alice", "r", T(100));
  updated.adapter_name = "renamed";
  updated.base_model = "other/model";
  updated.lora_config_json = R"({"r":16})";
  updated.last_step = 77;
  ASSERT_TRUE(reg->PutRun(updated).ok());
  absl::StatusOr<RunRecord> got = reg->GetRun("alice", "r");
  ASSERT_TRUE(got.ok());
  ExpectRunEq(*got, updated);

  ASSERT_TRUE(reg->TouchRun("alice", "r", T(500), 78).ok());
  got = reg->GetRun("alice", "r");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->last_request, T(500));
  EXPECT_EQ(got->last_step, 78);
  EXPECT_EQ(got->created, T(100));
  EXPECT_EQ(got->adapter_name, "renamed");

  EXPECT_EQ(reg->TouchRun("alice", "unknown", T(1), 1).code(), absl::StatusCode::kNotFound);
  RunRecord bad = MakeRun("alice", "", T(0));
  EXPECT_EQ(reg->PutRun(bad).code(), absl::StatusCode::kInvalidArgument);
  bad = MakeRun("", "r2", T(0));
  EXPECT_EQ(reg->PutRun(bad).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RawInt("SELECT COUNT(*) FROM runs"), 1);
}

TEST_F(RegistryTest, RunUserMetadataIsKeptByPutRunAndScopedToTheTenant) {
  std::unique_ptr<Registry> reg = OpenOrDie();
  ASSERT_NE(reg, nullptr);
  ASSERT_TRUE(reg->PutRun(MakeRun("alice", "r", T(0))).ok());
  EXPECT_EQ(reg->GetRun("alice", "r")->user_metadata_json, "");
  ASSERT_TRUE(reg->SetRunUserMetadata("alice", "r", R"({"renderer_name":"qwen3"})").ok());
  ASSERT_TRUE(reg->PutRun(MakeRun("alice", "r", T(5))).ok());  // an upsert keeps it
  EXPECT_EQ(reg->GetRun("alice", "r")->user_metadata_json, R"({"renderer_name":"qwen3"})");
  int32_t total = 0;
  absl::StatusOr<std::vector<RunRecord>> runs = reg->ListRuns("alice", {}, &total);
  ASSERT_TRUE(runs.ok());
  EXPECT_EQ((*runs)[0].user_metadata_json, R"({"renderer_name":"qwen3"})");
  EXPECT_EQ(reg->SetRunUserMetadata("bob", "r", "{}").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(reg->SetRunUserMetadata("alice", "unknown", "{}").code(), absl::StatusCode::kNotFound);
}

TEST_F(RegistryTest, ListRunsPaginatesNewestFirstWithTotal) {
  std::unique_ptr<Registry> reg = OpenOrDie();
  ASSERT_NE(reg, nullptr);
  // 25 runs of alice, inserted out of time order, two sharing a created time (tie → run_id
  // descending), and bob's interleaved, which must not show or count.
  std::vector<std::string> expected;  // newest first
  for (int i = 0; i < 25; ++i) {
    const int k = (i * 7) % 25;  // a permutation of 0..24
    const absl::Time created = k == 24 ? T(23) : T(k);  // k = 23 and 24 tie
    ASSERT_TRUE(reg->PutRun(MakeRun("alice", "run-" + std::to_string(100 + k), created)).ok());
    ASSERT_TRUE(reg->PutRun(MakeRun("bob", "bob-" + std::to_string(k), T(1000 + k))).ok());
  }
  for (int k = 24; k >= 0; --k) expected.push_back("run-" + std::to_string(100 + k));
  // k = 24 and 23 tie at T(23): run-124 > run-123, so 124 first, as pushed.

  std::vector<std::string> seen;
  for (int offset = 0; offset < 30; offset += 10) {
    int32_t total = -1;
    absl::StatusOr<std::vector<RunRecord>> page = reg->ListRuns("alice", Page{10, offset}, &total);
    ASSERT_TRUE(page.ok()) << page.status();
    EXPECT_EQ(total, 25);
    EXPECT_EQ(page->size(), offset == 20 ? 5u : 10u);
    for (const RunRecord& r : *page) {
      EXPECT_EQ(r.tenant, "alice");
      seen.push_back(r.run_id);
    }
  }
  EXPECT_EQ(seen, expected);

  int32_t total = -1;
  absl::StatusOr<std::vector<RunRecord>> page = reg->ListRuns("alice", Page{10, 25}, &total);
  ASSERT_TRUE(page.ok());
  EXPECT_TRUE(page->empty());
  EXPECT_EQ(total, 25);
  page = reg->ListRuns("alice", Page{0, 0}, &total);
  ASSERT_TRUE(page.ok());
  EXPECT_TRUE(page->empty());
  EXPECT_EQ(total, 25);
  page = reg->ListRuns("alice", Page{}, nullptr);  // default page, no total wanted
  ASSERT_TRUE(page.ok());
  ASSERT_EQ(page->size(), 20u);
  EXPECT_EQ((*page)[0].run_id, "run-124");
  page = reg->ListRuns("bob", Page{3, 0}, &total);
  ASSERT_TRUE(page.ok());
  EXPECT_EQ(total, 25);
  ASSERT_EQ(page->size(), 3u);
  EXPECT_EQ((*page)[0].run_id, "bob-24");

  EXPECT_EQ(reg->ListRuns("alice", Page{-1, 0}, &total).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reg->ListRuns("alice", Page{10, -1}, &total).status().code(), absl::StatusCode::kInvalidArgument);
}

// ------------------------------------------------------------------------------------------ //
// Checkpoints

TEST_F(RegistryTest, CheckpointsReplaceByKeyListByTimeAndDelete) {
  std::unique_ptr<Registry> reg = OpenOrDie();
  ASSERT_NE(reg, nullptr);
  ASSERT_TRUE(reg->PutRun(MakeRun("alice", "r", T(0))).ok());
  ASSERT_TRUE(reg->PutRun(MakeRun("alice", "r2", T(0))).ok());
  ASSERT_TRUE(reg->PutRun(MakeRun("bob", "b", T(0))).ok());

  ASSERT_TRUE(reg->PutCheckpoint(MakeCheckpoint("alice", "r", "late", T(30))).ok());
  ASSERT_TRUE(reg->PutCheckpoint(MakeCheckpoint("alice", "r", "early", T(10))).ok());
  CheckpointRecord sampler = MakeCheckpoint("alice", "r", "x", T(20));
  sampler.checkpoint_id = "sampler_weights/x";
  sampler.kind = "sampler";
  ASSERT_TRUE(reg->PutCheckpoint(sampler).ok());
  ASSERT_TRUE(reg->PutCheckpoint(MakeCheckpoint("alice", "r2", "early", T(5))).ok());  // same name, other run
  ASSERT_TRUE(reg->PutCheckpoint(MakeCheckpoint("bob", "b", "early", T(1))).ok());

  // Replace by (tenant, run_id, checkpoint_id): one row, the new values.
  CheckpointRecord replaced = MakeCheckpoint("alice", "r", "early", T(40));
  replaced.path = "/elsewhere";
  replaced.size_bytes = 1;
  ASSERT_TRUE(reg->PutCheckpoint(replaced).ok());
  absl::StatusOr<CheckpointRecord> got = reg->GetCheckpoint("alice", "r", "weights/early");
  ASSERT_TRUE(got.ok());
  ExpectCheckpointEq(*got, replaced);
  EXPECT_EQ(RawInt("SELECT COUNT(*) FROM checkpoints WHERE run_id = 'r'"), 3);

  absl::StatusOr<std::vector<CheckpointRecord>> list = reg->ListCheckpoints("alice", "r");
  ASSERT_TRUE(list.ok());
  std::vector<std::string> ids;
  for (const CheckpointRecord& c : *list) ids.push_back(c.checkpoint_id);
  EXPECT_THAT(ids, ElementsAre("sampler_weights/x", "weights/late", "weights/early"));  // 20, 30, 40

  absl::StatusOr<std::vector<CheckpointRecord>> all = reg->AllCheckpoints();
  ASSERT_TRUE(all.ok());
  std::vector<std::string> keys;
  for (const CheckpointRecord& c : *all) keys.push_back(c.tenant + "/" + c.run_id + "/" + c.checkpoint_id);
  EXPECT_THAT(keys, ElementsAre("alice/r/sampler_weights/x", "alice/r/weights/late", "alice/r/weights/early",
                                "alice/r2/weights/early", "bob/b/weights/early"));

  ASSERT_TRUE(reg->DeleteCheckpoint("alice", "r", "weights/late").ok());
  EXPECT_EQ(reg->GetCheckpoint("alice", "r", "weights/late").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(reg->DeleteCheckpoint("alice", "r", "weights/late").code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(reg->GetCheckpoint("alice", "r2", "weights/early").ok());  // other run untouched

  // A run without checkpoints lists empty; an unknown run is NotFound like GetRun.
  ASSERT_TRUE(reg->PutRun(MakeRun("alice", "empty", T(0))).ok());
  list = reg->ListCheckpoints("alice", "empty");
  ASSERT_TRUE(list.ok());
  EXPECT_TRUE(list->empty());
  absl::Status unknown = reg->ListCheckpoints("alice", "nope").status();
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(unknown.message(), reg->GetRun("alice", "nope").status().message());

  // Validation.
  CheckpointRecord bad = MakeCheckpoint("alice", "r", "bad", T(0));
  bad.kind = "weights";
  EXPECT_EQ(reg->PutCheckpoint(bad).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reg->PutCheckpoint(MakeCheckpoint("alice", "no-run", "c", T(0))).code(), absl::StatusCode::kNotFound);
  bad = MakeCheckpoint("alice", "r", "c", T(0));
  bad.checkpoint_id = "";
  EXPECT_EQ(reg->PutCheckpoint(bad).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RawInt("SELECT COUNT(*) FROM checkpoints"), 4);
}

// ------------------------------------------------------------------------------------------ //
// Futures

TEST_F(RegistryTest, FutureLifecycleInterruptExpireAndMaxId) {
  {
    std::unique_ptr<Registry> reg = OpenOrDie();
    ASSERT_NE(reg, nullptr);
    absl::StatusOr<uint64_t> max_id = reg->MaxFutureId();
    ASSERT_TRUE(max_id.ok());
    EXPECT_EQ(*max_id, 0u);

    // pending → done by upsert.
    ASSERT_TRUE(reg->PutFuture(MakeFuture(1, "alice", "pending", T(0))).ok());
    FutureRecord done = MakeFuture(1, "alice", "done", T(0));
    done.updated = T(5);
    done.result = std::string("{\"loss\":1.5}\0tail", 17);
    ASSERT_TRUE(reg->PutFuture(done).ok());
    absl::StatusOr<FutureRecord> got = reg->GetFuture(1, "alice");
    ASSERT_TRUE(got.ok());
    ExpectFutureEq(*got, done);

    FutureRecord failed = MakeFuture(2, "alice", "failed", T(1));
    failed.updated = T(6);
    failed.error_code = static_cast<int32_t>(absl::StatusCode::kInvalidArgument);
    failed.error_message = "token id 99999 is outside the vocabulary";
    ASSERT_TRUE(reg->PutFuture(failed).ok());
    ASSERT_TRUE(reg->PutFuture(MakeFuture(3, "bob", "pending", T(2))).ok());
    ASSERT_TRUE(reg->PutFuture(MakeFuture(10, "alice", "pending", T(3))).ok());
    ASSERT_TRUE(reg->PutFuture(MakeFuture(4, "bob", "done", T(100))).ok());
    // An unclean stop: pending 3 and 10 stay pending in the file.
  }
  std::unique_ptr<Registry> reg = OpenOrDie();
  ASSERT_NE(reg, nullptr);
  EXPECT_EQ(*reg->MaxFutureId(), 10u);

  absl::StatusOr<int64_t> interrupted = reg->InterruptPendingFutures(T(50));
  ASSERT_TRUE(interrupted.ok());
  EXPECT_EQ(*interrupted, 2);
  for (auto [id, tenant] : {std::pair<uint64_t, const char*>{3, "bob"}, {10, "alice"}}) {
    absl::StatusOr<FutureRecord> f = reg->GetFuture(id, tenant);
    ASSERT_TRUE(f.ok());
    EXPECT_EQ(f->state, "interrupted");
    EXPECT_EQ(f->updated, T(50));
    EXPECT_EQ(f->error_code, static_cast<int32_t>(absl::StatusCode::kAborted));
    EXPECT_THAT(f->error_message, HasSubstr("interrupted by a restart"));
  }
  // Finished ones are untouched.
  EXPECT_EQ(reg->GetFuture(1, "alice")->state, "done");
  EXPECT_EQ(reg->GetFuture(2, "alice")->error_message, "token id 99999 is outside the vocabulary");
  EXPECT_EQ(*reg->InterruptPendingFutures(T(60)), 0);

  // A new pending future after restart; expiry never drops it, however old.
  ASSERT_TRUE(reg->PutFuture(MakeFuture(11, "alice", "pending", T(-1000))).ok());
  // cutoff T(50): drops 1 (T5) and 2 (T6); keeps 3/10 (updated T50, not before the cutoff),
  // 4 (T100), 11 (pending).
  absl::StatusOr<int64_t> expired = reg->ExpireFutures(T(50));
  ASSERT_TRUE(expired.ok());
  EXPECT_EQ(*expired, 2);
  EXPECT_EQ(reg->GetFuture(1, "alice").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(reg->GetFuture(2, "alice").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(reg->GetFuture(3, "bob").ok());
  EXPECT_TRUE(reg->GetFuture(10, "alice").ok());
  EXPECT_TRUE(reg->GetFuture(4, "bob").ok());
  EXPECT_TRUE(reg->GetFuture(11, "alice").ok());

  expired = reg->ExpireFutures(T(1000));
  ASSERT_TRUE(expired.ok());
  EXPECT_EQ(*expired, 3);  // 3, 10, 4
  EXPECT_EQ(RawInt("SELECT COUNT(*) FROM futures"), 1);  // 11, pending
  EXPECT_EQ(*reg->MaxFutureId(), 11u);
  // The high-water mark survives the rows that set it.
  ASSERT_TRUE(reg->PutFuture(MakeFuture(11, "alice", "done", T(1))).ok());
  EXPECT_EQ(*reg->ExpireFutures(T(1000)), 1);
  EXPECT_EQ(RawInt("SELECT COUNT(*) FROM futures"), 0);
  EXPECT_EQ(*reg->MaxFutureId(), 11u);
  reg.reset();
  reg = OpenOrDie();
  ASSERT_NE(reg, nullptr);
  EXPECT_EQ(*reg->MaxFutureId(), 11u);
  // A lower id does not lower it.
  ASSERT_TRUE(reg->PutFuture(MakeFuture(5, "alice", "done", T(1))).ok());
  EXPECT_EQ(*reg->MaxFutureId(), 11u);
}

TEST_F(RegistryTest, FutureIdRangeAndValidation) {
  std::unique_ptr<Registry> reg = OpenOrDie();
  ASSERT_NE(reg, nullptr);
  const uint64_t max_ok = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  ASSERT_TRUE(reg->PutFuture(MakeFuture(max_ok, "alice", "done", T(0))).ok());
  absl::StatusOr<FutureRecord> got = reg->GetFuture(max_ok, "alice");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->id, max_ok);
  EXPECT_EQ(*reg->MaxFutureId(), max_ok);

  absl::Status s = reg->PutFuture(MakeFuture(max_ok + 1, "alice", "done", T(0)));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("2^63"));
  EXPECT_EQ(reg->PutFuture(MakeFuture(0, "alice", "done", T(0))).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reg->PutFuture(MakeFuture(std::numeric_limits<uint64_t>::max(), "alice", "done", T(0))).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reg->GetFuture(max_ok + 1, "alice").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(reg->GetFuture(0, "alice").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(reg->PutFuture(MakeFuture(9, "alice", "running", T(0))).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RawInt("SELECT COUNT(*) FROM futures"), 1);
  EXPECT_EQ(*reg->MaxFutureId(), max_ok);

  // A tenant-less bookkeeping row (the coordinator's boot marker): stored, private to "".
  ASSERT_TRUE(reg->PutFuture(MakeFuture(uint64_t{3} << 40, "", "done", T(0))).ok());
  EXPECT_TRUE(reg->GetFuture(uint64_t{3} << 40, "").ok());
  EXPECT_EQ(reg->GetFuture(uint64_t{3} << 40, "alice").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(reg->PutFuture(MakeFuture(uint64_t{3} << 40, "alice", "done", T(0))).code(),
            absl::StatusCode::kAlreadyExists);
}

// ------------------------------------------------------------------------------------------ //
// Durability and concurrency

TEST_F(RegistryTest, CommittedRowsSurviveAKilledProcess) {
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // The child: write, then die without closing anything (no destructor, no checkpoint).
    absl::StatusOr<std::unique_ptr<Registry>> reg = Registry::Open(path_);
    if (!reg.ok()) _exit(2);
    if (!(*reg)->PutRun(MakeRun("alice", "r", T(0))).ok()) _exit(3);
    if (!(*reg)->PutCheckpoint(MakeCheckpoint("alice", "r", "c", T(1))).ok()) _exit(4);
    if (!(*reg)->PutSession("s", "alice", T(2)).ok()) _exit(5);
    for (uint64_t id = 1; id <= 50; ++id) {
      if (!(*reg)->PutFuture(MakeFuture(id, "alice", "pending", T(3))).ok()) _exit(6);
    }
    raise(SIGKILL);
    _exit(7);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status)) << "child exited with " << WEXITSTATUS(status);
  ASSERT_EQ(WTERMSIG(status), SIGKILL);
  // The rows live in the WAL, not yet in the main file: recovery is what is being tested.
  ASSERT_TRUE(fs::exists(path_ + "-wal"));
  EXPECT_GT(fs::file_size(path_ + "-wal"), 0u);

  std::unique_ptr<Registry> reg = OpenOrDie();
  ASSERT_NE(reg, nullptr);
  EXPECT_TRUE(reg->GetRun("alice", "r").ok());
  EXPECT_TRUE(reg->GetCheckpoint("alice", "r", "weights/c").ok());
  EXPECT_TRUE(reg->GetSession("s", "alice").ok());
  EXPECT_EQ(*reg->MaxFutureId(), 50u);
  EXPECT_EQ(*reg->InterruptPendingFutures(T(10)), 50);
}

TEST_F(RegistryTest, ReopenAfterDestroyWithoutCloseKeepsRows) {
  // Two live handles on one file, the first dropped without any explicit close while the
  // second has already been written through: both writers' rows persist.
  std::unique_ptr<Registry> first = OpenOrDie();
  std::unique_ptr<Registry> second = OpenOrDie();
  ASSERT_NE(first, nullptr);
  ASSERT_NE(second, nullptr);
  ASSERT_TRUE(first->PutRun(MakeRun("alice", "a", T(0))).ok());
  ASSERT_TRUE(second->PutRun(MakeRun("alice", "b", T(1))).ok());
  EXPECT_TRUE(second->GetRun("alice", "a").ok());  // visible across connections
  first.reset();
  second.reset();
  std::unique_ptr<Registry> reg = OpenOrDie();
  ASSERT_NE(reg, nullptr);
  int32_t total = 0;
  ASSERT_TRUE(reg->ListRuns("alice", Page{}, &total).ok());
  EXPECT_EQ(total, 2);
}

TEST_F(RegistryTest, ConcurrentWritersFromManyThreads) {
  std::unique_ptr<Registry> reg = OpenOrDie();
  ASSERT_NE(reg, nullptr);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 40; ++i) {
        const uint64_t id = static_cast<uint64_t>(t * 1000 + i + 1);
        EXPECT_TRUE(reg->PutFuture(MakeFuture(id, "tenant-" + std::to_string(t), "done", T(i))).ok());
        EXPECT_TRUE(reg->GetFuture(id, "tenant-" + std::to_string(t)).ok());
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(RawInt("SELECT COUNT(*) FROM futures"), 320);
  EXPECT_EQ(*reg->MaxFutureId(), 7040u);
}

// ------------------------------------------------------------------------------------------ //
// Inputs that look like SQL are data

TEST_F(RegistryTest, InjectionLookingInputsAreStoredVerbatim) {
  const std::string tenant = "t' OR '1'='1";
  const std::string run_id = "r'); DROP TABLE runs; --";
  const std::string ckpt_name = "c\"; DELETE FROM checkpoints; --";
  const std::string session = "s'; UPDATE sessions SET tenant='x'; --";
  std::unique_ptr<Registry> reg = OpenOrDie();
  ASSERT_NE(reg, nullptr);
  ASSERT_TRUE(reg->PutRun(MakeRun("victim", "v", T(0))).ok());
  ASSERT_TRUE(reg->PutCheckpoint(MakeCheckpoint("victim", "v", "vc", T(0))).ok());
  ASSERT_TRUE(reg->PutSession("victim-session", "victim", T(0)).ok());

  RunRecord run = MakeRun(tenant, run_id, T(1));
  run.adapter_name = "Robert'); DROP TABLE runs;--";
  run.base_model = "%s %n ? ?1 :name @x $y \\ \n\t";
  run.lora_config_json = R"({"target_modules":["q'\"; DROP TABLE checkpoints; --"],"r":8})";
  ASSERT_TRUE(reg->PutRun(run).ok());
  CheckpointRecord ckpt = MakeCheckpoint(tenant, run_id, ckpt_name, T(2));
  ckpt.path = "/data/it's \"quoted\"/; DROP TABLE futures; --/ünïcödé";
  ASSERT_TRUE(reg->PutCheckpoint(ckpt).ok());
  ASSERT_TRUE(reg->PutSession(session, tenant, T(3)).ok());
  FutureRecord f = MakeFuture(99, tenant, "failed", T(4));
  f.error_message = "'; DROP TABLE futures; --";
  f.result = std::string("a\0'b\0\"c", 7);
  ASSERT_TRUE(reg->PutFuture(f).ok());

  // Read back byte for byte, also after a reopen.
  reg.reset();
  reg = OpenOrDie();
  ASSERT_NE(reg, nullptr);
  absl::StatusOr<RunRecord> got_run = reg->GetRun(tenant, run_id);
  ASSERT_TRUE(got_run.ok()) << got_run.status();
  ExpectRunEq(*got_run, run);
  absl::StatusOr<CheckpointRecord> got_ckpt = reg->GetCheckpoint(tenant, run_id, "weights/" + ckpt_name);
  ASSERT_TRUE(got_ckpt.ok()) << got_ckpt.status();
  ExpectCheckpointEq(*got_ckpt, ckpt);
  absl::StatusOr<SessionRecord> got_sess = reg->GetSession(session, tenant);
  ASSERT_TRUE(got_sess.ok());
  EXPECT_EQ(got_sess->id, session);
  absl::StatusOr<FutureRecord> got_f = reg->GetFuture(99, tenant);
  ASSERT_TRUE(got_f.ok());
  ExpectFutureEq(*got_f, f);

  // Every table is still there and the victim's rows are intact and private.
  for (const char* table : {"sessions", "runs", "checkpoints", "futures", "counters"}) {
    EXPECT_EQ(RawInt(std::string("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = '") + table + "'"),
              1)
        << table;
  }
  EXPECT_TRUE(reg->GetRun("victim", "v").ok());
  EXPECT_TRUE(reg->GetCheckpoint("victim", "v", "weights/vc").ok());
  EXPECT_EQ(reg->GetSession("victim-session", "victim")->tenant, "victim");
  EXPECT_EQ(reg->GetRun(tenant, "v").status().code(), absl::StatusCode::kNotFound);
  int32_t total = -1;
  absl::StatusOr<std::vector<RunRecord>> runs = reg->ListRuns(tenant, Page{}, &total);
  ASSERT_TRUE(runs.ok());
  EXPECT_EQ(total, 1);
  ASSERT_EQ(runs->size(), 1u);
  EXPECT_EQ((*runs)[0].run_id, run_id);
  absl::StatusOr<std::vector<CheckpointRecord>> ckpts = reg->ListCheckpoints(tenant, run_id);
  ASSERT_TRUE(ckpts.ok());
  ASSERT_EQ(ckpts->size(), 1u);
  EXPECT_EQ((*ckpts)[0].path, ckpt.path);
  // Deletes match exactly, not by pattern.
  EXPECT_EQ(reg->DeleteCheckpoint(tenant, run_id, "weights/%").code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(reg->DeleteCheckpoint(tenant, run_id, "weights/" + ckpt_name).ok());
  EXPECT_EQ(RawInt("SELECT COUNT(*) FROM checkpoints"), 1);
}

// ---- schema v3: keys, usage, audit, session metadata ----------------------------------------

ApiKeyRecord ConfigKey(const std::string& tenant, const std::string& digest, const std::string& role) {
  ApiKeyRecord k;
  k.tenant = tenant;
  k.key_sha256 = digest;
  k.role = role;
  k.name = tenant;
  return k;
}

TEST_F(RegistryTest, BootstrapKeysIsIdempotentAndKeepsRevocations) {
  std::unique_ptr<Registry> reg = OpenOrDie();
  const std::string a(64, 'a'), b(64, 'b'), c(64, 'c');
  const absl::Time t = absl::FromUnixSeconds(1000);
  ASSERT_TRUE(reg->BootstrapConfigKeys({ConfigKey("alice", a, "member"), ConfigKey("ops", b, "admin")}, t).ok());
  ASSERT_TRUE(reg->BootstrapConfigKeys({ConfigKey("alice", a, "member"), ConfigKey("ops", b, "admin")}, t).ok());
  absl::StatusOr<std::vector<ApiKeyRecord>> keys = reg->ListKeys("");
  ASSERT_TRUE(keys.ok());
  ASSERT_EQ(keys->size(), 2u);
  const int64_t alice_id = (*keys)[0].key_id;
  EXPECT_TRUE((*keys)[0].active());
  // An admin revocation survives the next bootstrap; a role change in the config applies.
  ASSERT_TRUE(reg->RevokeKey(alice_id, t).ok());
  ASSERT_TRUE(reg->BootstrapConfigKeys({ConfigKey("alice", a, "read-only"), ConfigKey("ops", b, "admin")}, t).ok());
  absl::StatusOr<ApiKeyRecord> alice = reg->GetKey(alice_id);
  ASSERT_TRUE(alice.ok());
  EXPECT_FALSE(alice->active());
  EXPECT_EQ(alice->role, "read-only");
  // A key dropped from the config is revoked.
  ASSERT_TRUE(reg->BootstrapConfigKeys({ConfigKey("alice", a, "member"), ConfigKey("bob", c, "member")}, t).ok());
  keys = reg->ListKeys("ops");
  ASSERT_TRUE(keys.ok());
  ASSERT_EQ(keys->size(), 1u);
  EXPECT_FALSE((*keys)[0].active());
  EXPECT_EQ(RawInt("SELECT COUNT(*) FROM tenants"), 3);
  EXPECT_EQ(RawInt("PRAGMA user_version"), Registry::kSchemaVersion);
}

TEST_F(RegistryTest, InsertRotateAndRoleOfRuntimeKeys) {
  std::unique_ptr<Registry> reg = OpenOrDie();
  const absl::Time t = absl::FromUnixSeconds(2000);
  ApiKeyRecord k = ConfigKey("carol", std::string(64, 'd'), "member");
  k.source = "admin";
  k.created = t;
  EXPECT_EQ(reg->InsertKey(k).status().code(), absl::StatusCode::kNotFound);  // no such tenant
  ASSERT_TRUE(reg->PutTenant("carol", "admin", t).ok());
  absl::StatusOr<ApiKeyRecord> inserted = reg->InsertKey(k);
  ASSERT_TRUE(inserted.ok()) << inserted.status();
  EXPECT_GT(inserted->key_id, 0);
  EXPECT_EQ(reg->InsertKey(k).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(reg->SetKeyRole(inserted->key_id, "root").status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<ApiKeyRecord> rotated = reg->RotateKey(inserted->key_id, std::string(64, 'e'), t);
  ASSERT_TRUE(rotated.ok()) << rotated.status();
  EXPECT_NE(rotated->key_id, inserted->key_id);
  EXPECT_EQ(rotated->tenant, "carol");
  EXPECT_FALSE(reg->GetKey(inserted->key_id)->active());
  EXPECT_EQ(reg->RotateKey(inserted->key_id, std::string(64, 'f'), t).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(reg->GetKey(999).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(RegistryTest, UsageAddsUpPerBucketAndKind) {
  std::unique_ptr<Registry> reg = OpenOrDie();
  const absl::Time hour = absl::FromUnixSeconds(3600 * 10);
  UsageRecord u{hour, "alice", 1, "s1", "run", "training", 7};
  ASSERT_TRUE(reg->AddUsage({u, u}).ok());
  u.kind = "sampled";
  u.amount = 3;
  ASSERT_TRUE(reg->AddUsage({u}).ok());
  absl::StatusOr<std::vector<UsageRecord>> rows = reg->ListUsage("alice", hour, hour + absl::Hours(1));
  ASSERT_TRUE(rows.ok());
  ASSERT_EQ(rows->size(), 2u);
  EXPECT_EQ((*rows)[0].kind, "sampled");
  EXPECT_EQ((*rows)[0].amount, 3);
  EXPECT_EQ((*rows)[1].amount, 14);
  EXPECT_TRUE(reg->ListUsage("bob", hour, hour + absl::Hours(1))->empty());
  EXPECT_TRUE(reg->ListUsage("", hour + absl::Hours(1), hour + absl::Hours(2))->empty());
}

TEST_F(RegistryTest, UsageAndSamplingSessionsAreKeptPerBaseModel) {
  std::unique_ptr<Registry> reg = OpenOrDie();
  const absl::Time hour = absl::FromUnixSeconds(3600 * 10);
  UsageRecord u{hour, "alice", 1, "s1", "", "sampled", 5, "model-a"};
  UsageRecord v = u;
  v.base_model = "model-b";
  ASSERT_TRUE(reg->AddUsage({u, v, v}).ok());
  absl::StatusOr<std::vector<UsageRecord>> rows = reg->ListUsage("alice", hour, hour + absl::Hours(1));
  ASSERT_TRUE(rows.ok());
  ASSERT_EQ(rows->size(), 2u);
  EXPECT_EQ((*rows)[0].base_model, "model-a");
  EXPECT_EQ((*rows)[0].amount, 5);
  EXPECT_EQ((*rows)[1].base_model, "model-b");
  EXPECT_EQ((*rows)[1].amount, 10);

  SamplingSessionRecord session{"ss1", "alice", "", "", false, hour, "model-b"};
  ASSERT_TRUE(reg->PutSamplingSession(session).ok());
  absl::StatusOr<std::vector<SamplingSessionRecord>> sessions = reg->ListSamplingSessions();
  ASSERT_TRUE(sessions.ok());
  ASSERT_EQ(sessions->size(), 1u);
  EXPECT_EQ((*sessions)[0].base_model, "model-b");
}

TEST_F(RegistryTest, V5UsageAndSamplingSessionsMigrateToTheDefaultModel) {
  // The v5 shape of the two tables v6 changes, with a row in each.
  RawExec(R"sql(
CREATE TABLE usage (bucket_us INTEGER NOT NULL, tenant TEXT NOT NULL, key_id INTEGER NOT NULL,
  session_id TEXT NOT NULL, run_id TEXT NOT NULL, kind TEXT NOT NULL, amount INTEGER NOT NULL,
  PRIMARY KEY (bucket_us, tenant, key_id, session_id, run_id, kind)) WITHOUT ROWID;
INSERT INTO usage VALUES (36000000000, 'alice', 1, 's1', 'run', 'training', 42);
CREATE TABLE sampling_sessions (id TEXT NOT NULL PRIMARY KEY, tenant TEXT NOT NULL, model_path TEXT NOT NULL,
  owner TEXT NOT NULL, live INTEGER NOT NULL CHECK (live IN (0, 1)), created_us INTEGER NOT NULL) WITHOUT ROWID;
INSERT INTO sampling_sessions VALUES ('ss1', 'alice', '', '', 0, 7);
PRAGMA user_version = 5;
)sql");
  std::unique_ptr<Registry> reg = OpenOrDie();
  ASSERT_NE(reg, nullptr);
  EXPECT_EQ(RawInt("PRAGMA user_version"), Registry::kSchemaVersion);
  const absl::Time hour = absl::FromUnixSeconds(3600 * 10);
  absl::StatusOr<std::vector<UsageRecord>> rows = reg->ListUsage("alice", hour, hour + absl::Hours(1));
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 1u);
  EXPECT_EQ((*rows)[0].amount, 42);
  EXPECT_EQ((*rows)[0].base_model, "");
  // The old key still adds up: the same row (base model '') grows.
  ASSERT_TRUE(reg->AddUsage({UsageRecord{hour, "alice", 1, "s1", "run", "training", 8}}).ok());
  EXPECT_EQ(reg->ListUsage("alice", hour, hour + absl::Hours(1))->at(0).amount, 50);
  absl::StatusOr<std::vector<SamplingSessionRecord>> sessions = reg->ListSamplingSessions();
  ASSERT_TRUE(sessions.ok()) << sessions.status();
  ASSERT_EQ(sessions->size(), 1u);
  EXPECT_EQ((*sessions)[0].id, "ss1");
  EXPECT_EQ((*sessions)[0].base_model, "");
}

TEST_F(RegistryTest, AuditRowsAreAppendOnlyAndExpire) {
  std::unique_ptr<Registry> reg = OpenOrDie();
  AuditRecord a;
  a.at = absl::FromUnixSeconds(100);
  a.tenant = "ops";
  a.key_id = 3;
  a.action = "key_create";
  a.object = "key:4";
  a.peer = "127.0.0.1:5";
  ASSERT_TRUE(reg->AppendAudit(a).ok());
  a.at = absl::FromUnixSeconds(200);
  ASSERT_TRUE(reg->AppendAudit(a).ok());
  a.action = "";
  EXPECT_EQ(reg->AppendAudit(a).status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::vector<AuditRecord>> rows =
      reg->ListAudit("", absl::FromUnixSeconds(0), absl::FromUnixSeconds(1000), 10);
  ASSERT_TRUE(rows.ok());
  ASSERT_EQ(rows->size(), 2u);
  EXPECT_EQ((*rows)[0].details_json, "{}");
  // UPDATE is refused by the schema itself.
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open_v2(path_.c_str(), &db, SQLITE_OPEN_READWRITE, nullptr), SQLITE_OK);
  char* err = nullptr;
  EXPECT_NE(sqlite3_exec(db, "UPDATE audit SET action = 'x'", nullptr, nullptr, &err), SQLITE_OK);
  EXPECT_THAT(std::string(err ? err : ""), HasSubstr("append-only"));
  sqlite3_free(err);
  sqlite3_close(db);
  absl::StatusOr<int64_t> expired = reg->ExpireAudit(absl::FromUnixSeconds(150));
  ASSERT_TRUE(expired.ok());
  EXPECT_EQ(*expired, 1);
}

TEST_F(RegistryTest, SessionMetadataListAndSearchPaging) {
  std::unique_ptr<Registry> reg = OpenOrDie();
  for (int i = 0; i < 5; ++i) {
    const std::string id = absl::StrCat("s", i);
    ASSERT_TRUE(reg->PutSession(id, "alice", absl::FromUnixSeconds(100 + i)).ok());
    SessionRecord m;
    m.id = id;
    m.tenant = "alice";
    m.user_metadata_json = i % 2 == 0 ? R"({"team":"rl"})" : R"({"team":"sft"})";
    m.display_name = absl::StrCat("Run number ", i);
    ASSERT_TRUE(reg->SetSessionMetadata(m).ok());
  }
  ASSERT_TRUE(reg->PutSession("b0", "bob", absl::FromUnixSeconds(50)).ok());
  SessionRecord other;
  other.id = "s0";
  other.tenant = "bob";
  EXPECT_EQ(reg->SetSessionMetadata(other).code(), absl::StatusCode::kNotFound);
  int32_t total = 0;
  absl::StatusOr<std::vector<SessionRecord>> page = reg->ListSessions("alice", {2, 1}, &total);
  ASSERT_TRUE(page.ok());
  EXPECT_EQ(total, 5);
  ASSERT_EQ(page->size(), 2u);
  EXPECT_EQ((*page)[0].id, "s3");  // newest first
  SessionFilter f;
  f.user_metadata = {{"team", "rl"}};
  std::vector<std::string> seen;
  for (;;) {
    absl::StatusOr<std::vector<SessionRecord>> rows = reg->SearchSessions("alice", f, 1);
    ASSERT_TRUE(rows.ok());
    if (rows->empty()) break;
    seen.push_back(rows->front().id);
    f.after = std::make_pair(rows->front().created, rows->front().id);
  }
  EXPECT_THAT(seen, ElementsAre("s4", "s2", "s0"));
  SessionFilter name;
  name.display_name = "NUMBER 3";
  EXPECT_EQ(reg->SearchSessions("alice", name, 10)->size(), 1u);
  EXPECT_TRUE(reg->SearchSessions("bob", name, 10)->empty());
  ASSERT_TRUE(reg->SetSessionProject("s1", "alice", "p").ok());
  ASSERT_TRUE(reg->FinishSession("s1", "alice", absl::FromUnixSeconds(900)).ok());
  absl::StatusOr<SessionRecord> s1 = reg->GetSession("s1", "alice");
  ASSERT_TRUE(s1.ok());
  EXPECT_EQ(s1->project_id, "p");
  EXPECT_EQ(s1->finished, absl::FromUnixSeconds(900));
  EXPECT_EQ(reg->SearchSessions("alice", name, -1).status().code(), absl::StatusCode::kInvalidArgument);
}

// ------------------------------------------------------------------------------------------ //
// Retention and sharing (schema v4)

TEST_F(RegistryTest, MigratesAVersion2FileKeepingItsCheckpoints) {
  // The v2 shape of the tables the later migrations change (sessions: v3 adds its metadata;
  // checkpoints: v4 rebuilds it), with one checkpoint in it.
  RawExec(R"sql(
CREATE TABLE sessions (id TEXT NOT NULL PRIMARY KEY, tenant TEXT NOT NULL, created_us INTEGER NOT NULL,
  last_heartbeat_us INTEGER NOT NULL);
CREATE INDEX sessions_by_tenant ON sessions(tenant);
CREATE TABLE runs (run_id TEXT NOT NULL PRIMARY KEY, tenant TEXT NOT NULL, adapter_name TEXT NOT NULL,
  base_model TEXT NOT NULL, lora_config_json TEXT NOT NULL, created_us INTEGER NOT NULL,
  last_request_us INTEGER NOT NULL, last_step INTEGER NOT NULL, user_metadata_json TEXT NOT NULL DEFAULT '');
CREATE UNIQUE INDEX runs_tenant_run ON runs(tenant, run_id);
CREATE TABLE checkpoints (tenant TEXT NOT NULL, run_id TEXT NOT NULL, checkpoint_id TEXT NOT NULL,
  kind TEXT NOT NULL CHECK (kind IN ('training', 'sampler')), path TEXT NOT NULL, size_bytes INTEGER NOT NULL,
  created_us INTEGER NOT NULL, PRIMARY KEY (tenant, run_id, checkpoint_id),
  FOREIGN KEY (tenant, run_id) REFERENCES runs(tenant, run_id) ON DELETE CASCADE) WITHOUT ROWID;
INSERT INTO runs VALUES ('r', 'alice', 'a', 'm', '{}', 1, 1, 0, '');
INSERT INTO checkpoints VALUES ('alice', 'r', 'weights/c', 'training', '/p', 42, 7);
PRAGMA user_version = 2;
)sql");
  std::unique_ptr<Registry> reg = OpenOrDie();
  ASSERT_NE(reg, nullptr);
  EXPECT_EQ(RawInt("PRAGMA user_version"), Registry::kSchemaVersion);
  absl::StatusOr<CheckpointRecord> c = reg->GetCheckpoint("alice", "r", "weights/c");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->size_bytes, 42);
  EXPECT_FALSE(c->expires.has_value());
  EXPECT_FALSE(c->published);
}

TEST_F(RegistryTest, ExpiryIsStoredSetClearedAndListedWhenDue) {
  std::unique_ptr<Registry> reg = OpenOrDie();
  ASSERT_NE(reg, nullptr);
  ASSERT_TRUE(reg->PutRun(MakeRun("alice", "r", T(0))).ok());
  CheckpointRecord a = MakeCheckpoint("alice", "r", "a", T(1));
  a.expires = T(100);
  ASSERT_TRUE(reg->PutCheckpoint(a).ok());
  ASSERT_TRUE(reg->PutCheckpoint(MakeCheckpoint("alice", "r", "b", T(2))).ok());
  EXPECT_EQ(reg->GetCheckpoint("alice", "r", "weights/a")->expires, T(100));
  EXPECT_TRUE(reg->ExpiredCheckpoints(T(99), 10)->empty());
  absl::StatusOr<std::vector<CheckpointRecord>> due = reg->ExpiredCheckpoints(T(100), 10);
  ASSERT_TRUE(due.ok());
  ASSERT_EQ(due->size(), 1u);
  EXPECT_EQ((*due)[0].checkpoint_id, "weights/a");
  ASSERT_TRUE(reg->SetCheckpointExpiry("alice", "r", "weights/b", T(50)).ok());
  ASSERT_TRUE(reg->SetCheckpointExpiry("alice", "r", "weights/a", std::nullopt).ok());
  due = reg->ExpiredCheckpoints(T(1000), 10);
  ASSERT_EQ(due->size(), 1u);
  EXPECT_EQ((*due)[0].checkpoint_id, "weights/b");
  EXPECT_FALSE(reg->GetCheckpoint("alice", "r", "weights/a")->expires.has_value());
  // Another tenant's checkpoint is NotFound, like an unknown one.
  EXPECT_TRUE(absl::IsNotFound(reg->SetCheckpointExpiry("bob", "r", "weights/b", T(1))));
  EXPECT_TRUE(absl::IsNotFound(reg->SetCheckpointExpiry("alice", "r", "weights/zz", T(1))));
  EXPECT_TRUE(absl::IsInvalidArgument(reg->ExpiredCheckpoints(T(0), -1).status()));
}

TEST_F(RegistryTest, PublishIsOwnerOnlyAndVisibleToOthersUntilUnpublished) {
  std::unique_ptr<Registry> reg = OpenOrDie();
  ASSERT_NE(reg, nullptr);
  ASSERT_TRUE(reg->PutRun(MakeRun("alice", "r", T(0))).ok());
  ASSERT_TRUE(reg->PutCheckpoint(MakeCheckpoint("alice", "r", "a", T(1))).ok());
  EXPECT_TRUE(absl::IsNotFound(reg->GetPublishedCheckpoint("r", "weights/a").status()));
  EXPECT_TRUE(absl::IsNotFound(reg->SetCheckpointPublished("bob", "r", "weights/a", true)));
  ASSERT_TRUE(reg->SetCheckpointPublished("alice", "r", "weights/a", true).ok());
  EXPECT_TRUE(absl::IsAlreadyExists(reg->SetCheckpointPublished("alice", "r", "weights/a", true)));
  absl::StatusOr<CheckpointRecord> shared = reg->GetPublishedCheckpoint("r", "weights/a");
  ASSERT_TRUE(shared.ok());
  EXPECT_EQ(shared->tenant, "alice");
  EXPECT_TRUE(shared->published);
  EXPECT_EQ(reg->PublishedCheckpointsOfOthers("bob")->size(), 1u);
  EXPECT_TRUE(reg->PublishedCheckpointsOfOthers("alice")->empty());
  ASSERT_TRUE(reg->SetCheckpointPublished("alice", "r", "weights/a", false).ok());
  EXPECT_TRUE(absl::IsAlreadyExists(reg->SetCheckpointPublished("alice", "r", "weights/a", false)));
  EXPECT_TRUE(absl::IsNotFound(reg->GetPublishedCheckpoint("r", "weights/a").status()));
}

TEST_F(RegistryTest, StorageBytesAreSummedPerTenantAndExternalKindIsAccepted) {
  std::unique_ptr<Registry> reg = OpenOrDie();
  ASSERT_NE(reg, nullptr);
  ASSERT_TRUE(reg->PutRun(MakeRun("alice", "r", T(0))).ok());
  ASSERT_TRUE(reg->PutRun(MakeRun("bob", "s", T(0))).ok());
  EXPECT_EQ(*reg->TenantStorageBytes("alice"), 0);
  CheckpointRecord a = MakeCheckpoint("alice", "r", "a", T(1));
  a.size_bytes = 10;
  CheckpointRecord b = MakeCheckpoint("alice", "r", "b", T(2));
  b.size_bytes = 5;
  b.kind = "external";
  b.checkpoint_id = "external_weights/b";
  CheckpointRecord c = MakeCheckpoint("bob", "s", "c", T(3));
  c.size_bytes = 7;
  for (const CheckpointRecord& r : {a, b, c}) ASSERT_TRUE(reg->PutCheckpoint(r).ok());
  EXPECT_EQ(*reg->TenantStorageBytes("alice"), 15);
  EXPECT_EQ(*reg->TenantStorageBytes("bob"), 7);
  absl::StatusOr<std::vector<std::pair<std::string, int64_t>>> all = reg->StorageBytesByTenant();
  ASSERT_TRUE(all.ok());
  EXPECT_THAT(*all, ElementsAre(std::pair<std::string, int64_t>{"alice", 15}, std::pair<std::string, int64_t>{"bob", 7}));
  CheckpointRecord bad = a;
  bad.kind = "merged";
  EXPECT_TRUE(absl::IsInvalidArgument(reg->PutCheckpoint(bad)));
}

}  // namespace
}  // namespace twinkle::registry
