#include "server/grpc/admin_service.h"

#include "server/auth/key_admin.h"
#include "server/grpc/handler.h"

namespace twinkle {
namespace {

void Fill(const KeyInfo& k, twinkle::v1::ApiKeyInfo* out) {
  out->set_key_id(k.key_id);
  out->set_tenant(k.tenant);
  out->set_role(k.role);
  out->set_name(k.name);
  out->set_source(k.source);
  out->set_created_unix_us(absl::ToUnixMicros(k.created));
  out->set_revoked_unix_us(k.revoked == absl::InfinitePast() ? 0 : absl::ToUnixMicros(k.revoked));
}

}  // namespace

grpc::ServerUnaryReactor* AdminServiceImpl::CreateTenant(grpc::CallbackServerContext* context,
                                                         const twinkle::v1::CreateTenantRequest* request,
                                                         twinkle::v1::AdminTenant* response) {
  return HandleNow(context, state_, "AdminService/CreateTenant", [&](const tenancy::Tenant& who) -> absl::Status {
    absl::StatusOr<std::string> t = state_.keys->CreateTenant(who, request->tenant(), context->peer());
    if (!t.ok()) return t.status();
    response->set_tenant(*t);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AdminServiceImpl::CreateKey(grpc::CallbackServerContext* context,
                                                      const twinkle::v1::CreateKeyRequest* request,
                                                      twinkle::v1::NewApiKey* response) {
  return HandleNow(context, state_, "AdminService/CreateKey", [&](const tenancy::Tenant& who) -> absl::Status {
    absl::StatusOr<NewKey> k =
        state_.keys->CreateKey(who, request->tenant(), request->role(), request->name(), context->peer());
    if (!k.ok()) return k.status();
    Fill(k->info, response->mutable_info());
    response->set_key(k->key);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AdminServiceImpl::ListKeys(grpc::CallbackServerContext* context,
                                                     const twinkle::v1::ListKeysRequest* request,
                                                     twinkle::v1::ListKeysResponse* response) {
  return HandleNow(context, state_, "AdminService/ListKeys", [&](const tenancy::Tenant& who) -> absl::Status {
    absl::StatusOr<std::vector<KeyInfo>> keys = state_.keys->ListKeys(who, request->tenant());
    if (!keys.ok()) return keys.status();
    for (const KeyInfo& k : *keys) Fill(k, response->add_keys());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AdminServiceImpl::RevokeKey(grpc::CallbackServerContext* context,
                                                      const twinkle::v1::KeyIdRequest* request,
                                                      twinkle::v1::ApiKeyInfo* response) {
  return HandleNow(context, state_, "AdminService/RevokeKey", [&](const tenancy::Tenant& who) -> absl::Status {
    absl::StatusOr<KeyInfo> k = state_.keys->RevokeKey(who, request->key_id(), context->peer());
    if (!k.ok()) return k.status();
    Fill(*k, response);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AdminServiceImpl::RotateKey(grpc::CallbackServerContext* context,
                                                      const twinkle::v1::KeyIdRequest* request,
                                                      twinkle::v1::NewApiKey* response) {
  return HandleNow(context, state_, "AdminService/RotateKey", [&](const tenancy::Tenant& who) -> absl::Status {
    absl::StatusOr<NewKey> k = state_.keys->RotateKey(who, request->key_id(), context->peer());
    if (!k.ok()) return k.status();
    Fill(k->info, response->mutable_info());
    response->set_key(k->key);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AdminServiceImpl::SetKeyRole(grpc::CallbackServerContext* context,
                                                       const twinkle::v1::SetKeyRoleRequest* request,
                                                       twinkle::v1::ApiKeyInfo* response) {
  return HandleNow(context, state_, "AdminService/SetKeyRole", [&](const tenancy::Tenant& who) -> absl::Status {
    absl::StatusOr<KeyInfo> k = state_.keys->SetRole(who, request->key_id(), request->role(), context->peer());
    if (!k.ok()) return k.status();
    Fill(*k, response);
    return absl::OkStatus();
  });
}

}  // namespace twinkle
