#include "core/storage/checkpoint_dir.h"

#include <cerrno>
#include <cstring>
#include <string>
#include <tuple>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/unit/core/storage/temp_dir.h"

namespace twinkle::storage {

// Readable test names in gtest output.
void PrintTo(FaultInjectingFileSystem::Op op, std::ostream* os) {
  static const char* const kWords[] = {"open", "write", "fsync", "rename"};
  *os << kWords[static_cast<int>(op)];
}

namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;
using testing::Slurp;
using testing::Snapshot;
using testing::Spit;
using testing::TempDir;
using Op = FaultInjectingFileSystem::Op;

std::vector<FileContent> Files(const std::string& tag) {
  std::string big(70000, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>((i * 31) ^ tag.size());
  return {{"adapter_model.safetensors", big + tag}, {"adapter_config.json", "{\"tag\": \"" + tag + "\"}"}};
}

// Entries of `parent` that are temp or old dirs.
std::vector<std::string> Leftovers(const fs::path& parent) {
  std::vector<std::string> out;
  const auto names = RealFileSystem().ListDir(parent);
  EXPECT_TRUE(names.ok()) << names.status();
  if (!names.ok()) return out;
  for (const std::string& n : *names) {
    if (absl::StartsWith(n, ".tmp-") || absl::StartsWith(n, ".old-")) out.push_back(n);
  }
  return out;
}

TEST(Sha256HexTest, KnownVectors) {
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Sha256Hex(std::string("a\0b", 3)), Sha256Hex(std::string("a\0b", 3)));
  EXPECT_NE(Sha256Hex(std::string("a\0b", 3)), Sha256Hex("a"));
}

TEST(WriteCheckpointDirTest, RoundTrip) {
  TempDir tmp;
  FileSystem& fs = RealFileSystem();
  const fs::path parent = tmp.path() / "tenant" / "checkpoints";  // created on demand
  auto files = Files("v1");
  auto dir = WriteCheckpointDir(fs, parent, "step-10", files, {{"step", 10}, {"kind", "lora"}});
  ASSERT_TRUE(dir.ok()) << dir.status();
  EXPECT_EQ(*dir, parent / "step-10");
  EXPECT_THAT(*fs.ListDir(parent), ElementsAre("step-10"));
  EXPECT_THAT(*fs.ListDir(*dir),
              ElementsAre("adapter_config.json", "adapter_model.safetensors", "checkpoint_metadata.json"));
  for (const FileContent& f : files) EXPECT_EQ(Slurp(*dir / f.name), f.bytes);

  auto meta = VerifyCheckpointDir(fs, *dir);
  ASSERT_TRUE(meta.ok()) << meta.status();
  EXPECT_EQ((*meta)["step"], 10);
  EXPECT_EQ((*meta)["kind"], "lora");
  const auto& entry = (*meta)["files"]["adapter_model.safetensors"];
  EXPECT_EQ(entry["size"], files[0].bytes.size());
  EXPECT_EQ(entry["sha256"], Sha256Hex(files[0].bytes));
  EXPECT_EQ((*meta)["files"].size(), 2u);

  // An empty checkpoint is still a checkpoint.
  auto empty = WriteCheckpointDir(fs, parent, "empty", {});
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(VerifyCheckpointDir(fs, *empty).ok());
}

TEST(WriteCheckpointDirTest, StreamedFilesAreWrittenPieceByPieceAndHashedTheSame) {
  TempDir tmp;
  FileSystem& fs = RealFileSystem();
  const std::string whole = Files("streamed")[0].bytes;
  FileContent streamed;
  streamed.name = "model.safetensors";
  int pieces = 0;
  streamed.stream = [&](const AppendFn& append) -> absl::Status {
    for (size_t at = 0; at < whole.size(); at += 4096, ++pieces) {
      if (absl::Status s = append(absl::string_view(whole).substr(at, 4096)); !s.ok()) return s;
    }
    return absl::OkStatus();
  };
  auto dir = WriteCheckpointDir(fs, tmp.path(), "merged", {streamed, {"config.json", "{}", {}}});
  ASSERT_TRUE(dir.ok()) << dir.status();
  EXPECT_EQ(pieces, static_cast<int>((whole.size() + 4095) / 4096));
  EXPECT_EQ(Slurp(*dir / "model.safetensors"), whole);
  auto meta = VerifyCheckpointDir(fs, *dir);
  ASSERT_TRUE(meta.ok()) << meta.status();
  EXPECT_EQ((*meta)["files"]["model.safetensors"]["size"], whole.size());
  EXPECT_EQ((*meta)["files"]["model.safetensors"]["sha256"], Sha256Hex(whole));

  // A stream that fails part-way fails the write and leaves nothing.
  streamed.stream = [&](const AppendFn& append) -> absl::Status {
    if (absl::Status s = append(absl::string_view(whole).substr(0, 4096)); !s.ok()) return s;
    return absl::DataLossError("the base model's shard 2 is truncated");
  };
  auto failed = WriteCheckpointDir(fs, tmp.path(), "broken", {streamed});
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(failed.status().message()), HasSubstr("shard 2 is truncated"));
  EXPECT_THAT(*fs.ListDir(tmp.path()), ElementsAre("merged"));
}

