// The training coordinator in process against a fake EngineLink (no engine, no sleeps): what
// it asks the engine for over a Twinkle gradient-accumulation window, and what it reports.
#include <cstdint>
#include <map>
#include <tuple>
#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/futures/future_store.h"
#include "core/ipc/messages.h"
#include "core/ipc/training_messages.h"
#include "core/scheduler/op.h"
#include "core/training/coordinator.h"
#include "core/training/engine_link.h"

namespace twinkle::training {
namespace {

constexpr int64_t kVocab = 50;
constexpr double kUnit = 2147483648.0;  // 2^31: the coordinator's window constant

// Answers every call at once; forward_backward's loss metric is what a token-mean loss
// divided by the window constant would report: (trained tokens × 1.0) / window_tokens.
class FakeEngine final : public EngineLink {
 public:
  absl::StatusOr<ipc::Message> Call(ipc::Message request) override {
    absl::MutexLock lock(&mu_);
    const std::string method = request.envelope.method;
    ipc::Message reply;
    reply.envelope.method = method;
    if (method == ipc::kMethodCreateAdapter) {
      reply.envelope.body = ipc::Pack(ipc::CreateAdapterReply{100, 1.0});
    } else if (method == ipc::kMethodForwardBackward || method == ipc::kMethodForward) {
      absl::StatusOr<ipc::ForwardRequest> fwd = ipc::Unpack<ipc::ForwardRequest>(request.envelope.body, "forward");
      if (!fwd.ok()) return fwd.status();
      ipc::ForwardReply out;
      std::vector<std::string> adapters;
      for (const ipc::TrainOpMsg& op : fwd->ops) adapters.push_back(op.adapter_id);
      forward_calls_.push_back(adapters);
      max_pass_bytes_.push_back(fwd->max_pass_bytes);
      for (const ipc::TrainOpMsg& op : fwd->ops) {
        window_tokens_.push_back(op.window_tokens);
        ipc::OpResultMsg r;
        int64_t tokens = 0;
        for (const ipc::DatumMsg& d : op.datums) {
          const int64_t n = d.input_tokens.shape.at(0);
          auto mask_desc = d.inputs.find("mask");
          if (mask_desc == d.inputs.end()) return absl::InvalidArgumentError("no mask");
          absl::StatusOr<std::vector<float>> mask = ipc::ReadVectorFrame<float>(mask_desc->second, request.buffers, "mask");
          if (!mask.ok()) return mask.status();
          for (float m : *mask) tokens += m > 0 ? 1 : 0;
          r.logprobs.push_back(ipc::AppendVectorFrame(std::vector<float>(n, -1.0f), reply.buffers));
        }
        const double denom = op.window_tokens > 0 ? static_cast<double>(op.window_tokens) : static_cast<double>(tokens);
        r.metrics["loss:mean"] = static_cast<double>(tokens) / denom;
        r.metrics["num_tokens:sum"] = static_cast<double>(tokens);
        out.ops.push_back(std::move(r));
      }
      reply.envelope.body = ipc::Pack(out);
    } else if (method == ipc::kMethodOptimStep) {
      absl::StatusOr<ipc::OptimStepRequest> step = ipc::Unpack<ipc::OptimStepRequest>(request.envelope.body, "step");
      if (!step.ok()) return step.status();
      grad_scales_.push_back(step->grad_scale);
      reply.envelope.body = ipc::Pack(ipc::OptimStepReply{1.0, 0.1, 1});
    } else if (method == ipc::kMethodClipGradNorm) {
      absl::StatusOr<ipc::ClipGradNormRequest> clip =
          ipc::Unpack<ipc::ClipGradNormRequest>(request.envelope.body, "clip");
      if (!clip.ok()) return clip.status();
      grad_scales_.push_back(clip->grad_scale);
      reply.envelope.body = ipc::Pack(ipc::ClipGradNormReply{2.0});
    } else {
      reply.envelope.body = ipc::Pack(ipc::AdapterRequest{});
    }
    return reply;
  }
  uint64_t generation() const override { return 1; }
  int64_t vocab_size() const override { return kVocab; }
  int64_t max_position_embeddings() const override { return max_positions; }
  int64_t max_positions = 0;
  ActivationCost activation_cost() const override { return cost; }
  ActivationCost cost;
  std::vector<std::string> supported_losses() const override {
    return {"twinkle:cross_entropy", "twinkle:grpo", "cross_entropy"};
  }

