#pragma once
// The OpenAI-compatible inference routes on the HTTP port (docs/openai.md):
//   GET  /v1/models            the base model and the caller's sampler checkpoints
//   POST /v1/completions       prompt as text, token ids, or a list of either
//   POST /v1/chat/completions  messages rendered by the model's chat renderer
// Thin handlers: authenticate (the Tinker API keys), decode (openai_codec), submit to the
// SamplerCoordinator exactly as Tinker's asample does (same sessions, limits, rate limiter,
// metering, continuous batch), encode; stream: true answers server-sent events.

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "server/config/config.h"
#include "server/http/http_server.h"
#include "server/openai/openai_codec.h"
#include "server/serving_state.h"
#include "server/tinker/tinker_api.h"

namespace twinkle::openai {

// The largest request body of a /v1 route: a longer one is answered 413 from its header,
// before the body is read.
inline constexpr size_t kMaxBodyBytes = size_t{4} << 20;

struct OpenAiOptions {
  std::string base_model;  // model.name: the id /v1/models lists and requests name
  std::string model_dir;   // model.path (absolute): also accepted as the base model's id
  Limits limits;
  // Text in and out; null = token ids only (text prompts and chat are refused, outputs carry
  // token_ids and empty text).
  std::shared_ptr<const tokenizer::Tokenizer> tokenizer;
  std::shared_ptr<const tokenizer::ChatRenderer> renderer;
  // Why they are missing (the loader's error), for the 501 that text and chat then answer.
  std::string tokenizer_error = "no tokenizer was loaded";
  std::string renderer_error = "no chat renderer was loaded";
};

// The options a config describes: model.name, the model directory, sampler.max_num_samples.
OpenAiOptions OptionsFromConfig(const Config& config, const std::string& model_dir);

// Adds the routes and their header check (key and body size before the body is read); call
// before HttpServer::Start. `state` and `tinker` outlive the server. `models`: one entry per
// served base model, in the order of state.models (config `models:`): a request's `model`
// picks one by its id, or by the base model a checkpoint path was trained on.
void AddOpenAiRoutes(HttpServer& http, ServingState& state, tinker::TinkerApi& tinker,
                     std::vector<OpenAiOptions> models);

}  // namespace twinkle::openai
