#include "server/tinker/admin_routes.h"

#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "server/auth/key_admin.h"
#include "server/auth/roles.h"
#include "server/tinker/http_routes.h"
#include "server/tinker/tinker_internal.h"
#include "server/tinker/tinker_json.h"
#include "server/usage_meter.h"

namespace twinkle::tinker {
namespace {

constexpr char kApi[] = "/api/v1";


absl::StatusOr<const tenancy::Tenant*> Admit(ServingState& state, const HttpRequest& request) {
  if (state.draining.load()) return absl::UnavailableError("server is shutting down");
  absl::StatusOr<const tenancy::Tenant*> who = state.authenticator->AuthenticateHttp(request.headers);
  if (!who.ok()) return who;
  if (absl::Status s = CheckHttpRole(**who, request.method, request.path); !s.ok()) return s;
  return who;
}

HttpResponse Answer(const absl::StatusOr<Json>& result) {
  return result.ok() ? JsonResponse(*result) : ErrorResponse(result.status());
}

Json KeyJson(const KeyInfo& k) {
  Json j = {{"key_id", k.key_id}, {"tenant", k.tenant}, {"role", k.role}, {"name", k.name}, {"source", k.source},
            {"created_at", IsoTime(k.created)}, {"revoked_at", nullptr}};
  if (k.revoked != absl::InfinitePast()) j["revoked_at"] = IsoTime(k.revoked);
  return j;
}

// GET /auth/apikey/me: the tinker CLI's SelfApiKeyResponse, plus tenant and role.
absl::StatusOr<Json> WhoAmI(ServingState& state, const tenancy::Tenant& who) {
  absl::StatusOr<KeyInfo> k = state.keys->Describe(who);
  if (!k.ok()) return k.status();
  Json j = KeyJson(*k);
  j["note"] = "";
  j["details"] = {{"org_details", {{"name", k->tenant}}}, {"user_details", {{"email", ""}}}};
  return j;
}

absl::StatusOr<absl::Time> ParseQueryTime(const HttpRequest& r, const char* name) {
  std::optional<std::string> v = r.QueryParam(name);
  if (!v || v->empty()) return absl::InvalidArgumentError(absl::StrCat(name, ": required (an RFC 3339 time)"));
  absl::Time t;
  std::string err;
  if (!absl::ParseTime(absl::RFC3339_full, *v, &t, &err)) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": '", v->substr(0, 64), "' is not an RFC 3339 time"));
  }
  return t;
}

bool HourAligned(absl::Time t) { return absl::ToUnixMicros(t) % (int64_t{3600} * 1000000) == 0; }

// The session a run belongs to: runs are "<session id>-<adapter>".
std::string SessionOfRun(const std::vector<registry::SessionRecord>& sessions, const std::string& run_id) {
  for (const registry::SessionRecord& s : sessions) {
    if (absl::StartsWith(run_id, absl::StrCat(s.id, "-"))) return s.id;
  }
  return std::string();
}

absl::StatusOr<Json> BillingEvents(ServingState& state, const HttpRequest& r) {
  absl::StatusOr<absl::Time> from = ParseQueryTime(r, "starting_on");
  if (!from.ok()) return from.status();
  absl::StatusOr<absl::Time> to = ParseQueryTime(r, "ending_before");
  if (!to.ok()) return to.status();
  if (!HourAligned(*from) || !HourAligned(*to)) {
    return absl::InvalidArgumentError("starting_on, ending_before: must be on a UTC hour boundary");
  }
  if (*to <= *from) return absl::InvalidArgumentError("ending_before: must be after starting_on");
  if (*to - *from > kMaxBillingWindow) {
    return absl::InvalidArgumentError("ending_before: at most 14 days after starting_on");
  }
  if (*from > absl::Now()) return absl::InvalidArgumentError("starting_on: must not be in the future");
  // Everything counted so far is in the answer.
  if (absl::Status s = state.usage->Flush(); !s.ok()) return s;
  absl::StatusOr<std::vector<registry::UsageRecord>> rows = state.registry->ListUsage("", *from, *to);
  if (!rows.ok()) return rows.status();

  // Events: one per (bucket, tenant, key, session, base model, kind), summed over runs. Rows
  // written before the registry knew base models (schema v6) are the default model's.
  using Group = std::tuple<int64_t, std::string, int64_t, std::string, std::string, std::string>;
  std::map<Group, int64_t> groups;
  Json raw = Json::array();
  for (const registry::UsageRecord& u : *rows) {
    const std::string& base_model = u.base_model.empty() ? state.config.model.name : u.base_model;
    groups[Group{absl::ToUnixMicros(u.bucket), u.tenant, u.key_id, u.session_id, base_model, u.kind}] += u.amount;
    raw.push_back({{"bucket_start", IsoTime(u.bucket)}, {"tenant", u.tenant}, {"key_id", u.key_id},
                   {"session_id", u.session_id}, {"run_id", u.run_id}, {"base_model", base_model},
                   {"kind", u.kind}, {"amount", u.amount}});
  }
  Json data = Json::array();
  Json sessions = Json::object();
  for (const auto& [g, amount] : groups) {
    const auto& [bucket_us, tenant, key_id, session, base_model, kind] = g;
    Json info;
    if (kind == "training" || kind == "forward") {
      info = {{"type", "training"}, {"token_count", amount}};
    } else if (kind == "prefill") {
      info = {{"type", "sampling_prefill"}, {"cached", false}, {"token_count", amount}};
    } else if (kind == "sampled") {
      info = {{"type", "sampling_sample"}, {"token_count", amount}};
    } else if (kind == "storage_byte_seconds") {
      info = {{"type", "storage"}, {"free", false}, {"gigabyte_hours", static_cast<double>(amount) / 3600.0 / 1e9}};
    } else {
      continue;  // optimizer steps: in twinkle_usage only (the SDK has no event type for them)
    }
    const absl::Time bucket = absl::FromUnixMicros(bucket_us);
    Json event = {{"bucket_start", IsoTime(bucket)},
                  {"bucket_end", IsoTime(bucket + absl::Hours(1))},
                  {"base_model", base_model},
                  {"user_id", absl::StrCat("tenant:", tenant, "/key:", key_id)},
                  {"user_name", tenant},
                  {"session_id", session.empty() ? Json(nullptr) : Json(session)},
                  {"project_id", nullptr},
                  {"estimated_cost_usd", nullptr},
                  {"twinkle_kind", kind},
                  {"event_info", info}};
    if (!session.empty()) {
      absl::StatusOr<registry::SessionRecord> s = state.registry->GetSession(session, tenant);
      if (s.ok()) {
        if (!s->project_id.empty()) event["project_id"] = s->project_id;
        Json meta = s->user_metadata_json.empty() ? Json(nullptr) : Json::parse(s->user_metadata_json, nullptr, false);
        sessions[session] = {{"user_metadata", meta.is_object() ? meta : Json(nullptr)}};
      }
    }
    data.push_back(std::move(event));
  }
  return Json{{"data", std::move(data)}, {"sessions", std::move(sessions)}, {"cost_data_through", nullptr},
              {"twinkle_usage", std::move(raw)}};
}

