// The OpenAI wire codec: what ParseRequest accepts and refuses (naming the parameter), and
// the error, response and chunk shapes the openai SDK reads.
#include "server/openai/openai_codec.h"

#include <string>
#include <tuple>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace twinkle::openai {
namespace {

using ::testing::HasSubstr;

Json Completion(Json extra = Json::object()) {
  Json body = {{"model", "m"}, {"prompt", {1, 2, 3}}};
  body.update(extra);
  return body;
}

absl::Status ErrorOf(const Json& body, Endpoint endpoint = Endpoint::kCompletions) {
  return ParseRequest(body, endpoint, Limits{}).status();
}

TEST(OpenAiCodec, ParsesPromptsInEveryForm) {
  absl::StatusOr<Request> ids = ParseRequest(Completion(), Endpoint::kCompletions, Limits{});
  ASSERT_TRUE(ids.ok()) << ids.status();
  ASSERT_EQ(ids->prompts.size(), 1u);
  EXPECT_FALSE(ids->prompts[0].is_text);
  EXPECT_EQ(ids->prompts[0].ids, (std::vector<int64_t>{1, 2, 3}));
  absl::StatusOr<Request> mixed =
      ParseRequest(Completion({{"prompt", Json::array({"hi", Json::array({4, 5})})}}), Endpoint::kCompletions, Limits{});
  ASSERT_TRUE(mixed.ok()) << mixed.status();
  ASSERT_EQ(mixed->prompts.size(), 2u);
  EXPECT_TRUE(mixed->prompts[0].is_text);
  EXPECT_EQ(mixed->prompts[1].ids, (std::vector<int64_t>{4, 5}));
}

TEST(OpenAiCodec, ParsesSamplingParameters) {
  absl::StatusOr<Request> r = ParseRequest(
      Completion({{"n", 3}, {"max_tokens", 7}, {"temperature", 0}, {"top_p", 0.5}, {"top_k", -1}, {"seed", 9},
                  {"stop", "x"}, {"stream", true}, {"stream_options", {{"include_usage", true}}},
                  {"logit_bias", nullptr}, {"unknown_thing", {{"a", 1}}}}),
      Endpoint::kCompletions, Limits{});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->n, 3);
  EXPECT_EQ(r->max_tokens, 7);
  EXPECT_EQ(r->temperature, 0);
  EXPECT_EQ(r->top_p, 0.5);
  EXPECT_EQ(r->top_k, 0);
  EXPECT_EQ(r->seed, 9u);
  EXPECT_EQ(r->stop, std::vector<std::string>{"x"});
  EXPECT_TRUE(r->stream && r->include_usage);
  absl::StatusOr<Request> chat = ParseRequest(
      {{"model", "m"}, {"messages", {{{"role", "developer"}, {"content", {{{"type", "text"}, {"text", "a"}}}}}}},
       {"max_completion_tokens", 4}, {"logprobs", true}, {"top_logprobs", 2}},
      Endpoint::kChat, Limits{});
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_EQ(chat->messages[0].role, "system");
  EXPECT_EQ(chat->messages[0].content, "a");
  EXPECT_EQ(chat->max_tokens, 4);
  EXPECT_TRUE(chat->logprobs);
  EXPECT_EQ(chat->top_logprobs, 2);
}

TEST(OpenAiCodec, RefusesBadInputNamingTheParameter) {
  const std::vector<std::pair<Json, std::string>> cases = {
      {Json{{"prompt", {1}}}, "model"},
      {Completion({{"prompt", Json::array()}}), "prompt"},
      {Completion({{"prompt", {1, "a"}}}), "prompt"},
      {Completion({{"prompt", 5}}), "prompt"},
      {Completion({{"n", 0}}), "n"},
      {Completion({{"n", 129}}), "n"},
      {Completion({{"n", "2"}}), "n"},
      {Completion({{"max_tokens", 0}}), "max_tokens"},
      {Completion({{"max_tokens", 1.5}}), "max_tokens"},
      {Completion({{"temperature", 2.5}}), "temperature"},
      {Completion({{"top_p", 0}}), "top_p"},
      {Completion({{"top_k", -2}}), "top_k"},
      {Completion({{"stop", {"a", ""}}}), "stop"},
      {Completion({{"stop", Json::array({"1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14",
                                          "15", "16", "17"})}}),
       "stop"},
      {Completion({{"logprobs", 21}}), "logprobs"},
      {Completion({{"stream_options", {{"include_usage", true}}}}), "stream_options"},
      {Completion({{"presence_penalty", 2.01}}), "presence_penalty"},
      {Completion({{"presence_penalty", "1"}}), "presence_penalty"},
      {Completion({{"frequency_penalty", -2.01}}), "frequency_penalty"},
      {Completion({{"repetition_penalty", 0}}), "repetition_penalty"},
      {Completion({{"repetition_penalty", -1.5}}), "repetition_penalty"},
      {Completion({{"min_p", 1.01}}), "min_p"},
      {Completion({{"min_p", -0.01}}), "min_p"},
      {Completion({{"logit_bias", {{"5", 1}}}}), "logit_bias"},
      {Completion({{"best_of", 2}}), "best_of"},
      {Completion({{"suffix", "x"}}), "suffix"},
      {Completion({{"tools", {{{"type", "function"}}}}}), "tools"},
  };
  for (const auto& [body, param] : cases) {
    absl::Status s = ErrorOf(body);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << body.dump();
    EXPECT_EQ(ParamOf(s), param) << body.dump() << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(param)) << body.dump();
  }
  EXPECT_EQ(ParamOf(ErrorOf({{"model", "m"}, {"messages", {{{"role", "wizard"}}}}}, Endpoint::kChat)), "messages");
  EXPECT_EQ(ParamOf(ErrorOf({{"model", "m"}, {"messages", {{{"role", "user"}, {"content", {{{"type", "image_url"}}}}}}}},
                            Endpoint::kChat)),
            "messages");
  EXPECT_EQ(ParamOf(ErrorOf({{"model", "m"}, {"messages", {{{"role", "user"}}}}, {"top_logprobs", 2}}, Endpoint::kChat)),
            "top_logprobs");
}

