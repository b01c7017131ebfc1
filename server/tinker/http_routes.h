#pragma once
// The Tinker API's HTTP routes under /api/v1 (tinker-protocol.md §4): thin wrappers that
// authenticate, parse the body and turn TinkerApi's answers into HTTP responses.

#include "server/http/http_server.h"
#include "server/serving_state.h"
#include "server/tinker/tinker_api.h"

namespace twinkle::tinker {

// Adds every route; call before HttpServer::Start. `api` and `state` outlive the server.
void AddTinkerRoutes(HttpServer& http, TinkerApi& api, ServingState& state);

// The routes' JSON answers: a body, or an error {"detail", "code", "category"} with the
// status map's HTTP status (and x-should-retry / Retry-After). Shared by admin_routes.cc.
HttpResponse JsonResponse(const Json& j, int status = 200);
HttpResponse ErrorResponse(const absl::Status& status);

}  // namespace twinkle::tinker
