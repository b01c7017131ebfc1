// The Tinker transports' codecs: the HTTP API's JSON (server/tinker/tinker_codec.h), the
// tinker.v1 messages (server/grpc/tinker_codec.h) and a finished future's stored gRPC form
// (server/tinker/stored_result.h).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "server/grpc/tinker_codec.h"
#include "server/tinker/stored_result.h"
#include "server/tinker/tinker_codec.h"
#include "tinker/v1/tinker_service.pb.h"

namespace twinkle::tinker {
namespace {

using ::testing::HasSubstr;

TEST(TinkerCodecTest, JsonDecodersNameTheFieldOfAWrongType) {
  EXPECT_EQ(DecodeSessionHeartbeat(Json::object()).status().message(), "session_id: missing");
  EXPECT_EQ(DecodeCreateSession({{"tags", {"a", 1}}}).status().message(), "tags[1]: expected a string");
  EXPECT_EQ(DecodeCreateSession({{"user_metadata", {{"k", 1}}}}).status().message(),
            "user_metadata.k: expected a string");
  EXPECT_EQ(DecodeCreateModel({{"session_id", "s"}, {"base_model", "m"}, {"lora_config", {{"rank", "x"}}}})
                .status()
                .message(),
            "rank: expected an integer");
  EXPECT_EQ(DecodeOptimStep({{"model_id", "m"}, {"adam_params", {{"beta1", "x"}}}}).status().message(),
            "beta1: expected a number");
  EXPECT_EQ(DecodeSaveWeights({{"model_id", "m"}}).status().message(), "path: missing");
  EXPECT_EQ(DecodeLoadWeights({{"path", "p"}}).status().message(), "session_id: missing");
  EXPECT_THAT(DecodeSample({{"prompt", {{"chunks", Json::array()}}}, {"sampling_params", {{"stop", 3}}}})
                  .status()
                  .message(),
              HasSubstr("sampling_params.stop"));
}

TEST(TinkerCodecTest, JsonDecodersKeepTheSdkDefaults) {
  absl::StatusOr<CreateModelRequest> model = DecodeCreateModel({{"session_id", "s"}, {"base_model", "m"}});
  ASSERT_TRUE(model.ok());
  EXPECT_EQ(model->lora_config.rank, 32);
  EXPECT_TRUE(model->lora_config.train_attn && model->lora_config.train_mlp && model->lora_config.train_unembed);
  EXPECT_TRUE(model->user_metadata.is_null());
  absl::StatusOr<OptimStepRequest> optim = DecodeOptimStep({{"model_id", "m"}, {"seq_id", "7"}});
  ASSERT_TRUE(optim.ok());
  EXPECT_EQ(optim->seq_id, 7);  // int64 as a decimal string (gRPC's JSON form)
  EXPECT_DOUBLE_EQ(optim->adam_params.beta2, 0.95);
  absl::StatusOr<LoadWeightsRequest> load = DecodeLoadWeights({{"model_id", nullptr}, {"session_id", "s"}, {"path", "p"}});
  ASSERT_TRUE(load.ok());
  EXPECT_FALSE(load->model_id.has_value());  // create_training_client_from_state
  absl::StatusOr<SampleRequest> sample =
      DecodeSample({{"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", {1, 2, 3}}}}}}},
                    {"sampling_params", {{"stop", Json::array()}, {"max_tokens", 5}}}});
  ASSERT_TRUE(sample.ok());
  EXPECT_EQ(sample->prompt, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(sample->num_samples, 1);
  EXPECT_EQ(sample->seq_id, -1);
  EXPECT_EQ(sample->sampling_params.max_tokens, 5);
  // stop=[] is kept apart from no stop: it turns EOS off.
  ASSERT_TRUE(sample->sampling_params.stop_strings.has_value());
  EXPECT_TRUE(sample->sampling_params.stop_strings->empty());
}