// Each documented limit: accepted at the limit, refused at limit + 1 naming the parameter.
TEST(OpenAiCodec, LimitsAtLimitAndLimitPlusOne) {
  const Limits limits;
  auto prompts = [](size_t n) { return Json{{"model", "m"}, {"prompt", Json(std::vector<Json>(n, Json({1, 2})))}}; };
  EXPECT_TRUE(ParseRequest(prompts(limits.max_prompts), Endpoint::kCompletions, limits).ok());
  EXPECT_EQ(ParamOf(ParseRequest(prompts(limits.max_prompts + 1), Endpoint::kCompletions, limits).status()), "prompt");
  auto messages = [](size_t n) {
    return Json{{"model", "m"}, {"messages", Json(std::vector<Json>(n, Json{{"role", "user"}, {"content", "x"}}))}};
  };
  EXPECT_TRUE(ParseRequest(messages(limits.max_messages), Endpoint::kChat, limits).ok());
  EXPECT_EQ(ParamOf(ParseRequest(messages(limits.max_messages + 1), Endpoint::kChat, limits).status()), "messages");
  auto stops = [](size_t n) {
    std::vector<std::string> s;
    for (size_t i = 0; i < n; ++i) s.push_back(std::to_string(i));
    return Json{{"model", "m"}, {"prompt", {1}}, {"stop", s}};
  };
  EXPECT_TRUE(ParseRequest(stops(limits.max_stop), Endpoint::kCompletions, limits).ok());
  EXPECT_EQ(ParamOf(ParseRequest(stops(limits.max_stop + 1), Endpoint::kCompletions, limits).status()), "stop");
  auto top = [](int64_t k) {
    return Json{{"model", "m"}, {"messages", {{{"role", "user"}, {"content", "x"}}}}, {"logprobs", true},
                {"top_logprobs", k}};
  };
  EXPECT_TRUE(ParseRequest(top(limits.max_top_logprobs), Endpoint::kChat, limits).ok());
  EXPECT_EQ(ParamOf(ParseRequest(top(limits.max_top_logprobs + 1), Endpoint::kChat, limits).status()), "top_logprobs");
  Json logprobs = {{"model", "m"}, {"prompt", {1}}, {"logprobs", limits.max_top_logprobs}};
  EXPECT_TRUE(ParseRequest(logprobs, Endpoint::kCompletions, limits).ok());
  logprobs["logprobs"] = limits.max_top_logprobs + 1;
  EXPECT_EQ(ParamOf(ParseRequest(logprobs, Endpoint::kCompletions, limits).status()), "logprobs");
  // Penalties and min_p: OpenAI's [-2, 2], min_p in [0, 1], repetition_penalty > 0.
  for (const auto& [key, ok, bad] : std::vector<std::tuple<std::string, double, double>>{
           {"presence_penalty", 2, 2.001}, {"presence_penalty", -2, -2.001}, {"frequency_penalty", 2, 2.001},
           {"frequency_penalty", -2, -2.001}, {"min_p", 1, 1.001}, {"min_p", 0, -0.001},
           {"repetition_penalty", 1e-9, 0}}) {
    Json body = {{"model", "m"}, {"prompt", {1}}, {key, ok}};
    EXPECT_TRUE(ParseRequest(body, Endpoint::kCompletions, limits).ok()) << body.dump();
    body[key] = bad;
    EXPECT_EQ(ParamOf(ParseRequest(body, Endpoint::kCompletions, limits).status()), key) << body.dump();
  }
  Json n = {{"model", "m"}, {"prompt", {1}}, {"n", limits.max_n}};
  EXPECT_TRUE(ParseRequest(n, Endpoint::kCompletions, limits).ok());
  n["n"] = limits.max_n + 1;
  EXPECT_EQ(ParamOf(ParseRequest(n, Endpoint::kCompletions, limits).status()), "n");
}