absl::StatusOr<Json> CheckpointStorage(ServingState& state, const HttpRequest& r) {
  const std::string project = r.QueryParam("project_id").value_or("");
  absl::StatusOr<std::vector<registry::CheckpointRecord>> all = state.registry->AllCheckpoints();
  if (!all.ok()) return all.status();
  // Grouped by (tenant, project of the checkpoint's session).
  std::map<std::string, std::vector<registry::SessionRecord>> sessions_of;
  std::map<std::pair<std::string, std::string>, std::pair<int64_t, int64_t>> groups;
  for (const registry::CheckpointRecord& c : *all) {
    auto it = sessions_of.find(c.tenant);
    if (it == sessions_of.end()) {
      absl::StatusOr<std::vector<registry::SessionRecord>> s = state.registry->ListSessions(c.tenant, {1 << 20, 0}, nullptr);
      it = sessions_of.emplace(c.tenant, s.ok() ? *std::move(s) : std::vector<registry::SessionRecord>{}).first;
    }
    std::string run_project;
    const std::string session = SessionOfRun(it->second, c.run_id);
    for (const registry::SessionRecord& s : it->second) {
      if (s.id == session) run_project = s.project_id;
    }
    if (!project.empty() && run_project != project) continue;
    auto& [count, bytes] = groups[{c.tenant, run_project}];
    ++count;
    bytes += c.size_bytes;
  }
  Json data = Json::array();
  for (const auto& [g, v] : groups) {
    data.push_back({{"project_id", g.second.empty() ? Json(nullptr) : Json(g.second)},
                    {"org_user_urn", absl::StrCat("tenant:", g.first)},
                    {"user_name", g.first},
                    {"checkpoint_count", v.first},
                    {"size_bytes", v.second},
                    {"size_gigabytes", static_cast<double>(v.second) / 1e9},
                    {"estimated_monthly_cost_usd", nullptr}});
  }
  return Json{{"effective_rate_usd_per_gigabyte_month", nullptr}, {"data", std::move(data)}};
}

// The SDK's event_type → which actions it covers.
bool AuditTypeMatches(const std::string& type, const std::string& action) {
  if (type == "all") return true;
  if (type == "checkpoints") return absl::StartsWith(action, "checkpoint_");
  if (type == "projects") return absl::StartsWith(action, "session_project") || absl::StartsWith(action, "project_");
  if (type == "organizations") return absl::StartsWith(action, "key_") || absl::StartsWith(action, "tenant_");
  return false;  // teams: none
}