TEST(WriteCheckpointDirTest, ReplacesExistingAndLeavesNoLeftovers) {
  TempDir tmp;
  FileSystem& fs = RealFileSystem();
  ASSERT_TRUE(WriteCheckpointDir(fs, tmp.path(), "ckpt", Files("v1")).ok());
  Spit(tmp.path() / "ckpt" / "stale", "from v1, not in v2");
  auto v2 = Files("v2-longer");
  ASSERT_TRUE(WriteCheckpointDir(fs, tmp.path(), "ckpt", {v2[0]}).ok());
  EXPECT_THAT(*fs.ListDir(tmp.path()), ElementsAre("ckpt"));
  EXPECT_THAT(*fs.ListDir(tmp.path() / "ckpt"),
              ElementsAre("adapter_model.safetensors", "checkpoint_metadata.json"));
  EXPECT_EQ(Slurp(tmp.path() / "ckpt" / "adapter_model.safetensors"), v2[0].bytes);
  EXPECT_TRUE(VerifyCheckpointDir(fs, tmp.path() / "ckpt").ok());
}

TEST(WriteCheckpointDirTest, RejectsBadNamesWithoutTouchingAnything) {
  TempDir tmp;
  FileSystem& fs = RealFileSystem();
  const FileContent ok{"a.bin", "x"};
  struct Case {
    std::string name;
    std::vector<FileContent> files;
    nlohmann::json meta;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"../escape", {ok}, nlohmann::json::object(), "checkpoint name"},
      {"a/b", {ok}, nlohmann::json::object(), "checkpoint name"},
      {".hidden", {ok}, nlohmann::json::object(), "checkpoint name"},
      {"", {ok}, nlohmann::json::object(), "checkpoint name"},
      {"c", {{"sub/f", "x"}}, nlohmann::json::object(), "checkpoint file name"},
      {"c", {{"../f", "x"}}, nlohmann::json::object(), "checkpoint file name"},
      {"c", {{kMetadataFile, "x"}}, nlohmann::json::object(), "reserved"},
      {"c", {ok, ok}, nlohmann::json::object(), "twice"},
      {"c", {ok}, {{"files", 1}}, "'files' is reserved"},
      {"c", {ok}, nlohmann::json::array(), "JSON object"},
  };
  for (const Case& c : cases) {
    auto r = WriteCheckpointDir(fs, tmp.path() / "p", c.name, c.files, c.meta);
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << c.name << ": " << r.status();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.expect)) << c.name;
  }
  EXPECT_THAT(*fs.ListDir(tmp.path()), IsEmpty());
}

