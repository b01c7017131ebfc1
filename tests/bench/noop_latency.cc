// No-op RPC latency of a running twinkle-server, from a C++ gRPC client: the floor under
// every call (gRPC + the server's handler path + auth), without any scheduler or engine work.
//
// Calls twinkle.v1.UtilityService/GetCapacity (answered on the server's handler thread;
// no queue, no engine) over one channel, one call at a time: `--warmup` untimed calls, then
// `--calls` timed ones, each with a deadline of `--deadline-ms`. With `--key`, every call
// carries `authorization: Bearer KEY` (needed when the server has auth on; the key check is
// then part of what is measured). Any failed call fails the run (exit 1).
//
// Prints a human line and then one line
//   NOOP {"method": ..., "calls": N, "p50_us": ..., "p90_us": ..., "p99_us": ..., ...}
// Usage: noop_latency --target 127.0.0.1:PORT [--key KEY] [--warmup 1000] [--calls 5000]
//                     [--deadline-ms 2000]

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "twinkle/v1/utility.grpc.pb.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  std::string target;
  std::string key;
  int warmup = 1000;
  int calls = 5000;
  int deadline_ms = 2000;
};

[[noreturn]] void Usage(const char* why) {
  std::fprintf(stderr,
               "noop_latency: %s\nusage: noop_latency --target HOST:PORT [--key KEY] [--warmup N] "
               "[--calls N] [--deadline-ms MS]\n",
               why);
  std::exit(2);
}

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) Usage(("missing value after " + flag).c_str());
    const std::string value = argv[++i];
    if (flag == "--target") {
      a.target = value;
    } else if (flag == "--key") {
      a.key = value;
    } else if (flag == "--warmup") {
      a.warmup = std::atoi(value.c_str());
    } else if (flag == "--calls") {
      a.calls = std::atoi(value.c_str());
    } else if (flag == "--deadline-ms") {
      a.deadline_ms = std::atoi(value.c_str());
    } else {
      Usage(("unknown flag " + flag).c_str());
    }
  }
  if (a.target.empty()) Usage("--target is required");
  if (a.warmup < 0 || a.calls < 1 || a.deadline_ms < 1) Usage("bad --warmup, --calls or --deadline-ms");
  return a;
}

// Nearest-rank percentile of sorted samples.
double Percentile(const std::vector<double>& sorted, double p) {
  const size_t rank = static_cast<size_t>(std::ceil(p * static_cast<double>(sorted.size())));
  return sorted[std::min(std::max<size_t>(rank, 1), sorted.size()) - 1];
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = Parse(argc, argv);
  grpc::ChannelArguments channel_args;
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(args.target, grpc::InsecureChannelCredentials(), channel_args);
  std::unique_ptr<twinkle::v1::UtilityService::Stub> stub = twinkle::v1::UtilityService::NewStub(channel);
  const std::string bearer = args.key.empty() ? "" : "Bearer " + args.key;

  auto call = [&](int index) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(args.deadline_ms));
    if (!bearer.empty()) context.AddMetadata("authorization", bearer);
    twinkle::v1::GetCapacityRequest request;
    twinkle::v1::Capacity reply;
    const grpc::Status status = stub->GetCapacity(&context, request, &reply);
    if (!status.ok()) {
      std::fprintf(stderr, "noop_latency: call %d: GetCapacity failed: code %d: %s\n", index,
                   static_cast<int>(status.error_code()), status.error_message().c_str());
      std::exit(1);
    }
  };

  for (int i = 0; i < args.warmup; ++i) call(i);
  std::vector<double> us;
  us.reserve(static_cast<size_t>(args.calls));
  const auto start = Clock::now();
  for (int i = 0; i < args.calls; ++i) {
    const auto t0 = Clock::now();
    call(args.warmup + i);
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::vector<double> sorted = us;
  std::sort(sorted.begin(), sorted.end());
  double sum = 0;
  for (double v : us) sum += v;
  const double p50 = Percentile(sorted, 0.50), p90 = Percentile(sorted, 0.90), p99 = Percentile(sorted, 0.99);
  std::printf("GetCapacity%s: %d calls after %d warm-up: p50 %.1f us, p90 %.1f us, p99 %.1f us, max %.1f us "
              "(%.0f calls/s)\n",
              bearer.empty() ? "" : " (with key)", args.calls, args.warmup, p50, p90, p99, sorted.back(),
              static_cast<double>(args.calls) / seconds);
  std::printf("NOOP {\"method\": \"twinkle.v1.UtilityService/GetCapacity\", \"auth\": %s, \"calls\": %d, "
              "\"warmup\": %d, \"deadline_ms\": %d, \"p50_us\": %.2f, \"p90_us\": %.2f, \"p99_us\": %.2f, "
              "\"mean_us\": %.2f, \"max_us\": %.2f}\n",
              bearer.empty() ? "false" : "true", args.calls, args.warmup, args.deadline_ms, p50, p90, p99,
              sum / static_cast<double>(us.size()), sorted.back());
  return 0;
}
