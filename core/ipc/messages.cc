#include "core/ipc/messages.h"

#include <limits>

namespace twinkle::ipc {

absl::StatusOr<size_t> DtypeItemSize(absl::string_view dtype) {
  if (dtype == "float32" || dtype == "int32") return 4;
  if (dtype == "bfloat16" || dtype == "float16") return 2;
  if (dtype == "int64" || dtype == "float64") return 8;
  if (dtype == "uint8" || dtype == "bool") return 1;
  return absl::InvalidArgumentError(absl::StrCat("ipc: unknown tensor dtype '", dtype, "'"));
}

absl::Status ValidateTensor(const TensorDesc& desc, const std::vector<std::string>& buffers) {
  absl::StatusOr<size_t> item = DtypeItemSize(desc.dtype);
  if (!item.ok()) return item.status();
  if (desc.frame >= buffers.size()) {
    return absl::InvalidArgumentError(absl::StrCat("ipc: tensor refers to frame ", desc.frame,
                                                   " but the message has ", buffers.size()));
  }
  size_t numel = 1;
  for (int64_t d : desc.shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("ipc: negative tensor dim ", d));
    if (d != 0 && numel > std::numeric_limits<size_t>::max() / static_cast<size_t>(d)) {
      return absl::InvalidArgumentError("ipc: tensor shape overflows");
    }
    numel *= static_cast<size_t>(d);
  }
  if (numel > std::numeric_limits<size_t>::max() / *item) {
    return absl::InvalidArgumentError("ipc: tensor shape overflows");
  }
  const size_t want = numel * *item;
  if (buffers[desc.frame].size() != want) {
    return absl::InvalidArgumentError(absl::StrCat("ipc: tensor frame ", desc.frame, " holds ",
                                                   buffers[desc.frame].size(), " bytes; its ",
                                                   desc.dtype, " shape needs ", want));
  }
  return absl::OkStatus();
}

}  // namespace twinkle::ipc