// A previous checkpoint under the same name and a sibling stay byte-identical and verify,
// and nothing is left behind, whichever single operation fails.
class FaultTest : public ::testing::TestWithParam<std::tuple<Op, int>> {};

const char* OpWord(Op op) {
  switch (op) {
    case Op::kOpen: return "open";
    case Op::kWrite: return "write";
    case Op::kSync: return "fsync";
    case Op::kRename: return "rename";
  }
  return "";
}

TEST_P(FaultTest, FailedSaveLeavesPreviousAndSiblingIntact) {
  const auto [op, err] = GetParam();
  TempDir tmp;
  FaultInjectingFileSystem fs(RealFileSystem());
  const fs::path parent = tmp.path();
  ASSERT_TRUE(WriteCheckpointDir(fs, parent, "sibling", Files("s"), {{"n", 1}}).ok());
  ASSERT_TRUE(WriteCheckpointDir(fs, parent, "ckpt", Files("v1"), {{"n", 2}}).ok());
  const auto sibling_before = Snapshot(parent / "sibling");
  const auto ckpt_before = Snapshot(parent / "ckpt");

  // Every call of `op` in a save, one at a time, until a save no longer reaches the fault.
  int expected_calls = 0;
  switch (op) {
    case Op::kOpen: expected_calls = 3; break;    // 2 files + metadata
    case Op::kWrite: expected_calls = 3; break;   // one Append each
    case Op::kSync: expected_calls = 5; break;    // 3 files + temp dir + parent
    case Op::kRename: expected_calls = 2; break;  // old aside, new in
  }
  int nth = 1;
  for (;; ++nth) {
    ASSERT_LE(nth, 20) << "save never succeeded";
    fs.Arm(op, err, nth);
    auto r = WriteCheckpointDir(fs, parent, "ckpt", Files("v2"), {{"n", 3}});
    if (r.ok()) break;
    SCOPED_TRACE(absl::StrCat(OpWord(op), " #", nth, ": ", r.status().ToString()));
    EXPECT_EQ(r.status().code(), err == ENOSPC ? absl::StatusCode::kResourceExhausted
                                               : absl::StatusCode::kInternal);
    const std::string msg(r.status().message());
    EXPECT_THAT(msg, HasSubstr(absl::StrCat(OpWord(op), " ", parent.string())));
    EXPECT_THAT(msg, HasSubstr(std::strerror(err)));
    EXPECT_THAT(msg, HasSubstr("writing checkpoint " + (parent / "ckpt").string()));

    EXPECT_EQ(Snapshot(parent / "ckpt"), ckpt_before);
    EXPECT_EQ(Snapshot(parent / "sibling"), sibling_before);
    auto v = VerifyCheckpointDir(fs, parent / "ckpt");
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ((*v)["n"], 2);
    EXPECT_TRUE(VerifyCheckpointDir(fs, parent / "sibling").ok());
    EXPECT_THAT(Leftovers(parent), IsEmpty());
  }
  EXPECT_EQ(nth, expected_calls + 1) << "number of " << OpWord(op) << " calls in one save";
  fs.Disarm();
  auto v = VerifyCheckpointDir(fs, parent / "ckpt");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ((*v)["n"], 3);
  EXPECT_EQ(Snapshot(parent / "sibling"), sibling_before);
  EXPECT_THAT(Leftovers(parent), IsEmpty());
}

TEST_P(FaultTest, FailedFirstSaveLeavesNothing) {
  const auto [op, err] = GetParam();
  TempDir tmp;
  FaultInjectingFileSystem fs(RealFileSystem());
  fs.Arm(op, err, 1);
  auto r = WriteCheckpointDir(fs, tmp.path(), "new", Files("v1"));
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(std::string(OpWord(op)) + " "));
  EXPECT_THAT(*RealFileSystem().ListDir(tmp.path()), IsEmpty());
}

