#include "server/openai/openai_codec.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "core/tokenizer/tokenizer.h"

namespace twinkle::openai {
namespace {

constexpr char kParamPayload[] = "twinkle.openai/param";
constexpr char kCodePayload[] = "twinkle.openai/code";

// A parameter that is present and not null.
const Json* Find(const Json& body, const char* key) {
  auto it = body.find(key);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

absl::Status WrongType(const char* key, const char* expected) {
  return ParamError(key, absl::StrCat(key, ": expected ", expected));
}

absl::Status Int(const Json& body, const char* key, int64_t* out) {
  const Json* v = Find(body, key);
  if (v == nullptr) return absl::OkStatus();
  if (v->is_number_integer()) {
    *out = v->get<int64_t>();
    return absl::OkStatus();
  }
  if (v->is_number_float() && std::floor(v->get<double>()) == v->get<double>() && std::fabs(v->get<double>()) < 9e18) {
    *out = static_cast<int64_t>(v->get<double>());
    return absl::OkStatus();
  }
  return WrongType(key, "an integer");
}

absl::Status Number(const Json& body, const char* key, double* out) {
  const Json* v = Find(body, key);
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_number()) return WrongType(key, "a number");
  *out = v->get<double>();
  return absl::OkStatus();
}

absl::Status Bool(const Json& body, const char* key, bool* out) {
  const Json* v = Find(body, key);
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_boolean()) return WrongType(key, "a boolean");
  *out = v->get<bool>();
  return absl::OkStatus();
}

absl::Status Range(const char* key, double value, double lo, double hi) {
  if (value < lo || value > hi) {
    return ParamError(key, absl::StrCat(key, ": ", value, " must be in [", lo, ", ", hi, "]"));
  }
  return absl::OkStatus();
}

// OpenAI parameters this server does not implement: refused unless left at their no-op value.
absl::Status RefuseUnsupported(const Json& body, Endpoint endpoint) {
  auto refuse = [](const char* key, const std::string& why) {
    return ParamError(key, absl::StrCat(key, ": not supported by this server", why.empty() ? "" : " (", why,
                                        why.empty() ? "" : ")"),
                      absl::StatusCode::kInvalidArgument, "unsupported_parameter");
  };
  if (const Json* v = Find(body, "logit_bias"); v != nullptr && !(v->is_object() && v->empty())) {
    return refuse("logit_bias", "");
  }
  if (const Json* v = Find(body, "best_of"); v != nullptr) {
    const Json* n = Find(body, "n");
    const int64_t want = n != nullptr && n->is_number_integer() ? n->get<int64_t>() : 1;
    if (!(v->is_number_integer() && v->get<int64_t>() == want)) return refuse("best_of", "only equal to n");
  }
  if (const Json* v = Find(body, "suffix"); v != nullptr && !(v->is_string() && v->get<std::string>().empty())) {
    return refuse("suffix", "");
  }
  if (const Json* v = Find(body, "response_format");
      v != nullptr && !(v->is_object() && v->value("type", "") == "text")) {
    return refuse("response_format", "only {\"type\": \"text\"}");
  }
  for (const char* key : {"tools", "functions"}) {
    if (const Json* v = Find(body, key); v != nullptr && !(v->is_array() && v->empty())) return refuse(key, "");
  }
  for (const char* key : {"tool_choice", "function_call"}) {
    if (const Json* v = Find(body, key); v != nullptr && !(v->is_string() && v->get<std::string>() == "none")) {
      return refuse(key, "only \"none\"");
    }
  }
  for (const char* key : {"audio", "prediction", "web_search_options"}) {
    if (Find(body, key) != nullptr) return refuse(key, "");
  }
  if (const Json* v = Find(body, "modalities"); v != nullptr && !(v->is_array() && v->size() == 1 && (*v)[0] == "text")) {
    return refuse("modalities", "only [\"text\"]");
  }
  if (endpoint == Endpoint::kChat) {
    if (const Json* v = Find(body, "echo"); v != nullptr && !(v->is_boolean() && !v->get<bool>())) {
      return refuse("echo", "on /v1/completions only");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int64_t>> Ids(const Json& list, const std::string& param) {
  std::vector<int64_t> ids;
  ids.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    if (!list[i].is_number_integer()) {
      return ParamError(param, absl::StrCat(param, "[", i, "]: expected a token id (an integer)"));
    }
    ids.push_back(list[i].get<int64_t>());
  }
  return ids;
}

absl::Status ParsePrompts(const Json& body, const Limits& limits, std::vector<Prompt>* out) {
  const Json* p = Find(body, "prompt");
  if (p == nullptr) return ParamError("prompt", "prompt: missing");
  auto text = [](const std::string& s) { return Prompt{true, s, {}}; };
  if (p->is_string()) {
    out->push_back(text(p->get<std::string>()));
  } else if (p->is_array() && !p->empty() && (*p)[0].is_number_integer()) {
    absl::StatusOr<std::vector<int64_t>> ids = Ids(*p, "prompt");
    if (!ids.ok()) return ids.status();
    out->push_back(Prompt{false, "", *std::move(ids)});
  } else if (p->is_array()) {
    if (p->size() > limits.max_prompts) {
      return ParamError("prompt", absl::StrCat("prompt: ", p->size(), " prompts; the limit is ", limits.max_prompts));
    }
    for (size_t i = 0; i < p->size(); ++i) {
      const Json& item = (*p)[i];
      if (item.is_string()) {
        out->push_back(text(item.get<std::string>()));
      } else if (item.is_array()) {
        absl::StatusOr<std::vector<int64_t>> ids = Ids(item, absl::StrCat("prompt[", i, "]"));
        if (!ids.ok()) return ids.status();
        out->push_back(Prompt{false, "", *std::move(ids)});
      } else {
        return ParamError("prompt", absl::StrCat("prompt[", i, "]: expected a string or a list of token ids"));
      }
    }
  } else {
    return WrongType("prompt", "a string, a list of token ids, or a list of either");
  }
  if (out->empty()) return ParamError("prompt", "prompt: empty list");
  for (size_t i = 0; i < out->size(); ++i) {
    const Prompt& prompt = (*out)[i];
    if (prompt.is_text ? prompt.text.empty() : prompt.ids.empty()) {
      return ParamError("prompt", absl::StrCat("prompt", out->size() > 1 ? absl::StrCat("[", i, "]") : "", ": empty"));
    }
  }
  return absl::OkStatus();
}

absl::Status ParseMessages(const Json& body, const Limits& limits, std::vector<tokenizer::ChatMessage>* out) {
  const Json* m = Find(body, "messages");
  if (m == nullptr) return ParamError("messages", "messages: missing");
  if (!m->is_array()) return WrongType("messages", "a list of messages");
  if (m->empty()) return ParamError("messages", "messages: empty list");
  if (m->size() > limits.max_messages) {
    return ParamError("messages", absl::StrCat("messages: ", m->size(), " messages; the limit is ", limits.max_messages));
  }
  for (size_t i = 0; i < m->size(); ++i) {
    const Json& msg = (*m)[i];
    const std::string at = absl::StrCat("messages[", i, "]");
    if (!msg.is_object()) return ParamError("messages", absl::StrCat(at, ": expected an object"));
    tokenizer::ChatMessage message;
    const Json* role = Find(msg, "role");
    if (role == nullptr || !role->is_string()) return ParamError("messages", absl::StrCat(at, ".role: missing"));
    message.role = role->get<std::string>();
    if (message.role == "developer") message.role = "system";
    if (message.role != "system" && message.role != "user" && message.role != "assistant" && message.role != "tool") {
      return ParamError("messages", absl::StrCat(at, ".role: '", message.role.substr(0, 40),
                                                 "' is not one of system, developer, user, assistant, tool"));
    }
    if (const Json* content = Find(msg, "content"); content != nullptr) {
      if (content->is_string()) {
        message.content = content->get<std::string>();
      } else if (content->is_array()) {
        for (size_t j = 0; j < content->size(); ++j) {
          const Json& part = (*content)[j];
          if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
              !part["text"].is_string()) {
            return ParamError("messages", absl::StrCat(at, ".content[", j, "]: only text parts are supported"),
                              absl::StatusCode::kInvalidArgument, "unsupported_parameter");
          }
          message.content += part["text"].get<std::string>();
        }
      } else {
        return ParamError("messages", absl::StrCat(at, ".content: expected a string or a list of text parts"));
      }
    }
    if (const Json* r = Find(msg, "reasoning_content"); r != nullptr && r->is_string()) {
      message.reasoning_content = r->get<std::string>();
    }
    if (const Json* calls = Find(msg, "tool_calls"); calls != nullptr) {
      if (!calls->is_array()) return ParamError("messages", absl::StrCat(at, ".tool_calls: expected a list"));
      for (size_t j = 0; j < calls->size(); ++j) {
        const Json& call = (*calls)[j];
        const Json* fn = call.is_object() ? Find(call, "function") : nullptr;
        if (fn == nullptr || !fn->is_object() || !fn->contains("name") || !(*fn)["name"].is_string()) {
          return ParamError("messages", absl::StrCat(at, ".tool_calls[", j, "]: expected {id, function: {name, arguments}}"));
        }
        tokenizer::ToolCall tc;
        tc.id = call.value("id", "");
        tc.name = (*fn)["name"].get<std::string>();
        const Json* args = Find(*fn, "arguments");
        tc.arguments_json = args == nullptr ? "{}" : args->is_string() ? args->get<std::string>() : args->dump();
        message.tool_calls.push_back(std::move(tc));
      }
    }
    if (const Json* id = Find(msg, "tool_call_id"); id != nullptr && id->is_string()) message.tool_call_id = id->get<std::string>();
    out->push_back(std::move(message));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ParamError(const std::string& param, const std::string& message, absl::StatusCode code,
                        const std::string& openai_code) {
  absl::Status s(code, message);
  s.SetPayload(kParamPayload, absl::Cord(param));
  if (!openai_code.empty()) s.SetPayload(kCodePayload, absl::Cord(openai_code));
  return s;
}

std::string ParamOf(const absl::Status& status) {
  auto p = status.GetPayload(kParamPayload);
  return p ? std::string(*p) : "";
}

Json ErrorBody(const absl::Status& status, int http_status) {
  std::string type = "invalid_request_error";
  if (http_status == 401) type = "authentication_error";
  if (http_status == 403) type = "permission_error";
  if (http_status == 404) type = "not_found_error";
  if (http_status == 429) type = "rate_limit_error";
  if (http_status >= 500) type = "server_error";
  std::string code;
  if (auto c = status.GetPayload(kCodePayload)) code = std::string(*c);
  if (code.empty() && http_status == 401) code = "invalid_api_key";
  if (code.empty() && http_status == 429) code = "rate_limit_exceeded";
  const std::string param = ParamOf(status);
  return {{"error",
           {{"message", std::string(status.message())},
            {"type", type},
            {"param", param.empty() ? Json(nullptr) : Json(param)},
            {"code", code.empty() ? Json(nullptr) : Json(code)}}}};
}

absl::StatusOr<Request> ParseRequest(const Json& body, Endpoint endpoint, const Limits& limits) {
  Request r;
  r.endpoint = endpoint;
  const Json* model = Find(body, "model");
  if (model == nullptr) return ParamError("model", "model: missing");
  if (!model->is_string() || model->get<std::string>().empty()) return WrongType("model", "a model name");
  r.model = model->get<std::string>();
  if (absl::Status s = RefuseUnsupported(body, endpoint); !s.ok()) return s;
  if (endpoint == Endpoint::kCompletions) {
    if (absl::Status s = ParsePrompts(body, limits, &r.prompts); !s.ok()) return s;
  } else {
    if (absl::Status s = ParseMessages(body, limits, &r.messages); !s.ok()) return s;
  }
  double temperature = 1.0, top_p = 1.0;
  int64_t top_k = -1, seed = 0;
  const bool has_seed = Find(body, "seed") != nullptr;
  for (absl::Status s : {Int(body, "n", &r.n), Int(body, "max_tokens", &r.max_tokens),
                         Int(body, "max_completion_tokens", &r.max_tokens), Number(body, "temperature", &temperature),
                         Number(body, "top_p", &top_p), Int(body, "top_k", &top_k), Int(body, "seed", &seed),
                         Number(body, "min_p", &r.min_p), Number(body, "presence_penalty", &r.presence_penalty),
                         Number(body, "frequency_penalty", &r.frequency_penalty),
                         Number(body, "repetition_penalty", &r.repetition_penalty),
                         Bool(body, "stream", &r.stream), Bool(body, "echo", &r.echo),
                         Bool(body, "ignore_eos", &r.ignore_eos),
                         Bool(body, "skip_special_tokens", &r.skip_special_tokens)}) {
    if (!s.ok()) return s;
  }
  if (r.n < 1 || r.n > limits.max_n) {
    return ParamError("n", absl::StrCat("n: ", r.n, " must be in [1, ", limits.max_n, "]"));
  }
  if (Find(body, "max_tokens") != nullptr || Find(body, "max_completion_tokens") != nullptr) {
    const char* key = Find(body, "max_completion_tokens") != nullptr ? "max_completion_tokens" : "max_tokens";
    if (r.max_tokens < 1) return ParamError(key, absl::StrCat(key, ": ", r.max_tokens, " must be at least 1"));
  }
  if (absl::Status s = Range("temperature", temperature, 0, 2); !s.ok()) return s;
  if (!(top_p > 0 && top_p <= 1)) return ParamError("top_p", absl::StrCat("top_p: ", top_p, " must be in (0, 1]"));
  if (top_k < -1) return ParamError("top_k", absl::StrCat("top_k: ", top_k, " must be -1 (off) or >= 0"));
  // OpenAI's ranges for presence / frequency, transformers' (and vLLM's) for the others.
  for (absl::Status s : {Range("presence_penalty", r.presence_penalty, -2, 2),
                         Range("frequency_penalty", r.frequency_penalty, -2, 2), Range("min_p", r.min_p, 0, 1)}) {
    if (!s.ok()) return s;
  }
  if (!(r.repetition_penalty > 0) || std::isinf(r.repetition_penalty)) {
    return ParamError("repetition_penalty",
                      absl::StrCat("repetition_penalty: ", r.repetition_penalty, " must be finite and > 0 (1 = off)"));
  }
  r.temperature = temperature;
  r.top_p = top_p;
  r.top_k = std::max<int64_t>(top_k, 0);
  if (has_seed) r.seed = static_cast<uint64_t>(seed);
  if (const Json* stop = Find(body, "stop"); stop != nullptr) {
    if (stop->is_string()) {
      r.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (const Json& s : *stop) {
        if (!s.is_string()) return WrongType("stop", "a string or a list of strings");
        r.stop.push_back(s.get<std::string>());
      }
    } else {
      return WrongType("stop", "a string or a list of strings");
    }
    if (r.stop.size() > limits.max_stop) {
      return ParamError("stop", absl::StrCat("stop: ", r.stop.size(), " strings; the limit is ", limits.max_stop));
    }
    for (const std::string& s : r.stop) {
      if (s.empty()) return ParamError("stop", "stop: empty string");
    }
  }
  if (const Json* ids = Find(body, "stop_token_ids"); ids != nullptr) {
    if (!ids->is_array()) return WrongType("stop_token_ids", "a list of token ids");
    absl::StatusOr<std::vector<int64_t>> parsed = Ids(*ids, "stop_token_ids");
    if (!parsed.ok()) return parsed.status();
    r.stop_token_ids = *std::move(parsed);
  }
  if (endpoint == Endpoint::kCompletions) {
    if (const Json* lp = Find(body, "logprobs"); lp != nullptr) {
      if (!lp->is_number_integer()) return WrongType("logprobs", "an integer");
      r.logprobs = true;
      r.top_logprobs = lp->get<int64_t>();
      if (r.top_logprobs < 0 || r.top_logprobs > limits.max_top_logprobs) {
        return ParamError("logprobs", absl::StrCat("logprobs: ", r.top_logprobs, " must be in [0, ",
                                                   limits.max_top_logprobs, "]"));
      }
    }
  } else {
    if (absl::Status s = Bool(body, "logprobs", &r.logprobs); !s.ok()) return s;
    int64_t top = 0;
    if (absl::Status s = Int(body, "top_logprobs", &top); !s.ok()) return s;
    if (Find(body, "top_logprobs") != nullptr) {
      if (!r.logprobs) return ParamError("top_logprobs", "top_logprobs: needs logprobs: true");
      if (top < 0 || top > limits.max_top_logprobs) {
        return ParamError("top_logprobs",
                          absl::StrCat("top_logprobs: ", top, " must be in [0, ", limits.max_top_logprobs, "]"));
      }
    }
    r.top_logprobs = top;
    // Rendering switches: chat_template_kwargs (vLLM) and the add_generation_prompt flag.
    if (absl::Status s = Bool(body, "add_generation_prompt", &r.render.add_generation_prompt); !s.ok()) return s;
    if (const Json* kwargs = Find(body, "chat_template_kwargs"); kwargs != nullptr) {
      if (!kwargs->is_object()) return WrongType("chat_template_kwargs", "an object");
      if (absl::Status s = Bool(*kwargs, "enable_thinking", &r.render.enable_thinking); !s.ok()) return s;
    }
  }
  if (const Json* opts = Find(body, "stream_options"); opts != nullptr) {
    if (!opts->is_object()) return WrongType("stream_options", "an object");
    if (!r.stream) return ParamError("stream_options", "stream_options: only allowed with stream: true");
    if (absl::Status s = Bool(*opts, "include_usage", &r.include_usage); !s.ok()) return s;
  }
  return r;
}

// ---- responses ----------------------------------------------------------------------------

std::string TextCodec::Text(const std::vector<int64_t>& ids) const {
  if (tokenizer == nullptr || ids.empty()) return "";
  std::vector<int32_t> narrow(ids.begin(), ids.end());
  absl::StatusOr<std::string> text = tokenizer->Decode(narrow, skip_special_tokens);
  return text.ok() ? *std::move(text) : std::string();
}

std::string TextCodec::TokenName(int64_t id) const {
  if (tokenizer == nullptr) return absl::StrCat("token_id:", id);
  return tokenizer->TokenBytes(static_cast<int32_t>(id));
}

Choice MakeChoice(const sampling::SampledSequence& seq, const Request& request, const TextCodec& codec,
                  const std::vector<int64_t>& stop_ids) {
  Choice c;
  c.token_ids = seq.tokens;
  c.finish_reason = seq.stop_reason == "stop" ? "stop" : "length";
  std::vector<int64_t> visible = seq.tokens;
  if (c.finish_reason == "stop" && !visible.empty() &&
      std::find(stop_ids.begin(), stop_ids.end(), visible.back()) != stop_ids.end()) {
    visible.pop_back();  // the stop token that ended it is not part of the text
  }
  c.text = codec.Text(visible);
  size_t cut = std::string::npos;
  for (const std::string& s : request.stop) cut = std::min(cut, c.text.find(s));
  if (cut != std::string::npos) c.text.resize(cut);
  return c;
}

Json Usage(const Result& result) {
  int64_t prompt = 0, completion = 0;
  for (const std::vector<int64_t>& p : result.prompt_ids) prompt += static_cast<int64_t>(p.size());
  for (const sampling::PromptOutput& p : result.output->prompts) {
    for (const sampling::SampledSequence& s : p.sequences) completion += static_cast<int64_t>(s.tokens.size());
  }
  return {{"prompt_tokens", prompt}, {"completion_tokens", completion}, {"total_tokens", prompt + completion}};
}

namespace {

Json Logprob(float lp) { return std::isfinite(lp) ? Json(lp) : Json(-9999.0); }

Json Bytes(const std::string& s) {
  Json b = Json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}

// Completions: {tokens, token_logprobs, top_logprobs, text_offset}.
Json CompletionLogprobs(const sampling::SampledSequence& seq, const TextCodec& codec, int64_t k, size_t offset) {
  Json tokens = Json::array(), lps = Json::array(), tops = Json::array(), offsets = Json::array();
  for (size_t i = 0; i < seq.tokens.size(); ++i) {
    const std::string name = codec.TokenName(seq.tokens[i]);
    tokens.push_back(name);
    lps.push_back(Logprob(i < seq.logprobs.size() ? seq.logprobs[i] : NAN));
    offsets.push_back(offset);
    offset += name.size();
    Json top = Json::object();
    for (int64_t j = 0; j < k && (i * k + j) < seq.top_logprobs.token_ids.size(); ++j) {
      top[codec.TokenName(seq.top_logprobs.token_ids[i * k + j])] = Logprob(seq.top_logprobs.logprobs[i * k + j]);
    }
    tops.push_back(std::move(top));
  }
  return {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

// Chat: {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}.
Json ChatLogprobs(const sampling::SampledSequence& seq, const TextCodec& codec, int64_t k) {
  Json content = Json::array();
  for (size_t i = 0; i < seq.tokens.size(); ++i) {
    const std::string name = codec.TokenName(seq.tokens[i]);
    Json top = Json::array();
    for (int64_t j = 0; j < k && (i * k + j) < seq.top_logprobs.token_ids.size(); ++j) {
      const std::string alt = codec.TokenName(seq.top_logprobs.token_ids[i * k + j]);
      top.push_back({{"token", alt}, {"logprob", Logprob(seq.top_logprobs.logprobs[i * k + j])}, {"bytes", Bytes(alt)}});
    }
    content.push_back({{"token", name},
                       {"logprob", Logprob(i < seq.logprobs.size() ? seq.logprobs[i] : NAN)},
                       {"bytes", Bytes(name)},
                       {"top_logprobs", std::move(top)}});
  }
  return {{"content", std::move(content)}};
}

// echo with logprobs: the prompt's tokens first (the first has no log-prob: null), then the
// generated ones, as one list; offsets run on over both.
Json EchoedLogprobs(const std::vector<int64_t>& prompt, const sampling::PromptOutput& out,
                    const sampling::SampledSequence& seq, const TextCodec& codec, int64_t k) {
  Json tokens = Json::array(), lps = Json::array(), tops = Json::array(), offsets = Json::array();
  size_t offset = 0;
  const sampling::TopLogprobs& top = out.prompt_top_logprobs;
  for (size_t i = 0; i < prompt.size(); ++i) {
    const std::string name = codec.TokenName(prompt[i]);
    tokens.push_back(name);
    offsets.push_back(offset);
    offset += name.size();
    if (i == 0 || i >= out.prompt_logprobs.size()) {
      lps.push_back(nullptr);
      tops.push_back(nullptr);
      continue;
    }
    lps.push_back(Logprob(out.prompt_logprobs[i]));
    Json row = Json::object();
    for (int64_t j = 0; j < k && i * k + j < top.token_ids.size(); ++j) {
      row[codec.TokenName(top.token_ids[i * k + j])] = Logprob(top.logprobs[i * k + j]);
    }
    tops.push_back(std::move(row));
  }
  Json generated = CompletionLogprobs(seq, codec, k, offset);
  auto append = [](Json& to, Json& from) {
    for (Json& v : from) to.push_back(std::move(v));
  };
  append(tokens, generated["tokens"]);
  append(lps, generated["token_logprobs"]);
  append(tops, generated["top_logprobs"]);
  append(offsets, generated["text_offset"]);
  return {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

}  // namespace

Json EchoedLogprobsOf(const Request& request, const std::vector<int64_t>& prompt,
                      const sampling::PromptOutput& scores, const sampling::SampledSequence& seq,
                      const TextCodec& codec) {
  return EchoedLogprobs(prompt, scores, seq, codec, request.top_logprobs);
}

Json LogprobsOf(const Request& request, const sampling::SampledSequence& seq, const TextCodec& codec,
                size_t text_offset) {
  return request.endpoint == Endpoint::kChat ? ChatLogprobs(seq, codec, request.top_logprobs)
                                             : CompletionLogprobs(seq, codec, request.top_logprobs, text_offset);
}

Json CompletionResponse(const Request& request, const Result& result, const TextCodec& codec,
                        const std::vector<int64_t>& stop_ids) {
  const bool chat = request.endpoint == Endpoint::kChat;
  Json choices = Json::array();
  int64_t index = 0;
  for (size_t p = 0; p < result.output->prompts.size(); ++p) {
    for (const sampling::SampledSequence& seq : result.output->prompts[p].sequences) {
      Choice c = MakeChoice(seq, request, codec, stop_ids);
      Json choice = {{"index", index++}, {"finish_reason", c.finish_reason}, {"token_ids", c.token_ids}};
      if (chat) {
        choice["message"] = {{"role", "assistant"}, {"content", c.text}};
        choice["logprobs"] = request.logprobs ? ChatLogprobs(seq, codec, request.top_logprobs) : Json(nullptr);
      } else {
        std::string text = std::move(c.text);
        if (request.echo && p < result.prompt_ids.size()) text = codec.Text(result.prompt_ids[p]) + text;
        choice["text"] = std::move(text);
        if (!request.logprobs) {
          choice["logprobs"] = nullptr;
        } else if (!request.echo || p >= result.prompt_ids.size()) {
          choice["logprobs"] = CompletionLogprobs(seq, codec, request.top_logprobs, 0);
        } else {
          choice["logprobs"] = EchoedLogprobs(result.prompt_ids[p], result.output->prompts[p], seq, codec,
                                              request.top_logprobs);
        }
      }
      choices.push_back(std::move(choice));
    }
  }
  return {{"id", result.id},
          {"object", chat ? "chat.completion" : "text_completion"},
          {"created", result.created},
          {"model", result.model},
          {"choices", std::move(choices)},
          {"usage", Usage(result)}};
}

Json StreamChunk(const Request& request, const std::string& id, int64_t created, const std::string& model,
                 int64_t index, const std::string& text, const std::vector<int64_t>& token_ids,
                 const std::optional<std::string>& finish_reason, bool first_of_choice, Json logprobs) {
  const bool chat = request.endpoint == Endpoint::kChat;
  Json choice = {{"index", index},
                 {"logprobs", std::move(logprobs)},
                 {"finish_reason", finish_reason ? Json(*finish_reason) : Json(nullptr)},
                 {"token_ids", token_ids}};
  if (chat) {
    Json delta = Json::object();
    if (first_of_choice) delta["role"] = "assistant";
    if (!text.empty() || first_of_choice) delta["content"] = text;
    choice["delta"] = std::move(delta);
  } else {
    choice["text"] = text;
  }
  Json chunk = {{"id", id},
                {"object", chat ? "chat.completion.chunk" : "text_completion"},
                {"created", created},
                {"model", model},
                {"choices", Json::array({std::move(choice)})}};
  if (request.include_usage) chunk["usage"] = nullptr;
  return chunk;
}

Json UsageChunk(const Request& request, const std::string& id, int64_t created, const std::string& model,
                int64_t prompt_tokens, int64_t completion_tokens) {
  const bool chat = request.endpoint == Endpoint::kChat;
  return {{"id", id},
          {"object", chat ? "chat.completion.chunk" : "text_completion"},
          {"created", created},
          {"model", model},
          {"choices", Json::array()},
          {"usage",
           {{"prompt_tokens", prompt_tokens},
            {"completion_tokens", completion_tokens},
            {"total_tokens", prompt_tokens + completion_tokens}}}};
}

}  // namespace twinkle::openai
