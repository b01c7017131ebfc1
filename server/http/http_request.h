#pragma once
// How HttpServer turns what Boost.Beast parsed into an HttpRequest, apart from the server so
// that the fuzz targets (tests/fuzz) and tests can run it without sockets.

#include <boost/beast/http/message.hpp>
#include <boost/beast/http/string_body.hpp>

#include "server/http/http_server.h"

namespace twinkle {

// Method, path, query and headers of a parsed request (not its body): the target is split at
// its first '?', header names are lower-cased (the first value wins when a name repeats).
HttpRequest RequestHead(const boost::beast::http::request<boost::beast::http::string_body>& req);

}  // namespace twinkle
