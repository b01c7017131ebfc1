#pragma once
// twinkle.v1.AdminService: runtime tenants and API keys. Thin codec over KeyAdmin (which
// checks the admin role and writes the audit rows); the handler admission (handler.cc)
// refuses non-admins before that.

#include "server/serving_state.h"
#include "twinkle/v1/admin.grpc.pb.h"

namespace twinkle {

class AdminServiceImpl final : public twinkle::v1::AdminService::CallbackService {
 public:
  explicit AdminServiceImpl(ServingState& state) : state_(state) {}

  grpc::ServerUnaryReactor* CreateTenant(grpc::CallbackServerContext* context,
                                         const twinkle::v1::CreateTenantRequest* request,
                                         twinkle::v1::AdminTenant* response) override;
  grpc::ServerUnaryReactor* CreateKey(grpc::CallbackServerContext* context,
                                      const twinkle::v1::CreateKeyRequest* request,
                                      twinkle::v1::NewApiKey* response) override;
  grpc::ServerUnaryReactor* ListKeys(grpc::CallbackServerContext* context,
                                     const twinkle::v1::ListKeysRequest* request,
                                     twinkle::v1::ListKeysResponse* response) override;
  grpc::ServerUnaryReactor* RevokeKey(grpc::CallbackServerContext* context,
                                      const twinkle::v1::KeyIdRequest* request,
                                      twinkle::v1::ApiKeyInfo* response) override;
  grpc::ServerUnaryReactor* RotateKey(grpc::CallbackServerContext* context,
                                      const twinkle::v1::KeyIdRequest* request,
                                      twinkle::v1::NewApiKey* response) override;
  grpc::ServerUnaryReactor* SetKeyRole(grpc::CallbackServerContext* context,
                                       const twinkle::v1::SetKeyRoleRequest* request,
                                       twinkle::v1::ApiKeyInfo* response) override;

 private:
  ServingState& state_;
};

}  // namespace twinkle
