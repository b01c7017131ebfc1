#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>

#include "core/ipc/envelope.h"
#include "core/ipc/messages.h"
#include "core/ipc/socket.h"
#include "core/ipc/training_messages.h"

namespace twinkle::ipc {
namespace {

using ::testing::HasSubstr;

TEST(IpcEnvelopeTest, RoundTripKeepsEveryFieldAndBuffer) {
  Message m;
  m.envelope.type = MessageType::kRequest;
  m.envelope.request_id = 0xFFFFFFFFFFULL;
  m.envelope.method = kMethodLoadModel;
  m.envelope.body = Pack(LoadModelRequest{"/models/x", "bfloat16", "cuda:1"});
  m.buffers = {std::string("\x00\x01\x02\x03", 4), std::string(1000, 'z')};

  absl::StatusOr<Message> back = DecodeFrames(EncodeFrames(m));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->envelope.type, MessageType::kRequest);
  EXPECT_EQ(back->envelope.request_id, 0xFFFFFFFFFFULL);
  EXPECT_EQ(back->envelope.method, "load_model");
  EXPECT_EQ(back->buffers, m.buffers);
  absl::StatusOr<LoadModelRequest> body = Unpack<LoadModelRequest>(back->envelope.body, "load_model");
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_EQ(body->model_dir, "/models/x");
  EXPECT_EQ(body->dtype, "bfloat16");
  EXPECT_EQ(body->device, "cuda:1");
}

TEST(IpcEnvelopeTest, ReplyCarriesStatus) {
  Envelope request;
  request.request_id = 7;
  request.method = "load_model";
  Message reply = MakeReply(request, absl::NotFoundError("no such model"));
  absl::StatusOr<Message> back = DecodeFrames(EncodeFrames(reply));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->envelope.request_id, 7u);
  const absl::Status s = ReplyStatus(back->envelope);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "no such model");
  EXPECT_TRUE(ReplyStatus(MakeReply(request, absl::OkStatus(), "x").envelope).ok());
}

TEST(IpcEnvelopeTest, RejectsOversizeFrames) {
  Message m;
  m.buffers = {std::string(2048, 'a')};
  DecodeLimits limits;
  limits.max_buffer_bytes = 1024;
  absl::StatusOr<Message> r = DecodeFrames(EncodeFrames(m), limits);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr("tensor frame 1 of 2048 bytes"));

  limits = DecodeLimits{};
  limits.max_envelope_bytes = 8;
  m.buffers.clear();
  m.envelope.method = std::string(100, 'm');
  EXPECT_THAT(DecodeFrames(EncodeFrames(m), limits).status().message(), HasSubstr("envelope of"));

  limits = DecodeLimits{};
  limits.max_frames = 2;
  m.buffers = {"a", "b", "c"};
  EXPECT_THAT(DecodeFrames(EncodeFrames(m), limits).status().message(), HasSubstr("4 frames"));
}

TEST(IpcEnvelopeTest, RejectsMalformedFrames) {
  EXPECT_THAT(DecodeFrames({}).status().message(), HasSubstr("no envelope"));
  // Truncated msgpack.
  std::vector<std::string> frames = EncodeFrames(Message{});
  frames[0].resize(frames[0].size() / 2);
  EXPECT_THAT(DecodeFrames(frames).status().message(), HasSubstr("malformed envelope"));
  // A msgpack value that is not a map (the integer 5).
  EXPECT_THAT(DecodeFrames({std::string("\x05", 1)}).status().message(), HasSubstr("not a msgpack map"));
  // Garbage bytes.
  EXPECT_FALSE(DecodeFrames({std::string("\xc1\xc1\xc1", 3)}).ok());
}

TEST(IpcEnvelopeTest, RejectsUnknownTypeAndVersion) {
  Message m;
  m.envelope.version = kProtocolVersion + 1;
  absl::StatusOr<Message> r = DecodeFrames(EncodeFrames(m));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("protocol version"));

  m.envelope.version = kProtocolVersion;
  m.envelope.type = static_cast<MessageType>(99);
  EXPECT_THAT(DecodeFrames(EncodeFrames(m)).status().message(), HasSubstr("unknown message type 99"));
}

TEST(IpcEnvelopeTest, MistypedBodyIsAnError) {
  // A hello body where a string is expected in place of the rank.
  const std::string bad = Pack(std::map<std::string, std::string>{{"rank", "zero"}});
  absl::StatusOr<HelloBody> r = Unpack<HelloBody>(bad, "hello");
  EXPECT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("malformed hello body"));
}