INSTANTIATE_TEST_SUITE_P(
    AllOps, FaultTest,
    ::testing::Combine(::testing::Values(Op::kOpen, Op::kWrite, Op::kSync, Op::kRename),
                       ::testing::Values(ENOSPC, EIO)),
    [](const ::testing::TestParamInfo<std::tuple<Op, int>>& info) {
      return absl::StrCat(OpWord(std::get<0>(info.param)), "_",
                          std::get<1>(info.param) == ENOSPC ? "ENOSPC" : "EIO");
    });

// A filesystem whose process "dies" after `budget` mutating calls: every later mutating call
// fails and changes nothing (so no cleanup or rollback happens either).
class CrashingFileSystem final : public FileSystem {
 public:
  CrashingFileSystem(FileSystem& base, int budget) : base_(base), budget_(budget) {}

  bool Step() { return budget_-- > 0; }
  static absl::Status Dead() { return absl::UnavailableError("crashed"); }

  class File final : public WritableFile {
   public:
    File(CrashingFileSystem& fs, std::unique_ptr<WritableFile> f) : fs_(fs), f_(std::move(f)) {}
    absl::Status Append(absl::string_view d) override { return fs_.Step() ? f_->Append(d) : Dead(); }
    absl::Status Sync() override { return fs_.Step() ? f_->Sync() : Dead(); }
    absl::Status Close() override { return f_->Close(); }

   private:
    CrashingFileSystem& fs_;
    std::unique_ptr<WritableFile> f_;
  };

  absl::StatusOr<std::unique_ptr<WritableFile>> OpenForWrite(const fs::path& p) override {
    if (!Step()) return Dead();
    auto f = base_.OpenForWrite(p);
    if (!f.ok()) return f.status();
    return std::unique_ptr<WritableFile>(new File(*this, *std::move(f)));
  }
  absl::StatusOr<std::string> ReadFile(const fs::path& p) override { return base_.ReadFile(p); }
  absl::Status Rename(const fs::path& a, const fs::path& b) override {
    return Step() ? base_.Rename(a, b) : Dead();
  }
  absl::Status SyncDir(const fs::path& d) override { return Step() ? base_.SyncDir(d) : Dead(); }
  absl::Status CreateDirs(const fs::path& d) override { return Step() ? base_.CreateDirs(d) : Dead(); }
  absl::Status RemoveAll(const fs::path& p) override { return Step() ? base_.RemoveAll(p) : Dead(); }
  absl::StatusOr<std::vector<std::string>> ListDir(const fs::path& d) override { return base_.ListDir(d); }
  bool Exists(const fs::path& p) override { return base_.Exists(p); }
  absl::StatusOr<int64_t> FileSize(const fs::path& p) override { return base_.FileSize(p); }

 private:
  FileSystem& base_;
  int budget_;
};

TEST(RecoverDirTest, CrashAtEveryStepLeavesOldOrNewAfterRecovery) {
  int budget = 0;
  for (;; ++budget) {
    ASSERT_LE(budget, 40) << "save never completed";
    SCOPED_TRACE(absl::StrCat("crash after ", budget, " mutating calls"));
    TempDir tmp;
    ASSERT_TRUE(WriteCheckpointDir(RealFileSystem(), tmp.path(), "ckpt", Files("v1"), {{"n", 1}}).ok());
    ASSERT_TRUE(WriteCheckpointDir(RealFileSystem(), tmp.path(), "other", Files("o")).ok());
    const auto other_before = Snapshot(tmp.path() / "other");
    CrashingFileSystem crashing(RealFileSystem(), budget);
    const bool saved = WriteCheckpointDir(crashing, tmp.path(), "ckpt", Files("v2"), {{"n", 2}}).ok();

    auto recovered = RecoverDir(RealFileSystem(), tmp.path());
    ASSERT_TRUE(recovered.ok()) << recovered.status();
    auto v = VerifyCheckpointDir(RealFileSystem(), tmp.path() / "ckpt");
    ASSERT_TRUE(v.ok()) << v.status();
    if (saved) {
      EXPECT_EQ((*v)["n"], 2);
    }
    EXPECT_THAT((*v)["n"].get<int>(), ::testing::AnyOf(1, 2));
    EXPECT_EQ(Snapshot(tmp.path() / "other"), other_before);
    EXPECT_THAT(*RealFileSystem().ListDir(tmp.path()), ElementsAre("ckpt", "other"));
    if (saved) break;
  }
  EXPECT_GE(budget, 10);
}

