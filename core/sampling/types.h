#pragma once
// What a sampling op produces: plain structs, no protobuf, no torch. They are alternatives of
// the typed future value (core/futures/future_value.h), so they live apart from the
// SamplerCoordinator that makes them.

#include <cstdint>
#include <string>
#include <vector>

namespace twinkle::sampling {

// The k most likely tokens at each of a run of positions, row-major [positions, k], by
// descending logprob (the model's log-softmax of the raw logits); equal logprobs by ascending
// token id. k = 0: not asked (both empty).
struct TopLogprobs {
  int64_t k = 0;
  std::vector<int64_t> token_ids;
  std::vector<float> logprobs;
  size_t positions() const { return k > 0 ? token_ids.size() / static_cast<size_t>(k) : 0; }
};

struct SampledSequence {
  std::vector<int64_t> tokens;  // generated tokens only; a stop token that ended it is last
  std::vector<float> logprobs;  // log p(token) under the model (log-softmax of the raw logits)
  std::string stop_reason;      // "stop" | "length"
  TopLogprobs top_logprobs;     // when asked: one position per token
};

struct PromptOutput {
  std::vector<SampledSequence> sequences;  // num_samples of them, in order
  // [P] when asked: prompt_logprobs[i] = log p(prompt[i] | prompt[:i]); [0] is NaN.
  std::vector<float> prompt_logprobs;
  // [P] positions when asked, aligned like prompt_logprobs: position i is the distribution
  // that predicts prompt[i] from prompt[:i]; position 0 has none (ids -1, logprobs NaN).
  TopLogprobs prompt_top_logprobs;
  // [P - 1, width] when target_prompt_tokens were given: the log-prob of each asked id (row i
  // at prompt position i + 1), 0 where the id was -1.
  std::vector<float> target_prompt_logprobs;
  // [P - 1, k] when prompt_alt_tokens_k was given: the draws and the model's log-prob of each.
  std::vector<int64_t> prompt_alt_token_ids;
  std::vector<float> prompt_alt_logprobs;
};

// The future value of SubmitSample: one PromptOutput per prompt, in order.
struct SampleOutput {
  std::vector<PromptOutput> prompts;
};

// The future value of SubmitSnapshotSession.
struct SnapshotSession {
  std::string sampling_session_id;
};

}  // namespace twinkle::sampling