TEST(TinkerCodecTest, JsonEncodersWriteTheSdkKeysWithNulls) {
  EXPECT_EQ(ToJson(FuturePromise{"tk-1", "", {}}), (Json{{"request_id", "tk-1"}, {"model_id", nullptr}}));
  EXPECT_EQ(ToJson(FuturePromise{"tk-2", "", {"tk-2:0"}}),
            (Json{{"request_id", "tk-2"}, {"model_id", nullptr}, {"sample_sequence_ids", {"tk-2:0"}}}));
  EXPECT_EQ(ToJson(OpResult::OfMetrics("optim_step", {})),
            (Json{{"type", "optim_step"}, {"metrics", Json::object()}}));
  EXPECT_EQ(ToJson(OpResult::OfLoad("m", "p")),
            (Json{{"type", "load_weights"}, {"model_id", "m"}, {"path", "p"}}));
  CheckpointInfo c{"weights/a", "training", "t", "tinker://m/weights/a", 10, false, std::nullopt};
  EXPECT_EQ(ToJson(c)["expires_at"], Json(nullptr));
  EXPECT_EQ(ToJson(c)["public"], false);
  EXPECT_EQ(ToJson(CheckpointsResult{{c}, std::nullopt})["cursor"], Json(nullptr));
  TrainingRunInfo run;
  run.training_run_id = "m";
  const Json j = ToJson(run);
  for (const char* key : {"lora_rank", "last_checkpoint", "last_sampler_checkpoint", "user_metadata"}) {
    EXPECT_TRUE(j.contains(key) && j[key].is_null()) << key;
  }
}

TEST(TinkerCodecTest, StoredProtoCarriesTheResultAndItsHttpBody) {
  v1::SampleResponse sample;
  sample.add_sequences()->set_tokens("abcd");
  const std::string stored = StoredProto(sample);
  EXPECT_TRUE(IsStoredResponse(stored));
  EXPECT_EQ(HttpProtoBody(stored), sample.SerializeAsString());
  v1::RetrieveFutureResponse parsed;
  ASSERT_TRUE(parsed.ParseFromString(stored));
  EXPECT_EQ(parsed.sample().sequences(0).tokens(), "abcd");

  const std::string op = StoredProto(OpResult::OfMetrics("optim_step", {{"a", 1}}));
  EXPECT_TRUE(IsStoredResponse(op));
  EXPECT_TRUE(HttpProtoBody(op).empty());  // answered as JSON over HTTP
  ASSERT_TRUE(parsed.ParseFromString(op));
  EXPECT_EQ(parsed.op().metrics().at("a"), 1.0);
  EXPECT_TRUE(IsStoredResponse(StoredProto(OpResult::OfModel("unload_model", ""))));  // an empty OpResult too

  // What earlier servers stored: the bare message, answered as it is over HTTP.
  v1::ForwardBackwardOutput bare;
  bare.set_loss_fn_output_type("ArrayRecord");
  const std::string old = bare.SerializeAsString();
  EXPECT_FALSE(IsStoredResponse(old));
  EXPECT_EQ(HttpProtoBody(old), old);
  EXPECT_FALSE(IsStoredResponse(""));
}

TEST(TinkerCodecTest, ProtoDecodersTreatEmptyRequiredStringsAsMissing) {
  EXPECT_EQ(Decode(v1::SessionHeartbeatRequest()).status().message(), "session_id: missing");
  v1::SaveWeightsRequest save;
  save.set_model_id("m");
  EXPECT_EQ(Decode(save).status().message(), "path: missing");
  v1::CreateModelRequest create;
  create.set_session_id("s");
  create.set_base_model("b");
  absl::StatusOr<CreateModelRequest> model = Decode(create);
  ASSERT_TRUE(model.ok());
  EXPECT_EQ(model->lora_config.rank, 32);  // 0 = unset
  create.mutable_lora_config()->set_train_mlp(false);
  EXPECT_FALSE(Decode(create)->lora_config.train_mlp);
  v1::SampleRequest sample;
  sample.add_prompt(5);
  sample.mutable_sampling_params()->mutable_stop_tokens();
  absl::StatusOr<SampleRequest> decoded = Decode(sample);
  ASSERT_TRUE(decoded.ok());
  EXPECT_EQ(decoded->num_samples, 1);
  ASSERT_TRUE(decoded->sampling_params.stop_tokens.has_value());
  EXPECT_TRUE(decoded->sampling_params.stop_tokens->empty());
}

}  // namespace
}  // namespace twinkle::tinker
