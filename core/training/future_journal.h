#pragma once
// Futures that survive a restart: every creation and completion of the one FutureStore is
// recorded in the registry by a background writer (never under the caller's lock):
// training results as JSON of OpOutput, encoded results (Tinker answers) as their JSON and
// protobuf bytes, failures as code and message.
//
// Ids carry the server's boot number in their top bits (boot << 40 | counter): after a
// restart, an id from an earlier boot that the registry does not hold as finished was in
// flight when the old process stopped — it reports InterruptedByRestart() (ABORTED, marked
// retryable: resubmit), never a bare NOT_FOUND, even if its pending record had not been
// written yet. Once BeginShutdown() is called, failures are no longer recorded: what fails
// because the server is stopping stays pending and reads as interrupted after the restart.

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "core/futures/future_store.h"
#include "core/registry/registry.h"
#include "core/training/types.h"

namespace twinkle::training {

inline constexpr int kFutureBootShift = 40;

std::string OpOutputToJson(const OpOutput& out);
absl::StatusOr<OpOutput> OpOutputFromJson(const std::string& text);
// A stored result: OpOutput JSON, or {"encoded": {"json", "proto" (base64)}}.
std::string EncodedResultToJson(const EncodedResult& out);
absl::StatusOr<FutureValue> StoredValueFromJson(const std::string& text);

class RegistryFutureJournal final : public FutureJournal {
 public:
  // Starts a new boot: marks the previous boot's pending futures interrupted, records the
  // boot, and returns the journal with first_id() for the scheduler's id counter.
  static absl::StatusOr<std::unique_ptr<RegistryFutureJournal>> Open(registry::Registry& registry);
  ~RegistryFutureJournal() override;  // writes what is queued, then stops

  uint64_t first_id() const { return (boot_ << kFutureBootShift) + 1; }

  void Created(uint64_t id, const std::string& tenant) override;
  void Completed(uint64_t id, const std::string& tenant, const FutureResult& result) override;
  absl::StatusOr<FutureResult> Lookup(uint64_t id, const std::string& tenant) override;
  void Dropped(uint64_t id, const std::string& tenant, const absl::Status& why) override;

  // The server is stopping: from now on failures are not recorded (see above).
  void BeginShutdown();

  // Blocks until everything queued so far is written (tests, shutdown).
  void Flush();

 private:
  RegistryFutureJournal(registry::Registry& registry, uint64_t boot);
  void WriterLoop();

  registry::Registry& registry_;
  const uint64_t boot_;
  absl::Mutex mu_;
  struct Write {
    registry::FutureRecord record;
    bool erase = false;  // forget the row instead of writing it
  };
  void Queue(Write w);
  std::deque<Write> queue_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const std::deque<Write>> writing_batch_ ABSL_GUARDED_BY(mu_);  // being written
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread writer_;
};

}  // namespace twinkle::training