// Records which directories were fsynced, passing everything through.
class SyncRecordingFileSystem final : public FileSystem {
 public:
  explicit SyncRecordingFileSystem(FileSystem& base) : base_(base) {}
  std::vector<fs::path> synced_dirs;

  absl::StatusOr<std::unique_ptr<WritableFile>> OpenForWrite(const fs::path& p) override {
    return base_.OpenForWrite(p);
  }
  absl::StatusOr<std::string> ReadFile(const fs::path& p) override { return base_.ReadFile(p); }
  absl::Status Rename(const fs::path& a, const fs::path& b) override { return base_.Rename(a, b); }
  absl::Status SyncDir(const fs::path& d) override {
    synced_dirs.push_back(d);
    return base_.SyncDir(d);
  }
  absl::Status CreateDirs(const fs::path& d) override { return base_.CreateDirs(d); }
  absl::Status RemoveAll(const fs::path& p) override { return base_.RemoveAll(p); }
  absl::StatusOr<std::vector<std::string>> ListDir(const fs::path& d) override { return base_.ListDir(d); }
  bool Exists(const fs::path& p) override { return base_.Exists(p); }
  absl::StatusOr<int64_t> FileSize(const fs::path& p) override { return base_.FileSize(p); }

 private:
  FileSystem& base_;
};

TEST(CreateDirsDurablyTest, EveryNewDirectoryIsSyncedIntoItsParentAndOldOnesAreLeftAlone) {
  TempDir tmp;
  SyncRecordingFileSystem fs(RealFileSystem());
  const fs::path run = tmp.path() / "tenants" / "alice" / "runs" / "run-1";
  ASSERT_TRUE(CreateDirsDurably(fs, run).ok());
  EXPECT_TRUE(RealFileSystem().Exists(run));
  EXPECT_THAT(fs.synced_dirs, ElementsAre(tmp.path(), tmp.path() / "tenants", tmp.path() / "tenants" / "alice",
                                          tmp.path() / "tenants" / "alice" / "runs"));
  fs.synced_dirs.clear();
  ASSERT_TRUE(CreateDirsDurably(fs, run).ok());
  EXPECT_THAT(fs.synced_dirs, IsEmpty());
}

TEST(CreateDirsDurablyTest, TheFirstSaveIntoANewRunFailsWhenItsFolderCannotBeMadeDurable) {
  TempDir tmp;
  FaultInjectingFileSystem fs(RealFileSystem());
  fs.Arm(Op::kSync, EIO, 1);  // the first fsync: the new run folder's parent
  auto r = WriteCheckpointDir(fs, tmp.path() / "run-1" / "weights", "ckpt", Files("v1"));
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("fsync " + tmp.path().string()));
}

TEST(DeleteCheckpointDirTest, ADeletedCheckpointIsGoneAndStaysGoneAfterRecovery) {
  TempDir tmp;
  ASSERT_TRUE(WriteCheckpointDir(RealFileSystem(), tmp.path(), "ckpt", Files("v1")).ok());
  ASSERT_TRUE(WriteCheckpointDir(RealFileSystem(), tmp.path(), "other", Files("o")).ok());
  SyncRecordingFileSystem fs(RealFileSystem());
  ASSERT_TRUE(DeleteCheckpointDir(fs, tmp.path() / "ckpt").ok());
  EXPECT_THAT(fs.synced_dirs, ElementsAre(tmp.path()));  // the rename away was made durable
  ASSERT_TRUE(RecoverDir(RealFileSystem(), tmp.path()).ok());
  EXPECT_THAT(*RealFileSystem().ListDir(tmp.path()), ElementsAre("other"));
  EXPECT_TRUE(DeleteCheckpointDir(fs, tmp.path() / "ckpt").ok());  // absent: OK
}

