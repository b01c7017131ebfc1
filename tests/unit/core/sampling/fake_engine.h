#pragma once
// An EngineLink for the sampler's unit tests: answers what the coordinators ask of an engine
// for adapters and snapshots (create_adapter, get_adapter_state, the rest OK); never samples.

#include <string>
#include <vector>

#include "core/ipc/training_messages.h"
#include "core/training/engine_link.h"

namespace twinkle::sampling::testing {

class FakeEngine final : public training::EngineLink {
 public:
  absl::StatusOr<ipc::Message> Call(ipc::Message request) override {
    const std::string& method = request.envelope.method;
    if (method == ipc::kMethodCreateAdapter) {
      return ipc::MakeReply(request.envelope, absl::OkStatus(), ipc::Pack(ipc::CreateAdapterReply{10, 1.0}));
    }
    if (method == ipc::kMethodGetAdapterState) {
      return ipc::MakeReply(request.envelope, absl::OkStatus(), ipc::Pack(ipc::AdapterStateReply{}));
    }
    return ipc::MakeReply(request.envelope, absl::OkStatus(), "");
  }
  uint64_t generation() const override { return 1; }
  int64_t vocab_size() const override { return 100; }
  int64_t state_slots() const override { return state_slots_; }
  int64_t state_slots_ = 0;  // a hybrid model's recurrent state slots (0: a dense model)
  std::vector<std::string> supported_losses() const override { return {"cross_entropy"}; }
};

}  // namespace twinkle::sampling::testing
