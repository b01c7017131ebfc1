#include "server/openai/openai_routes.h"

#include <algorithm>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/common/log.h"
#include "core/sampling/sampler_coordinator.h"
#include "core/tenancy/rate_limiter.h"
#include "core/tokenizer/tokenizer.h"
#include "server/status_map.h"
#include "server/tinker/tinker_internal.h"
#include "server/tinker/tinker_json.h"

namespace twinkle::openai {
namespace {

std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

// Every error in OpenAI's shape, its HTTP status from the one Status map.
HttpResponse ErrorResponse(const absl::Status& status) {
  const int code = ToHttpStatus(status);
  HttpResponse r{code, "application/json", Dump(ErrorBody(status, code))};
  if (code == 429) {
    r.headers.emplace_back("Retry-After", absl::StrCat(std::max<int64_t>(tenancy::RetryAfterSeconds(status).value_or(1), 1)));
  }
  return r;
}

// 413: a body over kMaxBodyBytes (from its Content-Length, or read whole when it had none).
HttpResponse TooLarge(size_t bytes) {
  HttpResponse r = ErrorResponse(ParamError(
      "", absl::StrCat("the request body has ", bytes, " bytes; the limit is ", kMaxBodyBytes), absl::StatusCode::kInvalidArgument,
      "request_too_large"));
  r.status = 413;
  return r;
}

std::string Event(const Json& j) { return absl::StrCat("data: ", Dump(j), "\n\n"); }

std::string RandomId(const char* prefix) { return absl::StrCat(prefix, NewRequestId()); }

// A streamed request's shared state: the events its decode-thread callback makes before the
// response head is out wait here (the callback may run before the handler has the stream).
class EventSink {
 public:
  void Send(std::string event) {
    absl::MutexLock lock(&mu_);
    if (http_ != nullptr) {
      http_->Write(std::move(event));
    } else {
      early_.push_back(std::move(event));
    }
  }
  void End() {
    absl::MutexLock lock(&mu_);
    if (http_ != nullptr) {
      http_->End();
    } else {
      ended_ = true;
    }
  }
  void Attach(std::shared_ptr<HttpStream> http) {
    absl::MutexLock lock(&mu_);
    for (std::string& e : early_) http->Write(std::move(e));
    early_.clear();
    if (ended_) http->End();
    http_ = std::move(http);
  }

 private:
  absl::Mutex mu_;
  std::shared_ptr<HttpStream> http_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> early_ ABSL_GUARDED_BY(mu_);
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
};

// A streamed choice's text: decoded as tokens arrive (partial UTF-8 held back by the
// StreamDecoder), and held back further where a stop string may be starting.
struct ChoiceText {
  bool started = false;
  std::unique_ptr<tokenizer::StreamDecoder> decoder;
  std::string text;   // decoded so far
  size_t sent = 0;    // bytes of `text` already sent
  bool cut = false;   // a stop string matched: nothing more is sent
  size_t offset = 0;  // completions' text_offset of the next token (token texts so far)
};

// One streamed request: turns the sampler's deltas into chunk events.
struct StreamCall {
  Request request;
  std::string id, model;
  int64_t created = 0;
  TextCodec codec;
  EventSink sink;
  std::vector<std::string> echoed;  // echo: each prompt's text, sent first in each of its choices
  std::vector<std::vector<int64_t>> prompts;  // echo with logprobs: each prompt's tokens, likewise
  absl::Mutex mu;  // deltas of different lanes may interleave
  std::vector<ChoiceText> choices ABSL_GUARDED_BY(mu);

