#include "core/engine/tensor_io.h"

#include <ATen/ATen.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace twinkle::engine {
namespace {

absl::StatusOr<c10::ScalarType> ToScalarType(const std::string& name) {
  if (name == "float32") return c10::ScalarType::Float;
  if (name == "float64") return c10::ScalarType::Double;
  if (name == "bfloat16") return c10::ScalarType::BFloat16;
  if (name == "float16") return c10::ScalarType::Half;
  if (name == "int64") return c10::ScalarType::Long;
  if (name == "int32") return c10::ScalarType::Int;
  if (name == "uint8") return c10::ScalarType::Byte;
  if (name == "bool") return c10::ScalarType::Bool;
  return absl::InvalidArgumentError(absl::StrCat("unsupported tensor dtype '", name, "'"));
}

absl::StatusOr<std::string> ToDtypeName(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float: return "float32";
    case c10::ScalarType::Double: return "float64";
    case c10::ScalarType::BFloat16: return "bfloat16";
    case c10::ScalarType::Half: return "float16";
    case c10::ScalarType::Long: return "int64";
    case c10::ScalarType::Int: return "int32";
    case c10::ScalarType::Byte: return "uint8";
    case c10::ScalarType::Bool: return "bool";
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("tensor dtype ", c10::toString(type), " cannot cross the IPC boundary"));
  }
}

}  // namespace

absl::StatusOr<ipc::TensorDesc> AppendTensor(const at::Tensor& tensor, ipc::Message& message) {
  absl::StatusOr<std::string> dtype = ToDtypeName(tensor.scalar_type());
  if (!dtype.ok()) return dtype.status();
  // Host tensors that are already dense are read as they are (no detach/copy dispatches).
  const at::Tensor cpu =
      tensor.is_cpu() && tensor.is_contiguous() ? tensor : tensor.detach().to(at::kCPU).contiguous();
  ipc::TensorDesc desc;
  desc.dtype = *dtype;
  desc.shape.assign(cpu.sizes().begin(), cpu.sizes().end());
  desc.frame = static_cast<uint32_t>(message.buffers.size());
  message.buffers.emplace_back(static_cast<const char*>(cpu.data_ptr()), cpu.nbytes());
  return desc;
}

absl::StatusOr<at::Tensor> ReadTensor(const ipc::TensorDesc& desc, const ipc::Message& message) {
  if (absl::Status s = ipc::ValidateTensor(desc, message.buffers); !s.ok()) return s;
  absl::StatusOr<c10::ScalarType> type = ToScalarType(desc.dtype);
  if (!type.ok()) return type.status();
  at::Tensor out = at::empty(desc.shape, at::TensorOptions().dtype(*type));
  const std::string& frame = message.buffers[desc.frame];
  if (!frame.empty()) std::memcpy(out.data_ptr(), frame.data(), frame.size());
  return out;
}

}  // namespace twinkle::engine
