// libFuzzer entry point for the server's YAML config: any text goes through ParseConfig (YAML
// parse, every section and field with its checks, the cross-field checks) and, when it is
// accepted, through RenderConfig in both formats (print-config). Invariants: no crash or
// sanitizer report or exception; an error names the file ("fuzz.yaml:LINE: ..."). (Rendered
// configs are not parsed back: secrets print as "***", which is not a valid digest.)
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "absl/strings/match.h"
#include "server/config/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<twinkle::Config> config = twinkle::ParseConfig(text, "fuzz.yaml");
  if (!config.ok()) {
    if (!absl::StartsWith(config.status().message(), "fuzz.yaml:")) std::abort();
    return 0;
  }
  (void)twinkle::RenderConfig(*config, twinkle::ConfigFormat::kJson);
  (void)twinkle::RenderConfig(*config, twinkle::ConfigFormat::kYaml);
  return 0;
}
