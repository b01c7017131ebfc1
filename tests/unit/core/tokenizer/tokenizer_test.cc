#include "core/tokenizer/tokenizer.h"

#include "core/tokenizer/chat_renderer.h"

#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace twinkle::tokenizer {
namespace {

using Json = nlohmann::json;

// A minimal byte-level BPE: every printable ASCII byte, "ab" from one merge, one special token.
Json MinimalJson() {
  Json vocab = Json::object();
  for (int c = 33; c < 127; ++c) vocab[std::string(1, static_cast<char>(c))] = c - 33;
  vocab["\xC4\xA0"] = 94;  // Ġ (space)
  vocab["ab"] = 95;
  return Json{
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", Json::array({"a b"})}}},
      {"added_tokens", Json::array({{{"id", 96}, {"content", "<|end|>"}, {"special", true}}})},
  };
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Load(const Json& j) { return Tokenizer::FromJson(j.dump()); }

TEST(TokenizerTest, MinimalRoundTrip) {
  auto tok = Load(MinimalJson());
  ASSERT_TRUE(tok.ok()) << tok.status();
  auto ids = (*tok)->Encode("ab a<|end|>");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*ids, (std::vector<int32_t>{95, 94, 'a' - 33, 96}));
  EXPECT_EQ(*(*tok)->Decode(*ids, false), "ab a<|end|>");
  EXPECT_EQ(*(*tok)->Decode(*ids, true), "ab a");
  EXPECT_EQ((*tok)->vocab_size(), 97);
  EXPECT_TRUE((*tok)->IsSpecial(96));
  EXPECT_EQ((*tok)->TokenToId("<|end|>"), 96);
}

void ExpectRefused(const Json& j, const std::string& naming) {
  auto tok = Load(j);
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(tok.status().message().find(naming), std::string::npos) << tok.status();
}

TEST(TokenizerTest, UnsupportedPartsAreNamed) {
  Json j = MinimalJson();
  j["normalizer"] = {{"type", "Lowercase"}};
  ExpectRefused(j, "Lowercase");
  j = MinimalJson();
  j["pre_tokenizer"] = {{"type", "Metaspace"}};
  ExpectRefused(j, "Metaspace");
  j = MinimalJson();
  j["model"]["type"] = "Unigram";
  ExpectRefused(j, "Unigram");
  j = MinimalJson();
  j["decoder"] = {{"type", "WordPiece"}};
  ExpectRefused(j, "WordPiece");
  j = MinimalJson();
  j["model"]["byte_fallback"] = true;
  ExpectRefused(j, "byte_fallback");
  j = MinimalJson();
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers", Json::array({{{"type", "Split"}, {"pattern", {{"Regex", "a"}}}, {"behavior", "Removed"}},
                                                       {{"type", "ByteLevel"}, {"use_regex", false}}})}};
  ExpectRefused(j, "Removed");
  j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Isolated";
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  ExpectRefused(j, "does not compile");
  j = MinimalJson();
  j["model"]["merges"] = Json::array({"a zz"});
  ExpectRefused(j, "not in the vocabulary");
  ExpectRefused(Json::array(), "not a JSON object");
}

TEST(TokenizerTest, IdLimitIsEnforcedAtLimitPlusOne) {
  constexpr int64_t kLimit = int64_t{1} << 21;  // docs/tokenizer.md
  Json j = MinimalJson();
  j["added_tokens"][0]["id"] = kLimit - 1;
  auto tok = Load(j);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->vocab_size(), kLimit);
  j["added_tokens"][0]["id"] = kLimit;
  ExpectRefused(j, "added token id 2097152 is not in [0, 2097152)");
  j = MinimalJson();
  j["model"]["vocab"]["zz"] = kLimit;
  ExpectRefused(j, "is not an id in [0, 2097152)");
}

TEST(TokenizerTest, InvalidUtf8TextIsRefused) {
  auto tok = Load(MinimalJson());
  ASSERT_TRUE(tok.ok());
  auto ids = (*tok)->Encode(std::string("a\xC3", 2));
  ASSERT_FALSE(ids.ok());
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(ids.status().message().find("UTF-8 (byte 1)"), std::string::npos) << ids.status();
}