  // The new text of delta `d` of choice `c`; the same text, in the end, as MakeChoice's.
  std::string NewText(ChoiceText& c, const sampling::StreamDelta& d) const {
    if (codec.tokenizer == nullptr || c.cut) return "";
    if (c.decoder == nullptr) {
      c.decoder = std::make_unique<tokenizer::StreamDecoder>(*codec.tokenizer, codec.skip_special_tokens);
    }
    const bool last = !d.finish_reason.empty();
    for (size_t i = 0; i < d.tokens.size(); ++i) {
      const bool stop_token = last && d.finish_reason == "stop" && i + 1 == d.tokens.size() &&
                              std::find(request.stop_token_ids.begin(), request.stop_token_ids.end(), d.tokens[i]) !=
                                  request.stop_token_ids.end();
      if (!stop_token) c.text += c.decoder->Push(static_cast<int32_t>(d.tokens[i]));
    }
    if (last) c.text += c.decoder->Finish();
    size_t end = c.text.size();
    size_t found = std::string::npos;
    for (const std::string& stop : request.stop) found = std::min(found, c.text.find(stop));
    if (found != std::string::npos) {
      end = found;
      c.cut = true;
    } else if (!last) {
      // The longest end of the text that begins some stop string waits for the next tokens.
      for (const std::string& stop : request.stop) {
        for (size_t k = std::min(stop.size() - 1, c.text.size()); k > 0; --k) {
          if (absl::EndsWith(c.text, absl::string_view(stop).substr(0, k))) {
            end = std::min(end, c.text.size() - k);
            break;
          }
        }
      }
    }
    if (end <= c.sent) return "";
    std::string out = c.text.substr(c.sent, end - c.sent);
    c.sent = end;
    return out;
  }

  void OnDelta(const sampling::StreamDelta& d) {
    const int64_t index = static_cast<int64_t>(d.prompt_index) * request.n + d.sample;
    bool first = false;
    std::string text;
    Json logprobs = nullptr;
    {
      absl::MutexLock lock(&mu);
      if (static_cast<size_t>(index) >= choices.size()) choices.resize(index + 1);
      ChoiceText& c = choices[index];
      first = !c.started;
      c.started = true;
      text = NewText(c, d);
      if (first && d.prompt_index < echoed.size()) text = echoed[d.prompt_index] + text;
      const sampling::SampledSequence seq{d.tokens, d.logprobs, "", d.top_logprobs};
      if (first && request.logprobs && d.prompt_index < prompts.size()) {
        // echo: the prompt's tokens and log-probs lead the choice's first chunk.
        sampling::PromptOutput scores;
        scores.prompt_logprobs = d.prompt_logprobs;
        scores.prompt_top_logprobs = d.prompt_top_logprobs;
        logprobs = EchoedLogprobsOf(request, prompts[d.prompt_index], scores, seq, codec);
        for (int64_t t : prompts[d.prompt_index]) c.offset += codec.TokenName(t).size();
        for (int64_t t : d.tokens) c.offset += codec.TokenName(t).size();
      } else if (request.logprobs && !d.tokens.empty()) {
        logprobs = LogprobsOf(request, seq, codec, c.offset);
        for (int64_t t : d.tokens) c.offset += codec.TokenName(t).size();
      }
    }
    std::optional<std::string> finish;
    if (!d.finish_reason.empty()) finish = d.finish_reason == "stop" ? "stop" : "length";
    sink.Send(Event(StreamChunk(request, id, created, model, index, text, d.tokens, finish, first, std::move(logprobs))));
  }
};

class Handlers {
 public:
  Handlers(ServingState& state, tinker::TinkerApi& tinker, std::vector<OpenAiOptions> models)
      : state_(state), tinker_(tinker), models_(std::move(models)) {}

  HttpResponse Models(const HttpRequest& http) {
    absl::StatusOr<const tenancy::Tenant*> tenant = Admit(http);
    if (!tenant.ok()) return ErrorResponse(tenant.status());
    Json data = Json::array();
    // Every served base model (the default one first).
    for (const OpenAiOptions& m : models_) {
      data.push_back({{"id", m.base_model}, {"object", "model"}, {"created", 0}, {"owned_by", "twinkle"},
                      {"root", m.base_model}, {"parent", nullptr}});
    }
    // The caller's sampler checkpoints, then other tenants' published ones.
    absl::StatusOr<Json> checkpoints = tinker_.ListUserCheckpointsScoped(**tenant, 1 << 20, 0, "accessible");
    if (checkpoints.ok()) {
      for (const Json& c : (*checkpoints)["checkpoints"]) {
        if (c.value("checkpoint_type", "") != "sampler") continue;
        // Its base model: the one its run was trained on.
        const std::string path = c.value("tinker_path", "");
        const std::string base = state_.models->ForCheckpoint((*tenant)->id, tinker::InternalPath(path)).name();
        data.push_back({{"id", path}, {"object", "model"}, {"created", 0},
                        {"owned_by", c.value("public", false) ? std::string("published") : (*tenant)->id},
                        {"root", base}, {"parent", base}});
      }
    } else if (checkpoints.status().code() != absl::StatusCode::kUnimplemented) {
      return ErrorResponse(checkpoints.status());
    }
    return {200, "application/json", Dump({{"object", "list"}, {"data", std::move(data)}})};
  }

