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

// What every link over a Supervisor answers from the model the workers loaded (the
// supervisor's ModelInfo, taken from rank 0's load reply); 0 / empty before the first load.
class SupervisorModelLink : public training::EngineLink {
 public:
  int64_t vocab_size() const override { return Info().vocab_size; }
  int64_t max_position_embeddings() const override { return Info().max_position_embeddings; }
  int64_t state_slots() const override { return Info().state_slots; }
  ActivationCost activation_cost() const override { return Info().activation_cost; }
  std::vector<std::string> supported_losses() const override { return Info().supported_losses; }

 protected:
  explicit SupervisorModelLink(Supervisor& supervisor) : supervisor_(supervisor) {}
  Supervisor& supervisor_;

 private:
  ModelInfo Info() const { return supervisor_.model_info().value_or(ModelInfo{}); }
};

class SupervisorEngineLink final : public SupervisorModelLink {
 public:
  explicit SupervisorEngineLink(Supervisor& supervisor, int32_t rank = 0)
      : SupervisorModelLink(supervisor), rank_(rank) {}
  absl::StatusOr<ipc::Message> Call(ipc::Message request) override {
    return supervisor_.CallAndWait(rank_, std::move(request));
  }
  uint64_t generation() const override { return supervisor_.engine_generation(rank_); }

 private:
  const int32_t rank_;
};

}  // namespace twinkle
