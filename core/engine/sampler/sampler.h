#pragma once
// Generation on one worker: a paged KV cache (kv_cache.h) and a continuous batch.
//
// Every (request, sample) is a sequence with its own block table. A request is admitted
// only when the pool can hold all of it: num_samples × ceil((P + max_tokens) / block_size)
// blocks, less the blocks that hold only prompt tokens (floor(P / block_size) of them), which
// its samples share, so it needs
//     floor(P / B) + num_samples × (ceil((P + max_tokens) / B) − floor(P / B))
// blocks, all taken at admission, so a running sequence never runs out of cache. A sample's
// blocks go back as soon as it finishes (stop or length) or its request is cancelled.
// Hybrid models (Qwen3.5) also take one recurrent state slot per sample at admission (the
// conv and delta-rule states of every DeltaNet layer, KvBlockPool), released with its
// blocks; a request waits (deferred) until both fit. Its prefill runs the chunked delta
// rule and leaves each sequence's state in its slot (copied to the other samples); each
// decode step advances the states by the recurrent form.
//
// Admission prefills the admitted requests' prompts in one packed pass (each prompt once,
// whatever num_samples; the samples then copy the prompt's last, partly filled block) and
// picks every sample's first token from the prompt's last logits. Each decode step then
// advances every running sequence by one token in one batched pass: linear layers over all
// rows, LoRA as one segment per sequence (its request's adapter), attention per sequence
// over its own blocks (kernels::PagedDecodeAttention).
//
// Token choice, in the order of transformers' generate (_get_logits_processor: processors,
// then the warpers when sampling). First the penalties, on a copy of the raw logits, each off
// at its default and then costing nothing (no copy, no counts): repetition_penalty
// (RepetitionPenaltyLogitsProcessor: each distinct token of the prompt and of the sample's
// tokens so far, logit > 0 divided by it, else multiplied), then presence / frequency
// (OpenAI's formula over the sample's tokens so far, not the prompt: logit - count x
// frequency - (count > 0) x presence; each sample keeps its own counts). Then temperature 0 =
// argmax of those; otherwise logits / temperature, then top-k (keep scores >= the k-th
// largest), then top-p (drop the smallest-probability tokens whose cumulative probability is
// <= 1 - top_p, always keeping the most likely one), then min-p (MinPLogitsWarper: drop
// tokens whose probability is < min_p x the largest), softmax, one multinomial draw from the
// sample's own generator, seeded by (seed, sample index). Reported logprobs are those of the
// unwarped, unpenalised model
// (logit - logsumexp of the raw logits), as a training forward pass computes them. Asked
// for (row.top_logprobs, row.prompt_top_logprobs: k <= min(vocab, ipc::kMaxTopLogprobs)),
// the k most likely tokens of each generated / prompt position come with the same logprobs,
// by descending logprob and equal ones by ascending token id; a prompt needs the logits of
// all its rows for that (as for prompt logprobs), otherwise only its last row's. k = 0 costs
// nothing.
//
// Determinism: a sequence's draws depend only on its seed and sample index, its attention
// and LoRA terms only on its own rows, so its tokens do not depend on what else is in the
// batch or when it joined, up to one thing: the base model's matrix products run over all
// rows of a pass, and the BLAS may round a row differently for a different number of rows
// (gemv for one row, gemm kernels for more). Those are last-bit differences; they change a
// token only where the top two logits are that close (docs/architecture.md, sampler).
//
// Two entry points share this implementation:
//   sample       one-shot: every row admitted in order as blocks allow, stepped until all
//                are done, in a private batch (so it never touches the sample_step batch,
//                but shares the pool with it).
//   sample_step  the coordinator's continuous batch (ipc::SampleStepRequest): cancels,
//                early stops of single samples (a stop string the coordinator matched on
//                the tokens report_tokens rows report each call; a request's first report
//                also carries its prompt log-probs when asked, for a stream's echo), FIFO admission (rejected /
//                deferred / admitted), up to max_decode_steps steps, finished results. With nothing to admit and max_decode_steps 0 it
//                does no work and only reports the cache occupancy (the stats call).
// Removing an adapter drops its running sample_step requests; the next sample_step reply
// reports each as rejected with error "adapter removed". Running requests use their
// adapter's weights as they are at each step: the coordinator samples from immutable
// snapshot adapters. Training calls in between (forward_backward, optim_step, offloads of
// other adapters) leave the sampling state alone.

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/engine/lora/adapter.h"
#include "core/engine/model/decoder.h"
#include "core/engine/request_handler.h"
#include "core/engine/sampler/kv_cache.h"
#include "core/ipc/training_messages.h"

namespace twinkle::engine {

using AdapterLookup = std::function<absl::StatusOr<Adapter*>(const std::string& id)>;

class GenerationBatch;

class Sampler {
 public:
  static absl::StatusOr<std::unique_ptr<Sampler>> Create(const DecoderModel& model,
                                                         c10::Device device, at::ScalarType dtype,
                                                         KvCacheSize cache_size,
                                                         AdapterLookup find_adapter);
  ~Sampler();

  // ipc::SampleRequest -> ipc::SampleReply. A bad row fails the whole call (InvalidArgument,
  // NotFound for an unknown adapter), a row larger than the cache too; ResourceExhausted when
  // a row fits the cache but not beside the running sample_step requests.
  absl::StatusOr<MethodReply> Sample(const ipc::Message& request);
  // ipc::SampleStepRequest -> ipc::SampleStepReply.
  absl::StatusOr<MethodReply> SampleStep(const ipc::Message& request);

  // Called before an adapter is destroyed: its running sample_step requests are dropped.
  void AdapterRemoved(const Adapter* adapter);

  int64_t blocks_total() const { return pool_->total(); }
  int64_t block_size() const { return pool_->block_size(); }
  int64_t states_total() const { return pool_->states_total(); }

 private:
  Sampler(const DecoderModel& model, c10::Device device, std::unique_ptr<KvBlockPool> pool,
          AdapterLookup find_adapter);

  const DecoderModel& model_;
  c10::Device device_;
  std::unique_ptr<KvBlockPool> pool_;
  AdapterLookup find_adapter_;
  std::unique_ptr<GenerationBatch> running_;              // the sample_step batch
  std::vector<ipc::SampleRejectedMsg> pending_rejected_;  // for the next sample_step reply
};

}  // namespace twinkle::engine