TEST(OpenAiCodec, AcceptsNoOpValuesOfUnsupportedParameters) {
  EXPECT_TRUE(ParseRequest(Completion({{"logit_bias", Json::object()}, {"best_of", 1}, {"suffix", ""},
                                       {"user", "u"}, {"tools", Json::array()}, {"tool_choice", "none"}}),
                           Endpoint::kCompletions, Limits{})
                  .ok());
}

TEST(OpenAiCodec, EchoWithLogprobsMayStream) {
  absl::StatusOr<Request> r =
      ParseRequest(Completion({{"echo", true}, {"logprobs", 2}, {"stream", true}}), Endpoint::kCompletions, Limits{});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->echo && r->logprobs && r->stream);
  EXPECT_EQ(r->top_logprobs, 2);
}

TEST(OpenAiCodec, PenaltiesAndMinPAreParsed) {
  absl::StatusOr<Request> off = ParseRequest(Completion(), Endpoint::kCompletions, Limits{});
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_EQ(off->presence_penalty, 0);
  EXPECT_EQ(off->frequency_penalty, 0);
  EXPECT_EQ(off->repetition_penalty, 1);
  EXPECT_EQ(off->min_p, 0);
  absl::StatusOr<Request> r =
      ParseRequest(Completion({{"presence_penalty", -1.5}, {"frequency_penalty", 0.25}, {"repetition_penalty", 1.3},
                               {"min_p", 0.05}}),
                   Endpoint::kCompletions, Limits{});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->presence_penalty, -1.5);
  EXPECT_EQ(r->frequency_penalty, 0.25);
  EXPECT_EQ(r->repetition_penalty, 1.3);
  EXPECT_EQ(r->min_p, 0.05);
}

TEST(OpenAiCodec, ErrorBodyHasOpenAisShape) {
  Json e = ErrorBody(ParamError("n", "n: 9 must be in [1, 4]"), 400)["error"];
  EXPECT_EQ(e["message"], "n: 9 must be in [1, 4]");
  EXPECT_EQ(e["type"], "invalid_request_error");
  EXPECT_EQ(e["param"], "n");
  EXPECT_TRUE(e["code"].is_null());
  Json auth = ErrorBody(absl::UnauthenticatedError("missing API key"), 401)["error"];
  EXPECT_EQ(auth["code"], "invalid_api_key");
  EXPECT_TRUE(auth["param"].is_null());
  Json missing = ErrorBody(ParamError("model", "gone", absl::StatusCode::kNotFound, "model_not_found"), 404)["error"];
  EXPECT_EQ(missing["code"], "model_not_found");
}

TEST(OpenAiCodec, ResponseShapesWithoutTokenizer) {
  Request request = *ParseRequest(Completion({{"n", 2}, {"logprobs", 1}, {"stop_token_ids", {9}}}),
                                  Endpoint::kCompletions, Limits{});
  sampling::SampleOutput out;
  out.prompts.resize(1);
  sampling::SampledSequence a{{5, 9}, {-0.5f, -0.25f}, "stop", {1, {5, 9}, {-0.5f, -0.25f}}};
  sampling::SampledSequence b{{6, 7, 8}, {-1.f, -1.f, -1.f}, "length", {1, {6, 7, 8}, {-1.f, -1.f, -1.f}}};
  out.prompts[0].sequences = {a, b};
  Result result{"cmpl-x", 1, "m", {{1, 2, 3}}, &out};
  Json r = CompletionResponse(request, result, TextCodec{}, request.stop_token_ids);
  EXPECT_EQ(r["object"], "text_completion");
  ASSERT_EQ(r["choices"].size(), 2u);
  EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(r["choices"][1]["finish_reason"], "length");
  EXPECT_EQ(r["choices"][0]["token_ids"], Json({5, 9}));
  EXPECT_EQ(r["choices"][0]["logprobs"]["tokens"], Json({"token_id:5", "token_id:9"}));
  EXPECT_EQ(r["choices"][0]["logprobs"]["top_logprobs"][0]["token_id:5"], -0.5);
  EXPECT_EQ(r["usage"]["prompt_tokens"], 3);
  EXPECT_EQ(r["usage"]["completion_tokens"], 5);
  EXPECT_EQ(r["usage"]["total_tokens"], 8);
  Json chunk = StreamChunk(request, "cmpl-x", 1, "m", 1, "", {7}, std::nullopt, true);
  EXPECT_EQ(chunk["choices"][0]["index"], 1);
  EXPECT_TRUE(chunk["choices"][0]["finish_reason"].is_null());
  Request chat = *ParseRequest({{"model", "m"}, {"messages", {{{"role", "user"}, {"content", "x"}}}}, {"stream", true}},
                               Endpoint::kChat, Limits{});
  Json first = StreamChunk(chat, "c", 1, "m", 0, "", {}, std::nullopt, true);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
}

}  // namespace
}  // namespace twinkle::openai