  void Generate(Endpoint endpoint, const HttpRequest& http, HttpResponder respond, HttpStreamer streamer) {
    if (http.body.size() > kMaxBodyBytes) return respond(TooLarge(http.body.size()));
    absl::StatusOr<Call> call = Prepare(endpoint, http);
    if (!call.ok()) return respond(ErrorResponse(call.status()));
    call->request->stream ? Stream(*std::move(call), std::move(respond), std::move(streamer))
                          : Whole(*std::move(call), std::move(respond), http.on_client_gone);
  }

  // Runs `done` once the future completes, then lets the future go.
  void OnDone(uint64_t future, const std::string& tenant, std::function<void(const FutureResult&)> done) {
    FutureStore* store = state_.futures;
    absl::Status s = store->OnComplete(future, tenant, [store, future, done](const FutureResult& result) {
      store->Release(future);
      done(result);
    });
    if (!s.ok()) done(s);
  }

  absl::StatusOr<const tenancy::Tenant*> Admit(const HttpRequest& request) const {
    if (state_.draining.load()) return absl::UnavailableError("server is shutting down");
    return state_.authenticator->AuthenticateHttp(request.headers);
  }

 private:
  // A generation request, checked and charged, ready to submit.
  struct Call {
    const tenancy::Tenant* tenant = nullptr;
    std::shared_ptr<Request> request;
    std::vector<std::vector<int64_t>> prompts;
    std::string session;
    ModelStack* stack = nullptr;         // the base model that samples
    const OpenAiOptions* text = nullptr;  // its tokenizer and chat renderer
    sampling::SamplingParams params;
    int64_t tokens = 0;  // charged to the tenant's token rate
    std::string id;
    int64_t created = 0;
  };

  // Authenticates, decodes, tokenizes, resolves the model and charges the rate limiter.
  absl::StatusOr<Call> Prepare(Endpoint endpoint, const HttpRequest& http) {
    Call call;
    absl::StatusOr<const tenancy::Tenant*> tenant = Admit(http);
    if (!tenant.ok()) return tenant.status();
    call.tenant = *tenant;
    absl::StatusOr<Json> body = tinker::ParseJsonBody(http.body);
    if (!body.ok()) return absl::InvalidArgumentError(absl::StrCat("invalid JSON body: ", body.status().message()));
    absl::StatusOr<Request> request = ParseRequest(*body, endpoint, models_.front().limits);
    if (!request.ok()) return request.status();
    call.request = std::make_shared<Request>(*std::move(request));
    // The model first: its tokenizer encodes the prompts.
    if (absl::Status s = Resolve(*call.tenant, call.request->model, call); !s.ok()) return s;
    absl::StatusOr<std::vector<std::vector<int64_t>>> prompts = PromptIds(*call.request, *call.text);
    if (!prompts.ok()) return prompts.status();
    call.prompts = *std::move(prompts);
    call.params = ParamsOf(*call.request);
    // Charged to the tenant's token rate exactly as Tinker's asample (429 with Retry-After).
    call.tokens = call.stack->sampler().TokensOf(call.prompts, call.params);
    if (state_.rate_limiter != nullptr) {
      if (absl::Status s = state_.rate_limiter->Acquire(*call.tenant, call.tokens); !s.ok()) return s;
    }
    call.id = RandomId(endpoint == Endpoint::kChat ? "chatcmpl-" : "cmpl-");
    call.created = absl::ToUnixSeconds(absl::Now());
    return call;
  }

  // The one submission path (SamplerCoordinator::SubmitSample); a refusal gives the tokens back.
  absl::StatusOr<uint64_t> Submit(const Call& call, std::shared_ptr<sampling::SampleStream> stream) {
    absl::StatusOr<uint64_t> future = call.stack->sampler().SubmitSample(
        tinker::ContextOf(*call.tenant), call.session, call.prompts, call.params, {}, std::move(stream));
    if (!future.ok() && state_.rate_limiter != nullptr) state_.rate_limiter->Refund(*call.tenant, call.tokens);
    return future;
  }

