#pragma once
// Executes the coordinator's requests on this worker's device. Holds the loaded base model.
// This is the engine's exception boundary: LibTorch throws, we return absl::Status.

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/ipc/envelope.h"

namespace twinkle::engine {

struct LoadedModel;

class RequestHandler {
 public:
  explicit RequestHandler(std::string device);
  ~RequestHandler();

  // Runs one request and returns its reply body (msgpack bytes) or the error to send back.
  absl::StatusOr<std::string> Handle(const ipc::Message& request);

 private:
  absl::StatusOr<std::string> LoadModel(const std::string& body);

  std::string device_;
  std::unique_ptr<LoadedModel> model_;
};

}  // namespace twinkle::engine
