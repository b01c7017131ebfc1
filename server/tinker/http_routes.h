#pragma once
// The Tinker API's HTTP routes under /api/v1 (tinker-protocol.md §4): thin wrappers that
// authenticate, parse the body and turn TinkerApi's answers into HTTP responses.

#include "server/http/http_server.h"
#include "server/serving_state.h"
#include "server/tinker/tinker_api.h"

namespace twinkle::tinker {

// Adds every route; call before HttpServer::Start. `api` and `state` outlive the server.
void AddTinkerRoutes(HttpServer& http, TinkerApi& api, ServingState& state);

}  // namespace twinkle::tinker
