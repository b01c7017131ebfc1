// TokenText (stop strings) serves byte-level vocabularies through core/tokenizer and keeps its
// own SentencePiece-style decoding.
#include "core/sampling/token_text.h"

#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/tokenizer/tokenizer.h"

namespace twinkle::sampling {
namespace {

using Json = nlohmann::json;

Json ByteLevelJson() {
  Json vocab = Json::object();
  for (int c = 33; c < 127; ++c) vocab[std::string(1, static_cast<char>(c))] = c - 33;
  vocab["\xC4\xA0"] = 94;  // Ġ (space)
  vocab["\xC3\x83"] = 95;  // Ã = byte 0xC3
  vocab["\xC2\xA9"] = 96;  // © = byte 0xA9
  return Json{
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", Json::array()}}},
      {"added_tokens", Json::array({{{"id", 97}, {"content", "<|im_end|>"}, {"special", true}}})},
  };
}

TEST(TokenTextTest, ByteLevelBytesAreTheTokenizers) {
  const std::string json = ByteLevelJson().dump();
  auto text = TokenText::FromTokenizerJson(json);
  ASSERT_TRUE(text.ok()) << text.status();
  auto tok = tokenizer::Tokenizer::FromJson(json);
  ASSERT_TRUE(tok.ok()) << tok.status();
  ASSERT_EQ(text->size(), static_cast<size_t>((*tok)->vocab_size()));
  for (int32_t id = 0; id < (*tok)->vocab_size(); ++id) {
    EXPECT_EQ(text->Decode({id}), (*tok)->TokenBytes(id)) << id;
  }
  // A stop string split inside a UTF-8 character is found on the token that completes it.
  auto ids = (*tok)->Encode("ab \xC3\xA9 x<|im_end|>");
  ASSERT_TRUE(ids.ok()) << ids.status();
  std::vector<int64_t> tokens(ids->begin(), ids->end());
  EXPECT_EQ(text->Decode(tokens), "ab \xC3\xA9 x<|im_end|>");
  const auto through = text->TokensThroughFirstStop(tokens, {"\xC3\xA9"});
  ASSERT_TRUE(through.has_value());
  EXPECT_EQ(text->Decode(std::vector<int64_t>(tokens.begin(), tokens.begin() + *through)), "ab \xC3\xA9");
}

TEST(TokenTextTest, ByteLevelFileTheTokenizerRefusesIsRefusedWithItsReason) {
  Json j = ByteLevelJson();
  j["normalizer"] = {{"type", "Lowercase"}};
  auto text = TokenText::FromTokenizerJson(j.dump());
  ASSERT_FALSE(text.ok());
  EXPECT_NE(text.status().message().find("Lowercase"), std::string::npos) << text.status();
}

TEST(TokenTextTest, SentencePieceStyleStillDecodes) {
  const Json j = {
      {"normalizer", {{"type", "Replace"}}},
      {"decoder", {{"type", "Sequence"}}},
      {"model", {{"type", "BPE"}, {"vocab", {{"\xE2\x96\x81hi", 0}, {"<0x41>", 1}, {"x", 2}}}, {"byte_fallback", true}}},
      {"added_tokens", Json::array({{{"id", 3}, {"content", "</s>"}, {"special", true}}})},
  };
  auto text = TokenText::FromTokenizerJson(j.dump());
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(text->Decode({0, 1, 2, 3}), " hiAx</s>");
}

}  // namespace
}  // namespace twinkle::sampling
