#pragma once
// Generation for the `sample` IPC method: prefill + decode with a KV cache, every (row,
// sample) one sequence, all live sequences decoding together in one batched step (a finished
// sequence simply leaves the batch). Each sequence gets its own adapter's LoRA terms through
// the decoder's per-segment LoRA callback (one sequence = one segment; base-only sequences get
// none) and draws from its own generator seeded by (seed, sample index), so its tokens do not
// depend on what else is in the batch.
//
// Token choice, in transformers' LogitsWarper order: temperature 0 = argmax; otherwise
// logits / temperature, then top-k (keep scores >= the k-th largest), then top-p (drop the
// smallest-probability tokens whose cumulative probability is <= 1 - top_p, always keeping
// the most likely one), softmax, one multinomial draw. Reported logprobs are those of the
// unwarped model (log_softmax of the raw logits), as a training forward pass computes them.
//
// Not yet: paged KV blocks and prompt sharing across samples (each sample prefills its own
// copy of the prompt), admission of new requests into a running batch.

#include <functional>
#include <string>

#include <c10/core/Device.h>

#include "absl/status/statusor.h"
#include "core/engine/lora/adapter.h"
#include "core/engine/model/decoder.h"
#include "core/engine/request_handler.h"

namespace twinkle::engine {

using AdapterLookup = std::function<absl::StatusOr<Adapter*>(const std::string& id)>;

// Runs one `sample` request (ipc::SampleRequest -> ipc::SampleReply).
absl::StatusOr<MethodReply> Sample(const DecoderModel& model, c10::Device device,
                                   const AdapterLookup& find_adapter, const ipc::Message& request);

}  // namespace twinkle::engine
