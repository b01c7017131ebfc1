#pragma once
// The EngineLink of a running server: the training coordinator reaches engine rank 0
// through the supervisor; the sampler reaches each rank of the sampler pool's supervisor the
// same way when it has one. A link's generation is its own rank's: another rank's restart
// does not touch it. Header-only: the interface is core/training's, the transport
// core/engine_client's; tests use a fake EngineLink instead
// (tests/unit/core/training/coordinator_window_test.cc).

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/engine_client/supervisor.h"
#include "core/training/engine_link.h"

namespace twinkle {

class SupervisorEngineLink final : public training::EngineLink {
 public:
  explicit SupervisorEngineLink(Supervisor& supervisor, int32_t rank = 0) : supervisor_(supervisor), rank_(rank) {}
  absl::StatusOr<ipc::Message> Call(ipc::Message request) override {
    return supervisor_.CallAndWait(rank_, std::move(request));
  }
  uint64_t generation() const override { return supervisor_.engine_generation(rank_); }
  int64_t vocab_size() const override {
    std::optional<ModelInfo> info = supervisor_.model_info();
    return info ? info->vocab_size : 0;
  }
  int64_t max_position_embeddings() const override {
    std::optional<ModelInfo> info = supervisor_.model_info();
    return info ? info->max_position_embeddings : 0;
  }
  int64_t state_slots() const override {
    std::optional<ModelInfo> info = supervisor_.model_info();
    return info ? info->state_slots : 0;
  }
  std::vector<std::string> supported_losses() const override {
    std::optional<ModelInfo> info = supervisor_.model_info();
    return info ? info->supported_losses : std::vector<std::string>{};
  }

 private:
  Supervisor& supervisor_;
  const int32_t rank_;
};

}  // namespace twinkle
