#pragma once
// How the training coordinator reaches the engine: one blocking call at a time from the
// scheduler thread. The server implements it over the Supervisor (core/engine_client).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/common/activation_memory.h"
#include "core/ipc/envelope.h"

namespace twinkle::training {

class EngineLink {
 public:
  virtual ~EngineLink() = default;
  // Sends `request` (method, body, buffers) and waits for the reply; the worker's error
  // comes back as the Status.
  virtual absl::StatusOr<ipc::Message> Call(ipc::Message request) = 0;
  // Changes whenever an engine behind the link (re)loaded the model.
  virtual uint64_t generation() const = 0;
  // After generation() changed: whether that restart dropped this adapter's device state.
  // One engine: every adapter went with it. A data-parallel group whose rank restarted
  // alone: only the adapters that rank was home to.
  virtual bool Dropped(const std::string& adapter_key) {
    (void)adapter_key;
    return true;
  }
  // The loaded model's vocabulary size (token ids are validated against it).
  virtual int64_t vocab_size() const = 0;
  // The model's max_position_embeddings (0 = unknown): prompt + max_tokens must fit.
  virtual int64_t max_position_embeddings() const { return 0; }
  // A hybrid model's recurrent state slots per worker (0 = none or unknown): a request's
  // samples must fit, since each running sample holds one.
  virtual int64_t state_slots() const { return 0; }
  // A forward_backward's activation memory as the engine estimates it for the loaded model
  // (core/common/activation_memory.h); unknown (zeros) by default: no memory admission.
  virtual ActivationCost activation_cost() const { return {}; }
  // Loss names the engine implements.
  virtual std::vector<std::string> supported_losses() const = 0;
};

}  // namespace twinkle::training