  static TextCodec CodecOf(const Call& call) {
    return TextCodec{call.text->tokenizer.get(), call.request->skip_special_tokens};
  }

  // stream: false: one JSON answer when the request completes. A client that closes its
  // connection before then cancels it, as a streaming one does (a SampleStream with no
  // consumer is the cancellation handle).
  void Whole(Call call, HttpResponder respond, const std::function<void(std::function<void()>)>& on_client_gone) {
    auto cancel = std::make_shared<sampling::SampleStream>();
    absl::StatusOr<uint64_t> future = Submit(call, cancel);
    if (!future.ok()) return respond(ErrorResponse(future.status()));
    if (on_client_gone) {
      on_client_gone([sampler = &call.stack->sampler(), weak = std::weak_ptr<sampling::SampleStream>(cancel)] {
        if (std::shared_ptr<sampling::SampleStream> s = weak.lock()) sampler->CancelStream(*s);
      });
    }
    OnDone(*future, call.tenant->id, [call, codec = CodecOf(call), respond](const FutureResult& result) {
      if (!result.ok()) return respond(ErrorResponse(result.status()));
      const auto* out = std::get_if<sampling::SampleOutput>(&*result);
      if (out == nullptr) return respond(ErrorResponse(absl::InternalError("the sampler returned no result")));
      const Request& request = *call.request;
      Result r{call.id, call.created, request.model, call.prompts, out};
      respond({200, "application/json", Dump(CompletionResponse(request, r, codec, request.stop_token_ids))});
    });
  }

  // stream: true: server-sent events as the decode steps come, then usage and [DONE].
  void Stream(Call call, HttpResponder respond, HttpStreamer streamer) {
    auto events = std::make_shared<StreamCall>();
    events->request = *call.request;
    events->id = call.id;
    events->model = call.request->model;
    events->created = call.created;
    events->codec = CodecOf(call);
    if (call.request->echo) {
      for (const std::vector<int64_t>& p : call.prompts) events->echoed.push_back(events->codec.Text(p));
      if (call.request->logprobs) events->prompts = call.prompts;
    }
    auto stream = std::make_shared<sampling::SampleStream>(
        [events](const sampling::StreamDelta& d) { events->OnDelta(d); });
    absl::StatusOr<uint64_t> future = Submit(call, stream);
    if (!future.ok()) return respond(ErrorResponse(future.status()));
    std::shared_ptr<HttpStream> http_stream = streamer({200, "text/event-stream", ""});
    // A client that leaves cancels its rows (capacity goes back at the next decode step).
    http_stream->OnClientGone([sampler = &call.stack->sampler(), weak = std::weak_ptr<sampling::SampleStream>(stream)] {
      if (std::shared_ptr<sampling::SampleStream> s = weak.lock()) sampler->CancelStream(*s);
    });
    events->sink.Attach(http_stream);
    int64_t prompt_tokens = 0;
    for (const std::vector<int64_t>& p : call.prompts) prompt_tokens += static_cast<int64_t>(p.size());
    OnDone(*future, call.tenant->id, [events, prompt_tokens](const FutureResult& result) {
      if (!result.ok()) {
        if (result.status().code() != absl::StatusCode::kCancelled) {
          events->sink.Send(Event(ErrorBody(result.status(), ToHttpStatus(result.status()))));
        }
        return events->sink.End();
      }
      if (events->request.include_usage) {
        int64_t completion = 0;
        if (const auto* out = std::get_if<sampling::SampleOutput>(&*result)) {
          for (const sampling::PromptOutput& p : out->prompts) {
            for (const sampling::SampledSequence& s : p.sequences) completion += static_cast<int64_t>(s.tokens.size());
          }
        }
        events->sink.Send(
            Event(UsageChunk(events->request, events->id, events->created, events->model, prompt_tokens, completion)));
      }
      events->sink.Send("data: [DONE]\n\n");
      events->sink.End();
    });
  }