  std::vector<int64_t> window_tokens() {
    absl::MutexLock lock(&mu_);
    return window_tokens_;
  }
  std::vector<double> grad_scales() {
    absl::MutexLock lock(&mu_);
    return grad_scales_;
  }
  // The adapters (engine ids) of each forward / forward_backward call, in call order.
  std::vector<std::vector<std::string>> forward_calls() {
    absl::MutexLock lock(&mu_);
    return forward_calls_;
  }
  // Each forward / forward_backward call's max_pass_bytes.
  std::vector<int64_t> max_pass_bytes() {
    absl::MutexLock lock(&mu_);
    return max_pass_bytes_;
  }

 private:
  absl::Mutex mu_;
  std::vector<int64_t> window_tokens_;
  std::vector<double> grad_scales_;
  std::vector<std::vector<std::string>> forward_calls_;
  std::vector<int64_t> max_pass_bytes_;
};

// A sequence of n tokens whose last `trained` are trained (HF labels: -100 elsewhere).
Feature Seq(int64_t n, int64_t trained) {
  Feature f;
  for (int64_t i = 0; i < n; ++i) {
    f.input_ids.push_back(1 + i % (kVocab - 1));
    f.labels.push_back(i >= n - trained ? f.input_ids.back() : -100);
  }
  return f;
}

class CoordinatorWindowTest : public ::testing::Test {
 protected:
  void SetUp() override {
    coordinator_ = std::make_unique<TrainingCoordinator>(CoordinatorOptions{}, engine_, futures_);
    coordinator_->Start();
  }
  void TearDown() override { coordinator_->Stop(); }

  void Add(const std::string& name, int32_t accumulation) {
    AddAdapterArgs args;
    args.name = name;
    args.lora.rank = 4;
    args.gradient_accumulation_steps = accumulation;
    ASSERT_TRUE(coordinator_->AddAdapter(tenant_, args).ok());
  }
  OpOutput Wait(absl::StatusOr<uint64_t> id) {
    EXPECT_TRUE(id.ok()) << id.status();
    if (!id.ok()) return {};
    absl::StatusOr<FutureResult> r = futures_.Wait(*id, tenant_.id, absl::Seconds(30));
    EXPECT_TRUE(r.ok() && r->ok()) << (r.ok() ? r->status() : r.status());
    if (!r.ok() || !r->ok()) return {};
    return std::get<OpOutput>(**r);
  }
  OpOutput ForwardBackward(const std::string& name, std::vector<Feature> inputs) {
    ForwardArgs args;
    args.inputs = std::move(inputs);
    return Wait(coordinator_->SubmitForward(tenant_, name, ForwardMode::kForwardBackward, args, false, {}));
  }
  OpOutput Control(const std::string& name, training::Control control) {
    return Wait(coordinator_->SubmitControl(tenant_, name, control, 1.0, 2.0, {}));
  }

