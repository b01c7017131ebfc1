// twinkle-engine: one worker process per device, spawned by twinkle-server. It links
// LibTorch and never gRPC/Protobuf (see docs/architecture.md, "Processes").

#include <CLI/CLI.hpp>

#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "absl/strings/str_cat.h"
#include "core/common/log.h"
#include "core/engine/worker.h"
#include "twinkle_version.h"

int main(int argc, char** argv) {
#ifdef __GLIBC__
  // A training step allocates and frees the same large activations every time (logits and
  // their gradients are N x vocab). glibc's defaults hand freed memory above ~2x the last
  // mmap'ed size back to the kernel and take it again the next step, page fault by page
  // fault (about a tenth of a small CPU step). Keep up to 256 MiB of free heap, and mmap
  // only blocks of 32 MiB or more (glibc's own ceiling for its adaptive threshold).
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
#endif
  twinkle::engine::WorkerOptions options;
  std::string log_level = "info";
  std::string log_format = "text";
  CLI::App app{"twinkle-engine: the LibTorch worker of twinkle-server (started by it, not by hand)"};
  app.set_version_flag("--version", std::string(twinkle::kTwinkleVersion));
  app.add_option("--rank", options.rank, "rank of this worker in the device pool")->required();
  app.add_option("--endpoint", options.endpoint, "the coordinator's ZeroMQ endpoint")->required();
  app.add_option("--identity", options.identity, "routing id given by the supervisor")->required();
  app.add_option("--device", options.device, "cpu or cuda:N")->default_val("cpu");
  app.add_option("--heartbeat-ms", options.heartbeat_interval_ms, "heartbeat interval")
      ->check(CLI::Range(10, 60000))
      ->default_val(200);
  app.add_option("--log-level", log_level, "debug|info|warning|error")->default_val("info");
  app.add_option("--log-format", log_format, "text|json")->default_val("text");
  app.add_option("--pool", options.pool, "the worker's pool, for its log lines: empty (training) or sampler");
  app.add_flag("--test-hooks", options.test_hooks, "answer the debug methods (tests only)");
  CLI11_PARSE(app, argc, argv);

  twinkle::LogLevel level;
  if (twinkle::ParseLogLevel(log_level, &level)) twinkle::SetLogLevel(level);
  twinkle::LogFormat format;
  if (twinkle::ParseLogFormat(log_format, &format)) twinkle::SetLogFormat(format);

  const absl::Status status = twinkle::engine::RunWorker(options);
  if (!status.ok()) {
    twinkle::LogError(twinkle::engine::WorkerLogName(options), status.ToString());
    return 1;
  }
  return 0;
}
