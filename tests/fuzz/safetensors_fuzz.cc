// libFuzzer entry point for the safetensors header parser: any byte string must yield
// either a header whose every tensor lies inside the data section, or an error status;
// never a crash, hang or sanitizer report.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "absl/types/span.h"
#include "core/engine/model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto tensors =
      twinkle::engine::ParseSafetensorsHeader(absl::MakeConstSpan(data, size), "fuzz-input");
  if (!tensors.ok()) return 0;
  // Check the invariants the loader relies on; abort() makes libFuzzer keep the input.
  for (const twinkle::engine::TensorInfo& t : *tensors) {
    if (t.data_begin > t.data_end || t.file_offset + t.nbytes() > size) std::abort();
    if (static_cast<uint64_t>(t.numel()) * twinkle::engine::SafetensorsDtypeSize(t.dtype) !=
        t.nbytes()) {
      std::abort();
    }
  }
  return 0;
}