TEST(DeleteCheckpointDirTest, CrashAtEveryStepLeavesTheCheckpointWholeOrGoneAndOkMeansGone) {
  for (int budget = 0; budget <= 4; ++budget) {
    SCOPED_TRACE(absl::StrCat("crash after ", budget, " mutating calls"));
    TempDir tmp;
    ASSERT_TRUE(WriteCheckpointDir(RealFileSystem(), tmp.path(), "ckpt", Files("v1"), {{"n", 1}}).ok());
    CrashingFileSystem crashing(RealFileSystem(), budget);
    const bool deleted = DeleteCheckpointDir(crashing, tmp.path() / "ckpt").ok();
    ASSERT_TRUE(RecoverDir(RealFileSystem(), tmp.path()).ok());
    const auto names = *RealFileSystem().ListDir(tmp.path());
    if (deleted) {
      EXPECT_THAT(names, IsEmpty());
    } else if (!names.empty()) {
      EXPECT_THAT(names, ElementsAre("ckpt"));
      EXPECT_TRUE(VerifyCheckpointDir(RealFileSystem(), tmp.path() / "ckpt").ok());
    }
  }
}

TEST(DeleteCheckpointDirTest, AFailedParentSyncPutsTheCheckpointBack) {
  TempDir tmp;
  ASSERT_TRUE(WriteCheckpointDir(RealFileSystem(), tmp.path(), "ckpt", Files("v1"), {{"n", 1}}).ok());
  FaultInjectingFileSystem fs(RealFileSystem());
  fs.Arm(Op::kSync, EIO, 1);
  const absl::Status s = DeleteCheckpointDir(fs, tmp.path() / "ckpt");
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(s.message()), HasSubstr("deleting checkpoint"));
  EXPECT_THAT(*RealFileSystem().ListDir(tmp.path()), ElementsAre("ckpt"));
  EXPECT_TRUE(VerifyCheckpointDir(RealFileSystem(), tmp.path() / "ckpt").ok());
}

TEST(RecoverDirTest, RestoresOldWhenNameMissingAndRemovesTemp) {
  TempDir tmp;
  FileSystem& fs = RealFileSystem();
  ASSERT_TRUE(WriteCheckpointDir(fs, tmp.path(), "my-ckpt", Files("v1"), {{"n", 1}}).ok());
  const auto before = Snapshot(tmp.path() / "my-ckpt");
  // A crash between "rename name -> .old-" and "rename .tmp- -> name".
  ASSERT_TRUE(fs.Rename(tmp.path() / "my-ckpt", tmp.path() / ".old-my-ckpt-0123456789abcdef").ok());
  ASSERT_TRUE(fs.CreateDirs(tmp.path() / ".tmp-my-ckpt-fedcba9876543210").ok());
  Spit(tmp.path() / ".tmp-my-ckpt-fedcba9876543210" / "adapter_model.safetensors", "half");

  auto r = RecoverDir(fs, tmp.path());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(*r, UnorderedElementsAre(".old-my-ckpt-0123456789abcdef", ".tmp-my-ckpt-fedcba9876543210"));
  EXPECT_THAT(*fs.ListDir(tmp.path()), ElementsAre("my-ckpt"));
  EXPECT_EQ(Snapshot(tmp.path() / "my-ckpt"), before);
  EXPECT_TRUE(VerifyCheckpointDir(fs, tmp.path() / "my-ckpt").ok());

  // Idempotent.
  auto again = RecoverDir(fs, tmp.path());
  ASSERT_TRUE(again.ok());
  EXPECT_THAT(*again, IsEmpty());
}