// Found by tests/fuzz/ipc_envelope_fuzz: msgpack-c allocates the elements an array or map
// header declares before reading them, so a few bytes asked for ~100 GiB (bad_alloc at best,
// an abort under ASan). Counts beyond what the input can hold are refused before allocating.
TEST(IpcEnvelopeTest, DeclaredCountsBeyondTheInputAreRefusedBeforeAllocating) {
  for (const std::string& bytes : {std::string("\xdd\xff\xff\xff\xff", 5),    // array of 2^32-1
                                   std::string("\xdf\xff\xff\xff\xff", 5),    // map of 2^32-1
                                   std::string("\x81\xa3ops\xdd\x00\x01\x00\x00", 10)}) {
    absl::StatusOr<ForwardRequest> body = Unpack<ForwardRequest>(bytes, "forward");
    ASSERT_FALSE(body.ok());
    EXPECT_THAT(body.status().message(), HasSubstr("size overflow"));
  }
  absl::StatusOr<Envelope> e = DecodeEnvelope(std::string("\xdf\x7f\xff\xff\xff", 5));
  ASSERT_FALSE(e.ok());
  EXPECT_THAT(e.status().message(), HasSubstr("map size overflow"));
}

TEST(IpcEnvelopeTest, NestingBeyondTheDepthLimitIsRefused) {
  const std::string deep = std::string(100, '\x91') + '\x00';  // [[[...[0]...]]]
  absl::StatusOr<ForwardRequest> body = Unpack<ForwardRequest>(deep, "forward");
  ASSERT_FALSE(body.ok());
  EXPECT_THAT(body.status().message(), HasSubstr("depth size overflow"));
  // A real body of the deepest kind still goes through.
  SampleStepReply reply;
  reply.finished.push_back({});
  reply.finished[0].result.samples.push_back({});
  reply.finished[0].result.samples[0].top_token_ids = TensorDesc{"int64", {3, 2}, 1};
  absl::StatusOr<SampleStepReply> back = Unpack<SampleStepReply>(Pack(reply), "sample_step reply");
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_TRUE(back->finished[0].result.samples[0].top_token_ids.has_value());
  EXPECT_EQ(back->finished[0].result.samples[0].top_token_ids->shape[0], 3);
}

TEST(IpcEnvelopeTest, MakeRequestCarriesMethodBodyAndBuffers) {
  Message m = MakeRequest(kMethodLoadModel, "body", {"abc"});
  EXPECT_EQ(m.envelope.type, MessageType::kRequest);
  EXPECT_EQ(m.envelope.method, "load_model");
  EXPECT_EQ(m.envelope.body, "body");
  EXPECT_EQ(m.buffers, std::vector<std::string>{"abc"});
}

TEST(IpcTensorTest, VectorFramesRoundTripAndCheckTheirDtype) {
  std::vector<std::string> buffers = {"unrelated"};
  const TensorDesc ids = AppendVectorFrame(std::vector<int64_t>{-1, 7, 1LL << 40}, buffers);
  const TensorDesc lps = AppendVectorFrame(std::vector<float>{-0.5f, -2.25f}, buffers);
  const TensorDesc none = AppendVectorFrame(std::vector<float>{}, buffers);
  EXPECT_EQ(ids.dtype, "int64");
  EXPECT_EQ(ids.frame, 1u);
  EXPECT_EQ(lps.shape, std::vector<int64_t>{2});
  EXPECT_EQ(*ReadVectorFrame<int64_t>(ids, buffers, "test"), (std::vector<int64_t>{-1, 7, 1LL << 40}));
  EXPECT_EQ(*ReadVectorFrame<float>(lps, buffers, "test"), (std::vector<float>{-0.5f, -2.25f}));
  EXPECT_TRUE(ReadVectorFrame<float>(none, buffers, "test")->empty());

  absl::StatusOr<std::vector<float>> wrong = ReadVectorFrame<float>(ids, buffers, "sample_step reply");
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(wrong.status().message(), HasSubstr("sample_step reply: expected float32, got int64"));
  TensorDesc short_frame = lps;
  short_frame.shape = {3};  // more elements than the frame holds
  EXPECT_FALSE(ReadVectorFrame<float>(short_frame, buffers, "test").ok());
}

TEST(IpcTensorTest, ValidatesFrameSizeAgainstShape) {
  std::vector<std::string> buffers = {std::string(2 * 3 * 4, '\0'), std::string(5, '\0')};
  EXPECT_TRUE(ValidateTensor({"float32", {2, 3}, 0}, buffers).ok());
  EXPECT_THAT(ValidateTensor({"bfloat16", {2, 3}, 0}, buffers).message(), HasSubstr("needs 12"));
  EXPECT_THAT(ValidateTensor({"float32", {2, 3}, 2}, buffers).message(), HasSubstr("frame 2"));
  EXPECT_THAT(ValidateTensor({"complex64", {1}, 0}, buffers).message(), HasSubstr("complex64"));
  EXPECT_THAT(ValidateTensor({"float32", {-1}, 0}, buffers).message(), HasSubstr("negative"));
  EXPECT_THAT(ValidateTensor({"int64", {int64_t{1} << 62, 8}, 0}, buffers).message(),
              HasSubstr("overflows"));
}

