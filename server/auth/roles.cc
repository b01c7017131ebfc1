#include "server/auth/roles.h"

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/auth/key_admin.h"

namespace twinkle {
namespace {

constexpr absl::string_view kApi = "/api/v1";

bool IsAdminPath(absl::string_view path) {
  return path == "/api/v1/audit" || absl::StartsWith(path, "/api/v1/billing/");
}

// POST routes that only read or sample.
bool ReadOnlyPost(absl::string_view path) {
  static const auto* kAllowed = new absl::flat_hash_set<std::string>{
      "/api/v1/create_session",      "/api/v1/session_heartbeat", "/api/v1/client/config",
      "/api/v1/client/dynamic_config", "/api/v1/telemetry",       "/api/v1/create_sampling_session",
      "/api/v1/asample",             "/api/v1/retrieve_future",   "/api/v1/get_info",
      "/api/v1/weights_info",        "/api/v1/sessions/search",   "/api/v1/get_server_capabilities",
      // The SDK's auth exchange: a read-only key gets a token that is read-only too.
      "/api/v1/auth/token",
      // The OpenAI-compatible sampling routes' /api/v1 aliases (under /v1 they are not
      // role-checked: everything there samples or lists).
      "/api/v1/completions",         "/api/v1/chat/completions"};
  if (kAllowed->contains(path)) return true;
  // sessions/{id}/finish
  return absl::StartsWith(path, "/api/v1/sessions/") && absl::EndsWith(path, "/finish");
}

bool ReadOnlyGrpc(absl::string_view method) {
  static const auto* kAllowed = new absl::flat_hash_set<std::string>{
      "TrainingService/CreateSession",       "TrainingService/SessionHeartbeat",
      "TrainingService/WaitFuture",          "UtilityService/GetServerInfo",
      "UtilityService/GetCapacity",          "UtilityService/ListTrainingRuns",
      "UtilityService/GetTrainingRun",       "UtilityService/ListCheckpoints",
      "UtilityService/GetTokenizerFiles",    "SamplerService/CreateSamplingSession",
      "SamplerService/GetSamplingSession",   "SamplerService/CloseSamplingSession",
      "SamplerService/Sample",               "SamplerService/WaitSample",
      "TinkerService/GetServerCapabilities", "TinkerService/CreateSession",
      "TinkerService/SessionHeartbeat",      "TinkerService/CreateSamplingSession",
      "TinkerService/Sample",                "TinkerService/AsyncSample",
      "TinkerService/RetrieveFuture",        "TinkerService/GetInfo",
      "TinkerService/WeightsInfo",           "TinkerService/Telemetry",
      "TinkerService/GetSampler",            "TinkerService/ListTrainingRuns",
      "TinkerService/GetTrainingRun",        "TinkerService/ListCheckpoints",
      "TinkerService/ListUserCheckpoints"};
  return kAllowed->contains(method);
}

}  // namespace

absl::Status CheckHttpRole(const tenancy::Tenant& who, absl::string_view method, absl::string_view path) {
  if (!absl::StartsWith(path, kApi)) return absl::OkStatus();
  if (IsAdminPath(path)) {
    if (who.role == tenancy::Role::kAdmin) return absl::OkStatus();
    return RoleRefusal(who, absl::StrCat(method, " ", path), "admin");
  }
  if (who.role != tenancy::Role::kReadOnly) return absl::OkStatus();
  if (method == "GET" || method == "HEAD") return absl::OkStatus();
  if (method == "POST" && ReadOnlyPost(path)) return absl::OkStatus();
  if (method == "DELETE" && path == "/api/v1/auth/apikey/me") return absl::OkStatus();
  return RoleRefusal(who, absl::StrCat(method, " ", path), "member");
}

absl::Status CheckGrpcRole(const tenancy::Tenant& who, absl::string_view method) {
  if (absl::StartsWith(method, "AdminService/")) {
    if (who.role == tenancy::Role::kAdmin) return absl::OkStatus();
    return RoleRefusal(who, method, "admin");
  }
  if (who.role != tenancy::Role::kReadOnly || ReadOnlyGrpc(method)) return absl::OkStatus();
  return RoleRefusal(who, method, "member");
}

}  // namespace twinkle
