// libFuzzer entry point for the engine link's messages as the engine decodes them: the input
// is split into frames (a 2-byte little-endian length before each; a short tail is the last
// frame), DecodeFrames parses the envelope, and the body is unpacked as the method it names
// (or, for any other name, as the first byte picks) exactly as request_handler.cc, trainer.cc
// and the sampler do with ipc::Unpack; every TensorDesc it carries then goes through
// ValidateTensor, and the 1-D ones through ReadVectorFrame. Invariants: no crash, sanitizer
// report or allocation beyond libFuzzer's malloc limit; a tensor that validates fits its frame.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "core/ipc/envelope.h"
#include "core/ipc/messages.h"
#include "core/ipc/training_messages.h"

namespace ipc = twinkle::ipc;

namespace {

std::vector<std::string> SplitFrames(const uint8_t* data, size_t size) {
  std::vector<std::string> frames;
  size_t i = 0;
  while (i < size) {
    if (size - i < 2) {
      frames.emplace_back(reinterpret_cast<const char*>(data + i), size - i);
      break;
    }
    const size_t len = std::min<size_t>(data[i] | (size_t{data[i + 1]} << 8), size - i - 2);
    frames.emplace_back(reinterpret_cast<const char*>(data + i + 2), len);
    i += 2 + len;
  }
  return frames;
}

void Check(const ipc::TensorDesc& desc, const std::vector<std::string>& buffers) {
  if (!ipc::ValidateTensor(desc, buffers).ok()) return;
  size_t numel = 1;
  for (int64_t d : desc.shape) numel *= static_cast<size_t>(d);
  if (numel * *ipc::DtypeItemSize(desc.dtype) != buffers[desc.frame].size()) std::abort();
  if (desc.shape.size() == 1) {
    (void)ipc::ReadVectorFrame<float>(desc, buffers, "fuzz");
    (void)ipc::ReadVectorFrame<int64_t>(desc, buffers, "fuzz");
  }
}

void Check(const std::map<std::string, ipc::TensorDesc>& tensors, const std::vector<std::string>& buffers) {
  for (const auto& [name, desc] : tensors) Check(desc, buffers);
}

template <typename T>
bool Decode(const ipc::Message& m, absl::string_view what, T* out = nullptr) {
  absl::StatusOr<T> body = ipc::Unpack<T>(m.envelope.body, what);
  if (body.ok() && out != nullptr) *out = *std::move(body);
  return body.ok();
}

void DecodeBody(const ipc::Message& m, uint8_t pick) {
  const std::string& method = m.envelope.method;
  const std::vector<std::string>& buffers = m.buffers;
  if (method == ipc::kMethodLoadModel || pick == 0) Decode<ipc::LoadModelRequest>(m, "load_model");
  if (method == ipc::kMethodCreateAdapter || pick == 1) Decode<ipc::CreateAdapterRequest>(m, "create_adapter");
  if (method == ipc::kMethodRemoveAdapter || method == ipc::kMethodZeroGrad ||
      method == ipc::kMethodGetAdapterState || pick == 2) {
    Decode<ipc::AdapterRequest>(m, "adapter");
  }
  if (method == ipc::kMethodForward || method == ipc::kMethodForwardBackward || pick == 3) {
    Decode<ipc::ForwardRequest>(m, "forward");
  }
  if (method == ipc::kMethodOptimStep || pick == 4) Decode<ipc::OptimStepRequest>(m, "optim_step");
  if (method == ipc::kMethodSetOptimizer || pick == 5) Decode<ipc::SetOptimizerRequest>(m, "set_optimizer");
  if (method == ipc::kMethodClipGradNorm || pick == 6) Decode<ipc::ClipGradNormRequest>(m, "clip_grad_norm");
  if (method == ipc::kMethodSetAdapterState || pick == 7) {
    ipc::SetAdapterStateRequest req;
    if (Decode(m, "set_adapter_state", &req)) {
      Check(req.weights, buffers);
      if (req.grads) Check(*req.grads, buffers);
      Check(req.optimizer, buffers);
    }
  }
  if (pick == 8) Decode<ipc::OptimStepReply>(m, "optim_step reply");
  if (method == ipc::kMethodSample || pick == 9) Decode<ipc::SampleRequest>(m, "sample");
  if (method == ipc::kMethodSampleStep || pick == 10) Decode<ipc::SampleStepRequest>(m, "sample_step");
  if (method == ipc::kMethodDebugSleep || method == ipc::kMethodDebugReplyFrames || pick == 11) {
    Decode<ipc::DebugRequest>(m, "debug");
  }
  // The replies the coordinator decodes from the engine, and the handshake.
  if (pick == 12) Decode<ipc::HelloBody>(m, "hello");
  if (pick == 13) Decode<ipc::HeartbeatBody>(m, "heartbeat");
  if (pick == 14) {
    ipc::AdapterStateReply reply;
    if (Decode(m, "get_adapter_state reply", &reply)) {
      Check(reply.weights, buffers);
      Check(reply.grads, buffers);
      Check(reply.optimizer, buffers);
    }
  }
  if (pick == 15) Decode<ipc::ForwardReply>(m, "forward reply");
  if (pick == 16) Decode<ipc::SampleStepReply>(m, "sample_step reply");
  if (pick == 17) Decode<ipc::LoadModelReply>(m, "load_model reply");
  if (pick == 18) {
    ipc::TensorDesc desc;
    if (Decode(m, "tensor", &desc)) Check(desc, buffers);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t pick = data[0] % 24;  // 19..23: only the method name decides
  absl::StatusOr<ipc::Message> message = ipc::DecodeFrames(SplitFrames(data + 1, size - 1));
  if (!message.ok()) return 0;
  (void)ipc::ReplyStatus(message->envelope);
  DecodeBody(*message, pick);
  return 0;
}