  // The model and sampling session of a model name: a base model's id, a sampler checkpoint
  // path (tinker://… or twinkle://…, sampled on the base model its run was trained on), or
  // "<base>;<path>". Another tenant's path is unknown; so is a base model not served, and the
  // error lists the served ones.
  absl::Status Resolve(const tenancy::Tenant& tenant, const std::string& model, Call& call) {
    auto unknown = [&model, this] {
      return ParamError("model",
                        absl::StrCat("The model '", model.substr(0, 200), "' does not exist (base models served: ",
                                     state_.models->NamesText(), ")"),
                        absl::StatusCode::kNotFound, "model_not_found");
    };
    ModelStack* stack = state_.models->Find(model);
    std::string path;
    if (stack == nullptr) {
      path = model;
      if (const size_t semi = model.find(';'); semi != std::string::npos) {
        stack = state_.models->Find(model.substr(0, semi));
        if (stack == nullptr) return unknown();
        path = model.substr(semi + 1);
      }
      if (!absl::StartsWith(path, "tinker://") && !absl::StartsWith(path, "twinkle://")) return unknown();
      if (stack == nullptr) stack = &state_.models->ForCheckpoint(tenant.id, tinker::InternalPath(path));
    }
    const std::vector<ModelStack*>& stacks = state_.models->stacks();
    const size_t index = std::find(stacks.begin(), stacks.end(), stack) - stacks.begin();
    if (index >= models_.size()) return absl::InternalError("no OpenAI options for the model");
    absl::StatusOr<std::string> id =
        stack->sampler().ImplicitSession(tinker::ContextOf(tenant), tinker::InternalPath(path));
    if (id.status().code() == absl::StatusCode::kNotFound) return unknown();
    if (!id.ok()) return id.status();
    call.stack = stack;
    call.text = &models_[index];
    call.session = *std::move(id);
    return absl::OkStatus();
  }

  static absl::StatusOr<std::vector<std::vector<int64_t>>> PromptIds(const Request& request,
                                                                     const OpenAiOptions& model) {
    const tokenizer::Tokenizer* tok = model.tokenizer.get();
    auto encode = [tok, &model](const std::string& text, const char* param) -> absl::StatusOr<std::vector<int64_t>> {
      if (tok == nullptr) {
        return ParamError(param, absl::StrCat(param, ": text needs the model's tokenizer, which this server could not "
                                               "load (", model.tokenizer_error, "); send token ids"),
                          absl::StatusCode::kUnimplemented);
      }
      absl::StatusOr<std::vector<int32_t>> ids = tok->Encode(text);
      if (!ids.ok()) return ParamError(param, absl::StrCat(param, ": ", ids.status().message()));
      return std::vector<int64_t>(ids->begin(), ids->end());
    };
    std::vector<std::vector<int64_t>> out;
    if (request.endpoint == Endpoint::kChat) {
      if (model.renderer == nullptr) {
        return ParamError("messages", absl::StrCat("messages: this server has no chat renderer for its model (",
                                                   model.renderer_error, ")"),
                          absl::StatusCode::kUnimplemented);
      }
      absl::StatusOr<std::string> text = model.renderer->Render(request.messages, request.render);
      if (!text.ok()) return ParamError("messages", std::string(text.status().message()));
      absl::StatusOr<std::vector<int64_t>> ids = encode(*text, "messages");
      if (!ids.ok()) return ids.status();
      out.push_back(*std::move(ids));
      return out;
    }
    for (const Prompt& p : request.prompts) {
      if (!p.is_text) {
        out.push_back(p.ids);
        continue;
      }
      absl::StatusOr<std::vector<int64_t>> ids = encode(p.text, "prompt");
      if (!ids.ok()) return ids.status();
      if (ids->empty()) return ParamError("prompt", "prompt: encodes to no tokens");
      out.push_back(*std::move(ids));
    }
    return out;
  }

  static sampling::SamplingParams ParamsOf(const Request& r) {
    sampling::SamplingParams p;
    p.max_tokens = r.max_tokens;  // 0 = the sampler's default
    p.temperature = r.temperature;
    p.top_p = r.top_p;
    p.top_k = r.top_k;
    p.min_p = r.min_p;
    p.presence_penalty = r.presence_penalty;
    p.frequency_penalty = r.frequency_penalty;
    p.repetition_penalty = r.repetition_penalty;
    p.seed = r.seed;
    p.stop_strings = r.stop;
    p.stop_token_ids = r.stop_token_ids;
    p.ignore_eos = r.ignore_eos;
    p.num_samples = r.n;
    p.top_logprobs = r.logprobs ? r.top_logprobs : 0;
    if (r.echo && r.logprobs) {  // the prompt's log-probs too (what evaluation harnesses score)
      p.prompt_logprobs = true;
      p.prompt_top_logprobs = r.top_logprobs;
    }
    return p;
  }

