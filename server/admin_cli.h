#pragma once
// `twinkle-server admin ...`: a client of twinkle.v1.AdminService (docs/security.md).
// The admin key is read from the environment (TWINKLE_API_KEY), never from a flag (flags are
// visible to every user in `ps`). Prints one JSON object per call on stdout; errors go to
// stderr with exit status 1. A new key (create-key, rotate-key) is printed once, in "key".

#include <cstdint>
#include <string>

namespace twinkle {

struct AdminCliOptions {
  std::string address;   // host:port of the gRPC server
  std::string ca_file;   // set: TLS, verifying the server against this CA
  std::string command;   // create-tenant | create-key | list-keys | revoke-key | rotate-key | set-role
  std::string tenant, role, name;
  int64_t key_id = 0;
  double timeout_s = 30;
};

int RunAdminCommand(const AdminCliOptions& options);

}  // namespace twinkle
