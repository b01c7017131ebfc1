#include "server/admin_cli.h"

#include <grpcpp/grpcpp.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "twinkle/v1/admin.grpc.pb.h"

namespace twinkle {
namespace {

nlohmann::json KeyJson(const v1::ApiKeyInfo& k) {
  return {{"key_id", k.key_id()}, {"tenant", k.tenant()}, {"role", k.role()}, {"name", k.name()},
          {"source", k.source()}, {"created_unix_us", k.created_unix_us()},
          {"revoked_unix_us", k.revoked_unix_us()}};
}

int Fail(const grpc::Status& s) {
  std::cerr << "twinkle-server admin: " << s.error_message() << " (gRPC code " << s.error_code() << ")" << std::endl;
  return 1;
}

}  // namespace

int RunAdminCommand(const AdminCliOptions& o) {
  const char* key = std::getenv("TWINKLE_API_KEY");
  if (key == nullptr || *key == '\0') {
    std::cerr << "twinkle-server admin: set TWINKLE_API_KEY to an admin API key" << std::endl;
    return 1;
  }
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (!o.ca_file.empty()) {
    std::ifstream in(o.ca_file);
    if (!in) {
      std::cerr << "twinkle-server admin: --ca-file: cannot read " << o.ca_file << std::endl;
      return 1;
    }
    std::stringstream pem;
    pem << in.rdbuf();
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = pem.str();
    creds = grpc::SslCredentials(ssl);
  }
  auto stub = v1::AdminService::NewStub(grpc::CreateChannel(o.address, creds));
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", std::string("Bearer ") + key);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o.timeout_s * 1000)));
  nlohmann::json out;
  grpc::Status s;
  if (o.command == "create-tenant") {
    v1::CreateTenantRequest req;
    req.set_tenant(o.tenant);
    v1::AdminTenant resp;
    s = stub->CreateTenant(&ctx, req, &resp);
    out = {{"tenant", resp.tenant()}};
  } else if (o.command == "create-key" || o.command == "rotate-key") {
    v1::NewApiKey resp;
    if (o.command == "create-key") {
      v1::CreateKeyRequest req;
      req.set_tenant(o.tenant);
      req.set_role(o.role);
      req.set_name(o.name);
      s = stub->CreateKey(&ctx, req, &resp);
    } else {
      v1::KeyIdRequest req;
      req.set_key_id(o.key_id);
      s = stub->RotateKey(&ctx, req, &resp);
    }
    out = KeyJson(resp.info());
    out["key"] = resp.key();
  } else if (o.command == "list-keys") {
    v1::ListKeysRequest req;
    req.set_tenant(o.tenant);
    v1::ListKeysResponse resp;
    s = stub->ListKeys(&ctx, req, &resp);
    out = {{"keys", nlohmann::json::array()}};
    for (const v1::ApiKeyInfo& k : resp.keys()) out["keys"].push_back(KeyJson(k));
  } else if (o.command == "revoke-key") {
    v1::KeyIdRequest req;
    req.set_key_id(o.key_id);
    v1::ApiKeyInfo resp;
    s = stub->RevokeKey(&ctx, req, &resp);
    out = KeyJson(resp);
  } else if (o.command == "set-role") {
    v1::SetKeyRoleRequest req;
    req.set_key_id(o.key_id);
    req.set_role(o.role);
    v1::ApiKeyInfo resp;
    s = stub->SetKeyRole(&ctx, req, &resp);
    out = KeyJson(resp);
  } else {
    std::cerr << "twinkle-server admin: unknown command '" << o.command << "'" << std::endl;
    return 1;
  }
  if (!s.ok()) return Fail(s);
  std::cout << out.dump() << std::endl;
  return 0;
}

}  // namespace twinkle