  FakeEngine engine_;
  FutureStore futures_;
  TenantContext tenant_{"alice"};
  std::unique_ptr<TrainingCoordinator> coordinator_;
};

TEST_F(CoordinatorWindowTest, AWindowDividesItsGradientsByItsTokensOnceAtTheFirstClipOrStep) {
  Add("acc", 3);
  // Trained tokens per call: 3, 4 + 5, 6.
  const std::vector<std::vector<Feature>> calls = {{Seq(6, 3)}, {Seq(8, 4), Seq(9, 5)}, {Seq(7, 6)}};
  const std::vector<int64_t> trained = {3, 9, 6};
  for (size_t i = 0; i < calls.size(); ++i) {
    const OpOutput out = ForwardBackward("acc", calls[i]);
    // Each call reports its own mean (the fake's 1.0 per token), not the window-divided one.
    EXPECT_DOUBLE_EQ(out.metrics.at("loss:mean"), 1.0) << i;
    EXPECT_EQ(out.metrics.at("num_tokens:sum"), static_cast<double>(trained[i]));
    const OpOutput clip = Control("acc", training::Control::kClipGradNorm);
    EXPECT_EQ(clip.skipped, i < 2) << i;
  }
  EXPECT_EQ(engine_.window_tokens(), (std::vector<int64_t>{int64_t{1} << 31, int64_t{1} << 31, int64_t{1} << 31}));
  // The window's 18 tokens: the clip (the first to act) applies 2^31 / 18, the step after it
  // nothing more.
  EXPECT_FALSE(Control("acc", training::Control::kStep).skipped);
  ASSERT_EQ(engine_.grad_scales().size(), 2u);
  EXPECT_DOUBLE_EQ(engine_.grad_scales()[0], kUnit / 18.0);
  EXPECT_DOUBLE_EQ(engine_.grad_scales()[1], 1.0);

  // The next window counts from zero.
  ForwardBackward("acc", {Seq(5, 4)});
  ForwardBackward("acc", {Seq(5, 4)});
  ForwardBackward("acc", {Seq(5, 2)});
  EXPECT_FALSE(Control("acc", training::Control::kClipGradAndStep).skipped);
  ASSERT_EQ(engine_.grad_scales().size(), 4u);
  EXPECT_DOUBLE_EQ(engine_.grad_scales()[2], kUnit / 10.0);  // 4 + 4 + 2
  EXPECT_DOUBLE_EQ(engine_.grad_scales()[3], 1.0);
}

TEST_F(CoordinatorWindowTest, WithoutAWindowOrWithASumLossEachCallDividesByItself) {
  Add("one", 1);
  ForwardBackward("one", {Seq(6, 3)});
  EXPECT_FALSE(Control("one", training::Control::kStep).skipped);
  Add("sum", 2);
  ASSERT_TRUE(futures_.Wait(*coordinator_->SubmitSetLoss(tenant_, "sum", "CrossEntropyLoss", {}, {{"reduction", "sum"}}),
                            "alice", absl::Seconds(30)).ok());
  ForwardBackward("sum", {Seq(6, 3)});
  ForwardBackward("sum", {Seq(6, 3)});
  EXPECT_FALSE(Control("sum", training::Control::kStep).skipped);
  EXPECT_EQ(engine_.window_tokens(), (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(engine_.grad_scales(), (std::vector<double>{1.0, 1.0}));
}

TEST_F(CoordinatorWindowTest, ZeroGradDropsAPendingScale) {
  Add("acc", 2);
  ForwardBackward("acc", {Seq(6, 3)});
  ForwardBackward("acc", {Seq(6, 3)});
  EXPECT_FALSE(Control("acc", training::Control::kZeroGrad).skipped);
  EXPECT_FALSE(Control("acc", training::Control::kStep).skipped);
  EXPECT_EQ(engine_.grad_scales(), (std::vector<double>{1.0}));
}

// Ordering, dedupe, bounds and fusion, with the scheduler paused while ops are queued so the
// outcome does not depend on timing.
TEST_F(CoordinatorWindowTest, QueuedOpsDedupeByKeyFuseAcrossAdaptersAndRespectThePendingBound) {
  Add("a", 1);
  Add("b", 1);
  ForwardArgs args;
  args.inputs = {Seq(6, 3)};
  SubmitOptions keyed;
  keyed.idempotency_key = "k1";
  keyed.fingerprint = 11;
  coordinator_->scheduler().Pause();
  absl::StatusOr<uint64_t> first = coordinator_->SubmitForward(tenant_, "a", ForwardMode::kForwardBackward, args, false, keyed);
  absl::StatusOr<uint64_t> again = coordinator_->SubmitForward(tenant_, "a", ForwardMode::kForwardBackward, args, false, keyed);
  ASSERT_TRUE(first.ok() && again.ok());
  EXPECT_EQ(*again, *first);  // a retry: the first op's future, nothing new queued
  SubmitOptions other_body = keyed;
  other_body.fingerprint = 12;
  absl::StatusOr<uint64_t> conflict =
      coordinator_->SubmitForward(tenant_, "a", ForwardMode::kForwardBackward, args, false, other_body);
  ASSERT_FALSE(conflict.ok());
  EXPECT_TRUE(sched::IsIdempotencyConflict(conflict.status())) << conflict.status();
  absl::StatusOr<uint64_t> second_b = coordinator_->SubmitForward(tenant_, "b", ForwardMode::kForwardBackward, args, false, {});
  ASSERT_TRUE(second_b.ok());
  // The tenant's pending bound: 2 queued, a third is refused before anything is queued.
  TenantContext small = tenant_;
  small.max_pending_ops = 2;
  absl::StatusOr<uint64_t> over = coordinator_->SubmitForward(small, "b", ForwardMode::kForwardBackward, args, false, {});
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  coordinator_->scheduler().Resume();
  Wait(first);
  Wait(second_b);
  // One engine call carried both adapters' heads (fused); the deduplicated retry ran nowhere.
  const std::vector<std::vector<std::string>> calls = engine_.forward_calls();
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0].size(), 2u);
}

// Sessions are bounded per tenant (max_sessions): the first over the limit is refused naming
// it, another tenant is unaffected, and ending one makes room again.
TEST_F(CoordinatorWindowTest, ASequenceLongerThanTheContextIsRefusedBeforeItIsQueued) {
  // model.max_context_tokens when set, else the model's max_position_embeddings.
  for (const auto& [configured, positions, limit, key] :
       std::vector<std::tuple<int64_t, int64_t, int64_t, std::string>>{
           {8, 0, 8, "model.max_context_tokens"}, {0, 6, 6, "max_position_embeddings"}}) {
    coordinator_->Stop();
    CoordinatorOptions options;
    options.max_context_tokens = configured;
    engine_.max_positions = positions;
    coordinator_ = std::make_unique<TrainingCoordinator>(options, engine_, futures_);
    coordinator_->Start();
    Add("a", 1);
    EXPECT_EQ(ForwardBackward("a", {Seq(3, 2), Seq(limit, 2)}).sequences.size(), 2u);  // at the limit: trains
    ForwardArgs args;
    args.inputs = {Seq(3, 2), Seq(limit + 1, 2)};
    const size_t calls = engine_.forward_calls().size();
    absl::StatusOr<uint64_t> id =
        coordinator_->SubmitForward(tenant_, "a", ForwardMode::kForwardBackward, args, false, {});
    ASSERT_FALSE(id.ok());
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(id.status().message(),
                ::testing::HasSubstr(absl::StrCat("sequence 1 holds ", limit + 1, " tokens, above the model's context of ",
                                                  limit, " tokens (", key, ")")));
    EXPECT_EQ(engine_.forward_calls().size(), calls);  // nothing reached the engine
  }
  engine_.max_positions = 0;
}

// engine.activation_memory_mib: a request whose estimate (the engine's coefficients over its
// sequences) is above the budget is refused naming both figures before anything is queued;
// at the budget it trains; two requests whose estimates sum above it run as two steps, under
// it as one fused step.
TEST_F(CoordinatorWindowTest, MemoryAdmissionRefusesAnOverBudgetRequestAndBoundsFusion) {
  coordinator_->Stop();
  CoordinatorOptions options;
  options.activation_memory_bytes = int64_t{1} << 20;  // 1 MiB
  // 16 KiB fixed, 1 KiB per token and 16 B per token²: sequences of 96 + 192 tokens are
  // 16 KiB + 288 KiB + 16 · (96² + 192²) B = 1 MiB exactly.
  engine_.cost = ActivationCost{16 << 10, 1 << 10, 16};
  coordinator_ = std::make_unique<TrainingCoordinator>(options, engine_, futures_);
  coordinator_->Start();
  Add("a", 1);
  Add("b", 1);
  EXPECT_EQ(EstimateActivationBytes(engine_.cost, {96, 192}), int64_t{1} << 20);
  EXPECT_EQ(ForwardBackward("a", {Seq(96, 2), Seq(192, 2)}).sequences.size(), 2u);  // at the budget
  ForwardArgs args;
  args.inputs = {Seq(96, 2), Seq(193, 2)};  // 1 KiB + 16 · 385 B over 1 MiB: "2 MiB" (rounded up)
  const size_t calls = engine_.forward_calls().size();
  for (ForwardMode mode : {ForwardMode::kForwardBackward, ForwardMode::kForward}) {
    absl::StatusOr<uint64_t> id = coordinator_->SubmitForward(tenant_, "a", mode, args, false, {});
    ASSERT_FALSE(id.ok());
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(id.status().message(),
                ::testing::HasSubstr("inputs: 289 tokens in 2 sequences need an estimated 2 MiB of activation "
                                     "memory, above the 1 MiB a step may use (engine.activation_memory_mib)"));
  }
  EXPECT_EQ(engine_.forward_calls().size(), calls);  // nothing reached the engine

  // Fusion: two requests of 513 tokens (513 KiB each) sum over 1 MiB and run as two steps;
  // two of 512 fit one fused step.
  coordinator_->Stop();
  engine_.cost = ActivationCost{0, 1 << 10, 0};  // 1 KiB per token: 1024 tokens = 1 MiB
  coordinator_ = std::make_unique<TrainingCoordinator>(options, engine_, futures_);
  coordinator_->Start();
  Add("a", 1);
  Add("b", 1);
  for (const auto& [tokens, steps] : std::vector<std::pair<int64_t, size_t>>{{513, 2}, {512, 1}}) {
    const size_t before = engine_.forward_calls().size();
    ForwardArgs each;
    each.inputs = {Seq(tokens, 2)};
    coordinator_->scheduler().Pause();
    absl::StatusOr<uint64_t> a = coordinator_->SubmitForward(tenant_, "a", ForwardMode::kForwardBackward, each, false, {});
    absl::StatusOr<uint64_t> b = coordinator_->SubmitForward(tenant_, "b", ForwardMode::kForwardBackward, each, false, {});
    coordinator_->scheduler().Resume();
    Wait(a);
    Wait(b);
    EXPECT_EQ(engine_.forward_calls().size() - before, steps) << tokens << " tokens each";
  }
  // A backward reruns its adapter's last forward: it counts that forward's estimate.
  ForwardArgs forward;
  forward.inputs = {Seq(600, 2)};
  Wait(coordinator_->SubmitForward(tenant_, "a", ForwardMode::kForward, forward, false, {}));
  const size_t before = engine_.forward_calls().size();
  coordinator_->scheduler().Pause();
  absl::StatusOr<uint64_t> backward = coordinator_->SubmitBackward(tenant_, "a", {});
  absl::StatusOr<uint64_t> other = coordinator_->SubmitForward(tenant_, "b", ForwardMode::kForwardBackward, forward, false, {});
  coordinator_->scheduler().Resume();
  Wait(backward);
  Wait(other);
  EXPECT_EQ(engine_.forward_calls().size() - before, 2u);  // 600 + 600 KiB: not fused
  engine_.cost = {};
}

// Above the budget, a request whose loss is a sum over its sequences (here forward-only) is
// queued all the same and reaches the engine with the budget as its max_pass_bytes (the
// engine runs it in passes); what must fit is each sequence alone. A Twinkle loss over all
// the sequences together is refused, saying why.
TEST_F(CoordinatorWindowTest, MemoryAdmissionLetsTheEngineRunSumLossesInPasses) {
  coordinator_->Stop();
  CoordinatorOptions options;
  options.activation_memory_bytes = int64_t{1} << 20;
  engine_.cost = ActivationCost{0, 1 << 10, 0};  // 1 KiB per token: 1024 tokens = 1 MiB
  coordinator_ = std::make_unique<TrainingCoordinator>(options, engine_, futures_);
  coordinator_->Start();
  Add("a", 1);
  ForwardArgs two;
  two.inputs = {Seq(600, 2), Seq(600, 2)};  // 1200 KiB: over, each sequence under
  EXPECT_EQ(Wait(coordinator_->SubmitForward(tenant_, "a", ForwardMode::kForwardOnly, two, false, {}))
                .sequences.size(), 2u);
  EXPECT_EQ(engine_.max_pass_bytes().back(), int64_t{1} << 20);
  absl::StatusOr<uint64_t> whole = coordinator_->SubmitForward(tenant_, "a", ForwardMode::kForwardBackward, two, false, {});
  ASSERT_FALSE(whole.ok());
  EXPECT_THAT(whole.status().message(),
              ::testing::HasSubstr("1200 tokens in 2 sequences need an estimated 2 MiB of activation memory, above "
                                   "the 1 MiB a step may use (engine.activation_memory_mib), and the loss set on the "
                                   "adapter is taken over all of a request's sequences together, so the request "
                                   "cannot run in passes"));
  ForwardArgs one;
  one.inputs = {Seq(10, 2), Seq(1025, 2)};  // limit + 1 token
  absl::StatusOr<uint64_t> long_one = coordinator_->SubmitForward(tenant_, "a", ForwardMode::kForwardOnly, one, false, {});
  ASSERT_FALSE(long_one.ok());
  EXPECT_EQ(long_one.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(long_one.status().message(),
              ::testing::HasSubstr("inputs: sequence 1 (1025 tokens) alone needs an estimated 2 MiB of activation "
                                   "memory, above the 1 MiB a step may use (engine.activation_memory_mib)"));
  one.inputs = {Seq(10, 2), Seq(1024, 2)};  // at the limit
  EXPECT_EQ(Wait(coordinator_->SubmitForward(tenant_, "a", ForwardMode::kForwardOnly, one, false, {}))
                .sequences.size(), 2u);
  engine_.cost = {};
}

TEST_F(CoordinatorWindowTest, SessionsAreBoundedPerTenant) {
  TenantContext alice{"alice"};
  alice.max_sessions = 2;
  TenantContext bob{"bob"};
  bob.max_sessions = 2;
  absl::StatusOr<std::string> first = coordinator_->CreateSession(alice);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(coordinator_->CreateSession(alice).ok());
  absl::StatusOr<std::string> third = coordinator_->CreateSession(alice);
  ASSERT_EQ(third.status().code(), absl::StatusCode::kFailedPrecondition) << third.status();
  EXPECT_NE(third.status().message().find("max_sessions"), std::string::npos) << third.status();
  EXPECT_TRUE(coordinator_->CreateSession(bob).ok());
  ASSERT_TRUE(coordinator_->EndSession(alice, *first).ok());
  EXPECT_TRUE(coordinator_->CreateSession(alice).ok());
}

}  // namespace
}  // namespace twinkle::training
