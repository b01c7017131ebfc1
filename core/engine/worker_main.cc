// twinkle-engine: one worker process per device, spawned by twinkle-server. It links
// LibTorch and never gRPC/Protobuf (see docs/architecture.md, "Processes").

#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>

#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "core/common/log.h"
#include "core/engine/export.h"
#include "core/engine/worker.h"
#include "twinkle_version.h"

namespace {

// This process's peak resident set (Linux VmHWM; it starts afresh at exec), or -1.
int64_t PeakRssBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::atoll(line.c_str() + 6) * 1024;
  }
  return -1;
}

// `twinkle-engine export ...`: one merged export in a process of its own, started by the
// coordinator. One JSON line on stdout says how it went: {"path", "bytes"}, or {"code",
// "message"} with an absl status code (and exit status 1); both with "peak_rss_bytes".
int RunExport(int argc, char** argv) {
  twinkle::engine::ExportRequest request;
  std::string model_dir, adapter_dir, parent;
  CLI::App app{"twinkle-engine export: fold a saved LoRA adapter into the base model (started by twinkle-server)"};
  app.add_option("--model-dir", model_dir, "the base model's HF folder")->required();
  app.add_option("--adapter-dir", adapter_dir, "a PEFT adapter checkpoint folder")->required();
  app.add_option("--parent", parent, "folder to write the merged model into")->required();
  app.add_option("--name", request.name, "the merged model's folder name")->required();
  CLI11_PARSE(app, argc, argv);
  request.model_dir = model_dir;
  request.adapter_dir = adapter_dir;
  request.parent = parent;
  const absl::StatusOr<twinkle::engine::ExportResult> done = twinkle::engine::ExportMergedModel(request);
  nlohmann::json out;
  if (done.ok()) {
    out = {{"path", done->path}, {"bytes", done->bytes}};
  } else {
    out = {{"code", static_cast<int>(done.status().code())}, {"message", std::string(done.status().message())}};
  }
  out["peak_rss_bytes"] = PeakRssBytes();
  const std::string line = out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fflush(stdout);
  return done.ok() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  // Before the worker's allocator settings: an export frees each tensor right after writing
  // it, and glibc's defaults give that memory back at once.
  if (argc > 1 && std::strcmp(argv[1], "export") == 0) return RunExport(argc - 1, argv + 1);
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
  app.add_option("--node-secret-file", options.node_secret_file,
                 "started by a node agent: connect to the coordinator as a CURVE client with this node secret");
  app.add_option("--device", options.device, "cpu or cuda:N")->default_val("cpu");
  app.add_option("--heartbeat-ms", options.heartbeat_interval_ms, "heartbeat interval")
      ->check(CLI::Range(10, 60000))
      ->default_val(200);
  app.add_option("--log-level", log_level, "debug|info|warning|error")->default_val("info");
  app.add_option("--log-format", log_format, "text|json")->default_val("text");
  app.add_option("--pool", options.pool, "the worker's pool, for its log lines: empty (training) or sampler");
  app.add_option("--world-size", options.distributed.world_size,
                 "training ranks in the data-parallel process group (1 = none)")
      ->check(CLI::Range(1, 4096))
      ->default_val(1);
  app.add_option("--dist-host", options.distributed.store_host,
                 "address of rank 0's c10d TCPStore (rendezvous)")
      ->default_val("127.0.0.1");
  app.add_option("--dist-port", options.distributed.store_port, "port of rank 0's c10d TCPStore")
      ->check(CLI::Range(1, 65535));
  app.add_option("--group-epoch", options.distributed.epoch,
                 "the process group's membership epoch (a rank restarted alone joins the survivors' next one)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40))
      ->default_val(0);
  int64_t dist_timeout_s = 300;
  app.add_option("--dist-timeout-s", dist_timeout_s,
                 "how long a rendezvous or a collective waits for the other ranks")
      ->check(CLI::Range(1, 86400))
      ->default_val(300);
  app.add_flag("--test-hooks", options.test_hooks, "answer the debug methods (tests only)");
  CLI11_PARSE(app, argc, argv);
  options.distributed.timeout = std::chrono::seconds(dist_timeout_s);
  if (options.distributed.world_size > 1 && options.distributed.store_port == 0) {
    std::fprintf(stderr, "--world-size %d needs --dist-port\n", options.distributed.world_size);
    return 2;
  }
  if (options.rank >= options.distributed.world_size && options.distributed.world_size > 1) {
    std::fprintf(stderr, "--rank %d is outside --world-size %d\n", options.rank, options.distributed.world_size);
    return 2;
  }

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
