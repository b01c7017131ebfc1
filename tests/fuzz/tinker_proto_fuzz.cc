// libFuzzer entry point for the Tinker protobuf bodies of forward_backward: any byte string
// goes through ForwardBackwardRequest::ParseFromString and, when it parses, LossFromProto and
// DatumFromProto, which decode every loss_fn_input tensor (TensorValues: dense and sparse CSR,
// float32 / bfloat16 / int32 / int64). Invariants: no crash or sanitizer report, and no
// loss_fn_input decodes to more values than the datum has model_input tokens when it came
// sparse (the bound TensorValues enforces before densifying).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "google/protobuf/stubs/logging.h"
#include "server/tinker/tinker_json.h"
#include "tinker/v1/tinker_public.pb.h"

namespace tk = twinkle::tinker;

// protobuf logs every invalid UTF-8 string field it refuses; that is noise here.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tk::v1::ForwardBackwardRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  (void)tk::LossFromProto(request);
  for (int i = 0; i < request.data_size(); ++i) {
    const tk::v1::Datum& datum = request.data(i);
    absl::StatusOr<twinkle::training::TokenDatum> d = tk::DatumFromProto(datum, absl::StrCat("data[", i, "]"));
    if (!d.ok()) continue;
    const size_t tokens = d->input_tokens.size();
    for (const auto& [name, tensor] : datum.loss_fn_inputs()) {
      if (!tensor.has_sparse_csr()) continue;
      if (name == "target_tokens") {
        if (d->target_tokens.size() > tokens) std::abort();
      } else if (d->inputs.at(name).size() > tokens) {
        std::abort();
      }
    }
  }
  // Each tensor on its own, with the smallest and a generous bound, as the datum decoder
  // would see it from a short or a long model_input.
  for (const tk::v1::Datum& datum : request.data()) {
    for (const auto& [name, tensor] : datum.loss_fn_inputs()) {
      for (size_t bound : {size_t{0}, size_t{1} << 16}) {
        absl::StatusOr<std::vector<double>> v = tk::TensorValues(tensor, name, bound);
        if (v.ok() && tensor.has_sparse_csr() && v->size() > bound) std::abort();
      }
    }
  }
  return 0;
}
