#pragma once
// Executes the coordinator's requests on this worker's device. Holds the loaded base model
// (and, with the training engine, the adapters). This is the engine's exception boundary:
// LibTorch throws, we return absl::Status.

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "core/engine/distributed.h"
#include "core/ipc/envelope.h"

namespace twinkle::engine {

class Trainer;

// A method's reply: its msgpack body and the tensor frames the body refers to.
using MethodReply = ipc::Message;
using Method = std::function<absl::StatusOr<MethodReply>(const ipc::Message& request)>;

class RequestHandler {
 public:
  // test_hooks: also answer the debug methods (ipc::kMethodDebugSleep, ...).
  // distributed: world_size > 1 joins the training ranks' process group at load_model.
  RequestHandler(std::string device, bool test_hooks, DistributedOptions distributed = {});
  ~RequestHandler();

  // Runs one request; the reply carries the method's body and tensor frames.
  absl::StatusOr<MethodReply> Handle(const ipc::Message& request);

 private:
  absl::StatusOr<MethodReply> LoadModel(const ipc::Message& request);

  std::string device_;
  DistributedOptions distributed_;
  std::map<std::string, Method> methods_;
  std::unique_ptr<Trainer> trainer_;
};

}  // namespace twinkle::engine
