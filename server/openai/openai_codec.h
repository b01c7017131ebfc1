#pragma once
// The OpenAI-compatible API's wire format (docs/openai.md): request bodies of
// /v1/completions and /v1/chat/completions parsed into typed requests, results encoded as
// OpenAI's completion, chat completion and stream chunk objects, and errors in OpenAI's
// shape {"error": {"message", "type", "param", "code"}}. No transport, no sampler: the
// routes (openai_routes.cc) connect this to the HTTP server and the sampler.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/sampling/types.h"
#include "core/tokenizer/chat_renderer.h"

namespace twinkle::tokenizer {
class Tokenizer;
}  // namespace twinkle::tokenizer

namespace twinkle::openai {

using Json = nlohmann::json;

enum class Endpoint { kCompletions, kChat };

// What the server allows (docs/openai.md, "Limits"); each is checked before any work.
struct Limits {
  int64_t max_n = 128;              // n (sampler.max_num_samples)
  int64_t max_top_logprobs = 20;    // logprobs (completions) / top_logprobs (chat)
  size_t max_stop = 16;             // stop strings
  size_t max_prompts = 64;          // prompts in one /v1/completions request
  size_t max_messages = 1024;       // chat messages
};

// One prompt as given: token ids, or text to encode.
struct Prompt {
  bool is_text = false;
  std::string text;
  std::vector<int64_t> ids;
};

struct Request {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string model;
  std::vector<Prompt> prompts;                    // completions
  std::vector<tokenizer::ChatMessage> messages;   // chat
  tokenizer::RenderOptions render;                // chat
  int64_t n = 1;
  int64_t max_tokens = 0;  // 0 = the server's default
  double temperature = 1.0;
  double top_p = 1.0;
  int64_t top_k = 0;  // 0 = off
  // The engine's penalties and min-p (docs/openai.md, "Penalties and min_p"); off at these.
  double min_p = 0;                 // [0, 1]
  double presence_penalty = 0;      // [-2, 2]
  double frequency_penalty = 0;     // [-2, 2]
  double repetition_penalty = 1;    // > 0 (vLLM's extension)
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  std::vector<int64_t> stop_token_ids;  // vLLM's extension
  bool ignore_eos = false;              // vLLM's extension
  bool skip_special_tokens = true;      // vLLM's extension
  // Log-probs of the chosen tokens (completions: logprobs given, chat: logprobs true) and
  // how many alternatives per position (completions: logprobs, chat: top_logprobs).
  bool logprobs = false;
  int64_t top_logprobs = 0;
  bool echo = false;  // completions
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
};

// Parses a request body (already JSON). Unknown keys are ignored; OpenAI parameters this
// server does not implement are refused when set to anything but their no-op value.
// Errors are InvalidArgument carrying the parameter's name (ParamOf).
absl::StatusOr<Request> ParseRequest(const Json& body, Endpoint endpoint, const Limits& limits);

// An InvalidArgument (or `code`) error about parameter `param`, which the error body names.
absl::Status ParamError(const std::string& param, const std::string& message,
                        absl::StatusCode code = absl::StatusCode::kInvalidArgument,
                        const std::string& openai_code = "");
// The parameter an error names (ParamError), or "".
std::string ParamOf(const absl::Status& status);

// OpenAI's error body for `status`, whose HTTP status is `http_status`.
Json ErrorBody(const absl::Status& status, int http_status);

// ---- responses ----------------------------------------------------------------------------

// How the encoders turn token ids into text. `tokenizer` null: no text (empty strings) and
// tokens named "token_id:<id>", as vLLM's return_tokens_as_token_ids does.
struct TextCodec {
  const tokenizer::Tokenizer* tokenizer = nullptr;
  bool skip_special_tokens = true;
  std::string Text(const std::vector<int64_t>& ids) const;
  std::string TokenName(int64_t id) const;
};

// What one request asked and got, for the encoders.
struct Result {
  std::string id;       // "cmpl-…" / "chatcmpl-…"
  int64_t created = 0;  // unix seconds
  std::string model;    // as the request named it
  std::vector<std::vector<int64_t>> prompt_ids;  // per prompt (what was sampled on)
  const sampling::SampleOutput* output = nullptr;
};

// The finished sequence's tokens as the client sees them: generated tokens up to, not
// including, a stop token that ended it; and, when a stop string matched, the text cut
// before it. Shared by the whole and the streamed forms.
struct Choice {
  std::vector<int64_t> token_ids;  // every generated token (stop token included)
  std::string text;                // decoded, stop token and stop string left out
  std::string finish_reason;       // "stop" | "length"
};
Choice MakeChoice(const sampling::SampledSequence& seq, const Request& request, const TextCodec& codec,
                  const std::vector<int64_t>& stop_ids);

Json Usage(const Result& result);
// The whole (non-streamed) response.
Json CompletionResponse(const Request& request, const Result& result, const TextCodec& codec,
                        const std::vector<int64_t>& stop_ids);

// Stream chunks, each to be sent as "data: <json>\n\n".
// `logprobs`: the chunk's (LogprobsOf), or null.
Json StreamChunk(const Request& request, const std::string& id, int64_t created, const std::string& model,
                 int64_t index, const std::string& text, const std::vector<int64_t>& token_ids,
                 const std::optional<std::string>& finish_reason, bool first_of_choice, Json logprobs = nullptr);
// The log-probs of `seq`'s tokens in the endpoint's shape (completions: tokens, token_logprobs,
// top_logprobs, text_offset from `text_offset`; chat: content), request.top_logprobs wide.
Json LogprobsOf(const Request& request, const sampling::SampledSequence& seq, const TextCodec& codec,
                size_t text_offset = 0);
// Completions with echo and logprobs: the prompt's tokens with their log-probs (`scores`'
// prompt_logprobs / prompt_top_logprobs; the first token's null), then `seq`'s tokens, one
// list, offsets from 0. The whole answer's, and a stream's first chunk of each choice.
Json EchoedLogprobsOf(const Request& request, const std::vector<int64_t>& prompt,
                      const sampling::PromptOutput& scores, const sampling::SampledSequence& seq,
                      const TextCodec& codec);
Json UsageChunk(const Request& request, const std::string& id, int64_t created, const std::string& model,
                int64_t prompt_tokens, int64_t completion_tokens);

}  // namespace twinkle::openai