TEST(TokenizerTest, UnknownIdIsRefusedByDecode) {
  auto tok = Load(MinimalJson());
  ASSERT_TRUE(tok.ok());
  for (int32_t id : {97, -1, 1 << 30}) {
    auto text = (*tok)->Decode(std::vector<int32_t>{0, id}, false);
    ASSERT_FALSE(text.ok());
    EXPECT_NE(text.status().message().find(std::to_string(id)), std::string::npos) << text.status();
  }
  EXPECT_EQ((*tok)->TokenBytes(97), "");
}

TEST(TokenizerTest, StreamDecoderHoldsBackSplitCharacters) {
  // "é" is C3 A9: give the vocabulary one token per byte (Ã = 0xC3, © = 0xA9).
  Json j = MinimalJson();
  j["model"]["vocab"]["\xC3\x83"] = 97;  // Ã = byte 0xC3
  j["model"]["vocab"]["\xC2\xA9"] = 98;  // © = byte 0xA9
  auto tok2 = Load(j);
  ASSERT_TRUE(tok2.ok()) << tok2.status();
  StreamDecoder stream(**tok2, false);
  EXPECT_EQ(stream.Push(0), "!");
  EXPECT_EQ(stream.Push(97), "");  // held back: the first byte of é
  EXPECT_EQ(stream.Push(98), "\xC3\xA9");
  EXPECT_EQ(stream.Push(97), "");
  EXPECT_EQ(stream.Finish(), "\xEF\xBF\xBD");  // never completed: repaired as Decode does
  EXPECT_EQ(*(*tok2)->Decode(std::vector<int32_t>{0, 97, 98, 97}, false), "!\xC3\xA9\xEF\xBF\xBD");
}

TEST(TokenizerTest, MissingModelDirIsNotFound) {
  auto tok = Tokenizer::FromModelDir("/nonexistent/model");
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(tok.status().message().find("/nonexistent/model/tokenizer.json"), std::string::npos);
}

TEST(ChatRendererTest, UnknownNameListsTheKnownOnes) {
  auto r = MakeChatRenderer("vicuna");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("qwen3, qwen3_5, llama3, chatml"), std::string::npos) << r.status();
}

TEST(ChatRendererTest, RefusalsNameTheProblem) {
  auto r = MakeChatRenderer("qwen3");
  ASSERT_TRUE(r.ok());
  std::vector<ChatMessage> messages = {{.role = "user", .content = "hi"}};
  RenderOptions both;
  both.continue_final_message = true;
  auto text = (*r)->Render(messages, both);
  ASSERT_FALSE(text.ok());
  EXPECT_NE(text.status().message().find("exclusive"), std::string::npos) << text.status();
  RenderOptions bad_tools;
  bad_tools.tools_json = "{\"not\": \"an array\"}";
  text = (*r)->Render(messages, bad_tools);
  ASSERT_FALSE(text.ok());
  EXPECT_NE(text.status().message().find("tools"), std::string::npos) << text.status();
  messages.push_back({.role = "user", .content = std::string("\xC3", 1)});
  text = (*r)->Render(messages, RenderOptions{});
  ASSERT_FALSE(text.ok());
  EXPECT_NE(text.status().message().find("messages[1]"), std::string::npos) << text.status();
  auto qwen35 = MakeChatRenderer("qwen3_5");
  ASSERT_TRUE(qwen35.ok());
  std::vector<ChatMessage> call = {{.role = "user", .content = "hi"},
                                   {.role = "assistant", .tool_calls = {{.id = "1", .name = "f", .arguments_json = "[1]"}}}};
  text = (*qwen35)->Render(call, RenderOptions{});
  ASSERT_FALSE(text.ok());
  EXPECT_NE(text.status().message().find("messages[1]: tool call 'f'"), std::string::npos) << text.status();
}

}  // namespace
}  // namespace twinkle::tokenizer