TEST(RecoverDirTest, RemovesOldWhenNameExists) {
  TempDir tmp;
  FileSystem& fs = RealFileSystem();
  ASSERT_TRUE(WriteCheckpointDir(fs, tmp.path(), "ckpt", Files("new"), {{"n", 2}}).ok());
  const auto before = Snapshot(tmp.path() / "ckpt");
  // A crash after the new dir was renamed in but before the old one was removed.
  ASSERT_TRUE(fs.CreateDirs(tmp.path() / ".old-ckpt-00aa").ok());
  Spit(tmp.path() / ".old-ckpt-00aa" / "x", "old");
  auto r = RecoverDir(fs, tmp.path());
  ASSERT_TRUE(r.ok());
  EXPECT_THAT(*r, ElementsAre(".old-ckpt-00aa"));
  EXPECT_THAT(*fs.ListDir(tmp.path()), ElementsAre("ckpt"));
  EXPECT_EQ(Snapshot(tmp.path() / "ckpt"), before);
}

TEST(RecoverDirTest, MissingParentIsEmpty) {
  TempDir tmp;
  auto r = RecoverDir(RealFileSystem(), tmp.path() / "absent");
  ASSERT_TRUE(r.ok());
  EXPECT_THAT(*r, IsEmpty());
}

class VerifyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto d = WriteCheckpointDir(RealFileSystem(), tmp_.path(), "ckpt", Files("v"));
    ASSERT_TRUE(d.ok());
    dir_ = *d;
    ASSERT_TRUE(VerifyCheckpointDir(RealFileSystem(), dir_).ok());
  }
  absl::Status Verify() { return VerifyCheckpointDir(RealFileSystem(), dir_).status(); }

  TempDir tmp_;
  fs::path dir_;
};

TEST_F(VerifyTest, DetectsFlippedByte) {
  const fs::path f = dir_ / "adapter_model.safetensors";
  std::string bytes = Slurp(f);
  bytes[bytes.size() / 2] ^= 0x01;
  Spit(f, bytes);
  absl::Status s = Verify();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("adapter_model.safetensors"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("SHA-256"));
}

TEST_F(VerifyTest, DetectsTruncation) {
  const fs::path f = dir_ / "adapter_model.safetensors";
  std::string bytes = Slurp(f);
  Spit(f, bytes.substr(0, bytes.size() - 1));
  absl::Status s = Verify();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("adapter_model.safetensors"));
  EXPECT_THAT(std::string(s.message()), HasSubstr(absl::StrCat(bytes.size() - 1, " bytes")));
}

TEST_F(VerifyTest, DetectsMissingFile) {
  std::filesystem::remove(dir_ / "adapter_config.json");
  absl::Status s = Verify();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("adapter_config.json"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("missing"));
}

TEST_F(VerifyTest, MissingMetadataIsNotACheckpoint) {
  std::filesystem::remove(dir_ / kMetadataFile);
  absl::Status s = Verify();
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("not a checkpoint"));
}

TEST_F(VerifyTest, CorruptOrHostileMetadata) {
  Spit(dir_ / kMetadataFile, "{\"files\": ");
  EXPECT_TRUE(absl::IsFailedPrecondition(Verify()));
  Spit(dir_ / kMetadataFile, "{\"step\": 1}");
  EXPECT_TRUE(absl::IsFailedPrecondition(Verify()));
  Spit(dir_ / kMetadataFile,
       "{\"files\": {\"../ckpt/adapter_config.json\": {\"size\": 1, \"sha256\": \"00\"}}}");
  absl::Status s = Verify();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("invalid file"));
  Spit(dir_ / kMetadataFile, "{\"files\": {\"adapter_config.json\": {\"size\": -1, \"sha256\": \"00\"}}}");
  EXPECT_TRUE(absl::IsFailedPrecondition(Verify()));
}

}  // namespace
}  // namespace twinkle::storage