// Two ends of an inproc pair, as the engine link's ROUTER/DEALER are for these purposes.
struct SocketPair {
  zmq::context_t context{1};
  zmq::socket_t a{context, zmq::socket_type::pair};
  zmq::socket_t b{context, zmq::socket_type::pair};
  SocketPair() {
    a.bind("inproc://ipc-test");
    b.connect("inproc://ipc-test");
  }
  absl::StatusOr<Received> Receive(const DecodeLimits& limits) {
    for (int i = 0; i < 1000; ++i) {
      absl::StatusOr<Received> r = ReceiveMessage(b, /*with_routing_id=*/false, limits);
      if (!absl::IsNotFound(r.status())) return r;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return absl::DeadlineExceededError("nothing arrived");
  }
};

TEST(IpcSocketTest, SendRefusesAMessageOverTheLimitsAndSendsNothing) {
  SocketPair pair;
  DecodeLimits limits;
  limits.max_frames = 3;
  Message m = MakeRequest("forward", "", {"a", "b", "c"});  // 4 frames: limit + 1
  const absl::Status s = SendMessage(pair.a, m, {}, limits);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("4 frames; limit is 3"));
  m.buffers.pop_back();  // at the limit
  ASSERT_TRUE(SendMessage(pair.a, m, {}, limits).ok());
  absl::StatusOr<Received> r = pair.Receive(limits);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->message.ok()) << r->message.status();
  EXPECT_EQ(r->message->buffers, (std::vector<std::string>{"a", "b"}));  // the refused one never came
}

TEST(IpcSocketTest, AMessageOverTheReceiversLimitsKeepsItsHeaderSoItCanBeAnswered) {
  SocketPair pair;
  Message m = MakeRequest("forward_backward", "body", {"a", "b", "c"});
  m.envelope.request_id = 42;
  ASSERT_TRUE(SendMessage(pair.a, m).ok());
  DecodeLimits tight;
  tight.max_frames = 2;
  absl::StatusOr<Received> r = pair.Receive(tight);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->message.status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(r->header.has_value());
  EXPECT_EQ(r->header->request_id, 42u);
  EXPECT_EQ(r->header->method, "forward_backward");
  EXPECT_EQ(r->header->type, MessageType::kRequest);

  // An unreadable envelope has no header to answer.
  ASSERT_TRUE(pair.a.send(zmq::str_buffer("\xc1"), zmq::send_flags::none));
  r = pair.Receive(DecodeLimits{});
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->message.ok());
  EXPECT_FALSE(r->header.has_value());
}

// The node secret (engines on other nodes): a fresh one reads back, its public key is derived,
// a file others may read or that holds no key is refused naming the fix; and a CURVE client
// with the secret talks to a server with it, one with another secret never gets through.
TEST(NodeSecretTest, ReadsBackRefusesLooseFilesAndAuthenticatesPeers) {
  absl::StatusOr<std::string> secret = NewNodeSecret();
  ASSERT_TRUE(secret.ok()) << secret.status();
  EXPECT_EQ(secret->size(), 40u);
  const std::string path = ::testing::TempDir() + "/node.secret";
  std::remove(path.c_str());
  { std::ofstream(path) << *secret << "\n"; }
  chmod(path.c_str(), 0604);
  absl::StatusOr<std::string> loose = ReadNodeSecret(path);
  EXPECT_EQ(loose.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(loose.status().message(), ::testing::HasSubstr("chmod 600"));
  chmod(path.c_str(), 0640);  // group: a Kubernetes Secret volume under fsGroup
  absl::StatusOr<std::string> read = ReadNodeSecret(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, *secret);
  EXPECT_TRUE(NodePublicKey(*secret).ok());
  { std::ofstream(path) << "not a key\n"; }
  EXPECT_THAT(ReadNodeSecret(path).status().message(), ::testing::HasSubstr("not a Z85 CURVE secret key"));
  EXPECT_EQ(ReadNodeSecret(path + ".missing").status().code(), absl::StatusCode::kNotFound);

  zmq::context_t context(1);
  zmq::socket_t server(context, zmq::socket_type::router);
  server.set(zmq::sockopt::linger, 0);
  ASSERT_TRUE(SetCurveServer(server, *secret).ok());
  server.bind("tcp://127.0.0.1:*");
  const std::string endpoint = server.get(zmq::sockopt::last_endpoint);
  auto client_with = [&](const std::string& key) {
    zmq::socket_t client(context, zmq::socket_type::dealer);
    client.set(zmq::sockopt::linger, 0);
    EXPECT_TRUE(SetCurveClient(client, key).ok());
    client.connect(endpoint);
    EXPECT_TRUE(SendMessage(client, MakeRequest("ping", "")).ok());
    return client;
  };
  auto receive = [&](int wait_ms) -> bool {
    zmq::pollitem_t item{server.handle(), 0, ZMQ_POLLIN, 0};
    zmq::poll(&item, 1, std::chrono::milliseconds(wait_ms));
    absl::StatusOr<Received> r = ReceiveMessage(server, true);
    return r.ok() && r->message.ok() && r->message->envelope.method == "ping";
  };
  absl::StatusOr<std::string> other = NewNodeSecret();
  ASSERT_TRUE(other.ok());
  zmq::socket_t intruder = client_with(*other);
  EXPECT_FALSE(receive(1000));
  zmq::socket_t holder = client_with(*secret);
  EXPECT_TRUE(receive(5000));
}

}  // namespace
}  // namespace twinkle::ipc
