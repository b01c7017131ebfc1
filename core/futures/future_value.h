#pragma once
// The typed result of a queued op: one alternative per kind of op result, never std::any, so
// a result can only be read as what it is. A reader that expects one alternative and finds
// another gets an INTERNAL status from ValueAs, never an exception.

#include <cstdint>
#include <string>
#include <variant>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/sampling/types.h"
#include "core/training/types.h"

namespace twinkle {

// An executor's "not finished yet": the scheduler leaves the op's future alone and the
// executor completes it later (see core/scheduler/op.h). Never stored as a result.
struct Deferred {};

// A result already encoded for the API that asked for it: a Tinker request's answer (its
// JSON, and for forward_backward / sample the serialised protobuf too). A transport that
// issues request ids of its own completes them with this, so they sit in the one future
// store beside the ops they wrap and are journaled (and retrievable after a restart) as is.
struct EncodedResult {
  std::string json;
  std::string proto;  // empty when the answer has no protobuf form
};

// What a future holds once its op finished well. The first alternative is what every
// training op produces (and what a default-constructed value is).
using FutureValue =
    std::variant<training::OpOutput, sampling::SampleOutput, sampling::SnapshotSession, EncodedResult, Deferred>;

// The name of the alternative `value` holds, for errors and logs.
inline const char* FutureValueKind(const FutureValue& value) {
  switch (value.index()) {
    case 0: return "training result";
    case 1: return "sampling result";
    case 2: return "sampling session";
    case 3: return "encoded result";
    default: return "deferred";
  }
}

// About how many bytes `value` holds (its payload: numbers, text, encoded bytes), for the
// per-tenant bound on retained results.
int64_t FutureValueBytes(const FutureValue& value);

// The failure of a future whose op was in flight (queued, buffered or running) when the
// server stopped: ABORTED with this message and a payload that marks it, so transports can
// answer "resubmit it" (Tinker: HTTP 410, which the SDK turns into a retry).
inline constexpr char kInterruptedByRestartUrl[] = "twinkle.dev/interrupted-by-restart";
absl::Status InterruptedByRestart();
// True for InterruptedByRestart() (after a journal round trip too: it is recognised by its
// code and message prefix as well as by the payload).
bool IsInterruptedByRestart(const absl::Status& status);

// Something the caller named is over for good (a finished session): FAILED_PRECONDITION
// marked so that HTTP answers 410 Gone, which the Tinker SDK reads as "stop".
inline constexpr char kGoneUrl[] = "twinkle.dev/gone";
absl::Status Gone(absl::string_view message);
bool IsGone(const absl::Status& status);

// The value as a T, or INTERNAL naming both kinds when it holds another one. The pointer is
// valid as long as `value` is.
template <typename T>
absl::StatusOr<const T*> ValueAs(const FutureValue& value, const char* expected) {
  if (const T* v = std::get_if<T>(&value)) return v;
  return absl::InternalError(
      absl::StrCat("the operation produced a ", FutureValueKind(value), " where a ", expected, " was expected"));
}

}  // namespace twinkle