absl::StatusOr<Json> AuditLog(ServingState& state, const HttpRequest& r) {
  const std::string type = r.QueryParam("event_type").value_or("all");
  if (type != "all" && type != "checkpoints" && type != "projects" && type != "teams" && type != "organizations") {
    return absl::InvalidArgumentError(absl::StrCat("event_type: '", type.substr(0, 32),
                                                   "' is not one of all, checkpoints, projects, teams, organizations"));
  }
  absl::Time day = absl::Now();
  if (std::optional<std::string> d = r.QueryParam("day"); d && !d->empty()) {
    std::string err;
    if (!absl::ParseTime("%Y-%m-%d", *d, absl::UTCTimeZone(), &day, &err)) {
      return absl::InvalidArgumentError(absl::StrCat("day: '", d->substr(0, 32), "' is not YYYY-MM-DD"));
    }
  }
  const absl::CivilDay civil = absl::ToCivilDay(day, absl::UTCTimeZone());
  const absl::Time from = absl::FromCivil(civil, absl::UTCTimeZone());
  const absl::Time to = absl::FromCivil(civil + 1, absl::UTCTimeZone());
  absl::StatusOr<std::vector<registry::AuditRecord>> rows = state.registry->ListAudit("", from, to, kMaxAuditRows);
  if (!rows.ok()) return rows.status();
  Json entries = Json::array();
  for (const registry::AuditRecord& a : *rows) {
    if (!AuditTypeMatches(type, a.action)) continue;
    Json details = Json::parse(a.details_json, nullptr, false);
    if (!details.is_object()) details = Json::object();
    details["tenant"] = a.tenant;
    details["key_id"] = a.key_id;
    details["object"] = a.object;
    details["peer"] = a.peer;
    details["seq"] = a.seq;
    Json entry = {{"timestamp", IsoTime(a.at)}, {"event", a.action}, {"event_details", std::move(details)}};
    if (absl::StartsWith(a.object, "tinker://")) entry["tinker_path"] = a.object;
    entries.push_back(std::move(entry));
  }
  return Json{{"entries", std::move(entries)}};
}

}  // namespace

void AddAdminRoutes(HttpServer& http, TinkerApi& api, ServingState& state) {
  auto get = [&http, &state](const std::string& path,
                             std::function<absl::StatusOr<Json>(const tenancy::Tenant&, const HttpRequest&)> fn) {
    http.Route("GET", absl::StrCat(kApi, path), [&state, fn = std::move(fn)](const HttpRequest& request) {
      absl::StatusOr<const tenancy::Tenant*> who = Admit(state, request);
      if (!who.ok()) return ErrorResponse(who.status());
      return Answer(fn(**who, request));
    });
  };
  // The SDK's auth exchange (pjwt_auth_enabled): an API key in, {"jwt"} out.
  http.Route("POST", absl::StrCat(kApi, "/auth/token"), [&state](const HttpRequest& request) {
    if (state.draining.load()) return ErrorResponse(absl::UnavailableError("server is shutting down"));
    absl::StatusOr<std::string> jwt = state.authenticator->IssueToken(request.headers);
    if (!jwt.ok()) return ErrorResponse(jwt.status());
    return JsonResponse({{"jwt", *jwt}});
  });
  get("/auth/apikey/me", [&state](const tenancy::Tenant& who, const HttpRequest&) { return WhoAmI(state, who); });
  http.Route("DELETE", absl::StrCat(kApi, "/auth/apikey/me"), [&state](const HttpRequest& request) {
    absl::StatusOr<const tenancy::Tenant*> who = Admit(state, request);
    if (!who.ok()) return ErrorResponse(who.status());
    absl::StatusOr<KeyInfo> k = state.keys->RevokeSelf(**who, request.peer);
    if (!k.ok()) return ErrorResponse(k.status());
    return JsonResponse(KeyJson(*k));
  });
  get("/audit", [&state](const tenancy::Tenant&, const HttpRequest& r) { return AuditLog(state, r); });
  get("/billing/usage/events", [&state](const tenancy::Tenant&, const HttpRequest& r) { return BillingEvents(state, r); });
  get("/billing/usage/checkpoints/current",
      [&state](const tenancy::Tenant&, const HttpRequest& r) { return CheckpointStorage(state, r); });
  // An exact route: it wins over the /sessions/ prefix.
  http.Route("POST", absl::StrCat(kApi, "/sessions/search"), [&state, &api](const HttpRequest& request) {
    absl::StatusOr<const tenancy::Tenant*> who = Admit(state, request);
    if (!who.ok()) return ErrorResponse(who.status());
    absl::StatusOr<Json> body = ParseJsonBody(request.body);
    if (!body.ok()) return ErrorResponse(body.status());
    return Answer(api.SearchSessions(**who, *body));
  });
  http.RoutePrefix("PUT", absl::StrCat(kApi, "/sessions/"), [&state, &api](const HttpRequest& request,
                                                                            HttpResponder respond) {
    absl::StatusOr<const tenancy::Tenant*> who = Admit(state, request);
    if (!who.ok()) return respond(ErrorResponse(who.status()));
    std::vector<std::string> parts = absl::StrSplit(request.path_tail, '/');
    if (parts.size() != 2 || parts[0].empty() || parts[1] != "project") {
      return respond(ErrorResponse(absl::NotFoundError(absl::StrCat("no route PUT /api/v1/sessions/", request.path_tail))));
    }
    absl::StatusOr<Json> body = ParseJsonBody(request.body);
    if (!body.ok()) return respond(ErrorResponse(body.status()));
    respond(Answer(api.SetSessionProject(**who, parts[0], *body, request.peer)));
  });
}

}  // namespace twinkle::tinker
