#pragma once
// The typed result of a queued op: one alternative per kind of op result, never std::any, so
// a result can only be read as what it is. A reader that expects one alternative and finds
// another gets an INTERNAL status from ValueAs, never an exception.

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

// What a future holds once its op finished well. The first alternative is what every
// training op produces (and what a default-constructed value is).
using FutureValue =
    std::variant<training::OpOutput, sampling::SampleOutput, sampling::SnapshotSession, Deferred>;

// The name of the alternative `value` holds, for errors and logs.
inline const char* FutureValueKind(const FutureValue& value) {
  switch (value.index()) {
    case 0: return "training result";
    case 1: return "sampling result";
    case 2: return "sampling session";
    default: return "deferred";
  }
}

// The value as a T, or INTERNAL naming both kinds when it holds another one. The pointer is
// valid as long as `value` is.
template <typename T>
absl::StatusOr<const T*> ValueAs(const FutureValue& value, const char* expected) {
  if (const T* v = std::get_if<T>(&value)) return v;
  return absl::InternalError(
      absl::StrCat("the operation produced a ", FutureValueKind(value), " where a ", expected, " was expected"));
}

}  // namespace twinkle