  ServingState& state_;
  tinker::TinkerApi& tinker_;
  const std::vector<OpenAiOptions> models_;  // in the order of state_.models->stacks()
};

}  // namespace

OpenAiOptions OptionsFromConfig(const Config& config, const std::string& model_dir) {
  OpenAiOptions options;
  options.base_model = config.model.name;
  options.model_dir = model_dir;
  options.limits.max_n = config.sampler.max_num_samples;
  // Text in and out: the model's tokenizer.json and chat renderer. Without them the routes
  // still serve token ids (text prompts and chat answer 501 naming what is missing).
  absl::StatusOr<std::unique_ptr<tokenizer::Tokenizer>> tok = tokenizer::Tokenizer::FromModelDir(model_dir);
  if (tok.ok()) {
    options.tokenizer = *std::move(tok);
  } else {
    // Clients are told what is missing, not where the server keeps its files.
    options.tokenizer_error = absl::StrReplaceAll(tok.status().message(), {{model_dir, options.base_model}});
    LogWarning("openai", absl::StrCat("no tokenizer for the OpenAI routes (token ids only): ", tok.status().message()));
  }
  absl::StatusOr<std::unique_ptr<tokenizer::ChatRenderer>> renderer = tokenizer::ChatRendererForModel(model_dir, config.model.chat_renderer_fallback);
  if (renderer.ok()) {
    options.renderer = *std::move(renderer);
  } else {
    options.renderer_error = absl::StrReplaceAll(renderer.status().message(), {{model_dir, options.base_model}});
    LogWarning("openai", absl::StrCat("no chat renderer for /v1/chat/completions: ", renderer.status().message()));
  }
  return options;
}

void AddOpenAiRoutes(HttpServer& http, ServingState& state, tinker::TinkerApi& tinker,
                     std::vector<OpenAiOptions> models) {
  auto handlers = std::make_shared<Handlers>(state, tinker, std::move(models));
  // Under /v1 (the OpenAI SDK's base_url http://host:port/v1) and under the Tinker API's
  // /api/v1, where Twinkle's gateway serves them.
  for (const char* prefix : {"/v1", "/api/v1"}) {
    http.Route("GET", absl::StrCat(prefix, "/models"), [handlers](const HttpRequest& r) { return handlers->Models(r); });
    for (auto [path, endpoint] : {std::pair{"/completions", Endpoint::kCompletions},
                                  std::pair{"/chat/completions", Endpoint::kChat}}) {
      http.RouteStreaming("POST", absl::StrCat(prefix, path),
                          [handlers, endpoint](const HttpRequest& r, HttpResponder respond, HttpStreamer streamer) {
                            handlers->Generate(endpoint, r, std::move(respond), std::move(streamer));
                          });
    }
  }
  // Before the body is read: a caller without a valid key, or with a body over the limit, is
  // answered at once (and the body never read). (Under /api/v1 the Tinker routes' own key
  // check, added before this one, answers first.)
  http.AddHeaderCheck([handlers](const HttpRequest& head) -> std::optional<HttpResponse> {
    static const std::set<std::string> kAliases = {"/api/v1/models", "/api/v1/completions", "/api/v1/chat/completions"};
    if (!absl::StartsWith(head.path, "/v1/") && !kAliases.contains(head.path)) return std::nullopt;
    absl::StatusOr<const tenancy::Tenant*> tenant = handlers->Admit(head);
    if (!tenant.ok()) return ErrorResponse(tenant.status());
    size_t length = 0;
    if (const std::string* cl = head.Header("content-length");
        cl != nullptr && absl::SimpleAtoi(*cl, &length) && length > kMaxBodyBytes) {
      return TooLarge(length);
    }
    return std::nullopt;
  });
}

}  // namespace twinkle::openai
