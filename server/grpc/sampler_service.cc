#include "server/grpc/sampler_service.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "server/grpc/handler.h"
#include "server/grpc/twinkle_requests.h"

namespace twinkle {
namespace {

namespace v1 = twinkle::v1;

#define TWINKLE_RPC_DEF(Name, Request, Response)                                   \
  grpc::ServerUnaryReactor* SamplerServiceImpl::Name(grpc::CallbackServerContext* context, \
                                                     const v1::Request* request, v1::Response* response)

sampling::SamplingParams ToParams(const v1::SamplingParams& p) {
  sampling::SamplingParams s;
  s.max_tokens = p.max_tokens();
  s.temperature = p.has_temperature() ? p.temperature() : 1.0;
  s.top_p = p.top_p();
  s.top_k = p.top_k();
  s.stop_token_ids.assign(p.stop_token_ids().begin(), p.stop_token_ids().end());
  s.stop_strings.assign(p.stop().begin(), p.stop().end());
  if (p.has_seed()) s.seed = p.seed();
  s.num_samples = p.num_samples();
  s.prompt_logprobs = p.prompt_logprobs();
  s.ignore_eos = p.ignore_eos();
  s.top_logprobs = p.top_logprobs();
  s.prompt_top_logprobs = p.prompt_top_logprobs();
  s.repetition_penalty = p.repetition_penalty() == 0 ? 1.0 : p.repetition_penalty();
  return s;
}

void FillSession(const sampling::SamplingSessionInfo& info, v1::SamplingSession* out) {
  out->set_sampling_session_id(info.id);
  out->set_base_model(info.base_model);
  out->set_model_path(info.model_path);
}

// One TopLogprobs per position; position `skip` (the prompt's first, or none) stays empty.
void FillTop(const sampling::TopLogprobs& top, google::protobuf::RepeatedPtrField<v1::TopLogprobs>* out,
             size_t skip = std::numeric_limits<size_t>::max()) {
  const size_t k = static_cast<size_t>(top.k);
  for (size_t i = 0; i < top.positions(); ++i) {
    v1::TopLogprobs* position = out->Add();
    if (i == skip) continue;
    position->mutable_token_ids()->Add(top.token_ids.begin() + i * k, top.token_ids.begin() + (i + 1) * k);
    position->mutable_logprobs()->Add(top.logprobs.begin() + i * k, top.logprobs.begin() + (i + 1) * k);
  }
}

absl::Status FillSample(const FutureValue& value, v1::SampleResponse* response) {
  const auto* out = std::get_if<sampling::SampleOutput>(&value);
  if (out == nullptr) return absl::InvalidArgumentError("the future is not a sampling request's (use WaitFuture)");
  for (const sampling::PromptOutput& p : out->prompts) {
    v1::PromptResult* r = response->add_results();
    for (const sampling::SampledSequence& s : p.sequences) {
      v1::SampledSequence* seq = r->add_sequences();
      seq->mutable_tokens()->Add(s.tokens.begin(), s.tokens.end());
      seq->mutable_logprobs()->Add(s.logprobs.begin(), s.logprobs.end());
      seq->set_stop_reason(s.stop_reason);
      FillTop(s.top_logprobs, seq->mutable_top_logprobs());
    }
    r->mutable_prompt_logprobs()->Add(p.prompt_logprobs.begin(), p.prompt_logprobs.end());
    FillTop(p.prompt_top_logprobs, r->mutable_prompt_top_logprobs(), /*skip=*/0);
  }
  response->set_done(true);
  return absl::OkStatus();
}

}  // namespace

TWINKLE_RPC_DEF(CreateSamplingSession, CreateSamplingSessionRequest, SamplingSession) {
  return HandleNow(context, state_, "SamplerService/CreateSamplingSession", [&](const tenancy::Tenant& t) -> absl::Status {
    const training::TenantContext tenant = training::ContextOf(t);
    // A checkpoint samples on the model it was trained on; the base model on the one named.
    absl::StatusOr<ModelStack*> stack = request->model_path().empty()
                                            ? state_.models->ForBaseModel(request->base_model())
                                            : &state_.models->ForCheckpoint(t.id, request->model_path());
    if (!stack.ok()) return stack.status();
    sampling::SamplerCoordinator& sampler = (*stack)->sampler();
    absl::StatusOr<std::string> id = sampler.CreateSession(tenant, request->model_path());
    if (!id.ok()) return id.status();
    absl::StatusOr<sampling::SamplingSessionInfo> info = sampler.GetSession(tenant, *id);
    if (!info.ok()) return info.status();
    FillSession(*info, response);
    return absl::OkStatus();
  });
}

TWINKLE_RPC_DEF(SnapshotAdapter, SnapshotAdapterRequest, SamplingSession) {
  auto tenant = std::make_shared<training::TenantContext>();
  return HandleQueuedAny(
      context, state_, "SamplerService/SnapshotAdapter", false,
      [&](const tenancy::Tenant& t) {
        *tenant = training::ContextOf(t);
        // On the adapter's model (the default one answers NotFound for an unknown adapter).
        ModelStack* stack = state_.models->OfAdapter(t.id, request->adapter_name());
        return (stack != nullptr ? stack : &state_.models->primary())
            ->sampler()
            .SubmitSnapshotSession(*tenant, request->adapter_name(), ToSubmitOptions(context, request->options(), request));
      },
      [](uint64_t) {},
      [this, tenant, response](const FutureValue& value) -> absl::Status {
        const auto* snapshot = std::get_if<sampling::SnapshotSession>(&value);
        if (snapshot == nullptr) return absl::InternalError("snapshot: unexpected result type");
        absl::StatusOr<sampling::SamplingSessionInfo> info =
            state_.models->SamplerFor(tenant->id, snapshot->sampling_session_id)
                .GetSession(*tenant, snapshot->sampling_session_id);
        if (!info.ok()) return info.status();
        FillSession(*info, response);
        response->set_model_path("");
        return absl::OkStatus();
      });
}

TWINKLE_RPC_DEF(GetSamplingSession, SamplingSessionRequest, SamplingSession) {
  return HandleNow(context, state_, "SamplerService/GetSamplingSession", [&](const tenancy::Tenant& t) -> absl::Status {
    absl::StatusOr<sampling::SamplingSessionInfo> info =
        state_.models->SamplerFor(t.id, request->sampling_session_id())
            .GetSession(training::ContextOf(t), request->sampling_session_id());
    if (!info.ok()) return info.status();
    FillSession(*info, response);
    return absl::OkStatus();
  });
}

TWINKLE_RPC_DEF(CloseSamplingSession, SamplingSessionRequest, Empty) {
  return HandleNow(context, state_, "SamplerService/CloseSamplingSession", [&](const tenancy::Tenant& t) {
    return state_.models->SamplerFor(t.id, request->sampling_session_id())
        .CloseSession(training::ContextOf(t), request->sampling_session_id());
  });
}

TWINKLE_RPC_DEF(Sample, SampleRequest, SampleResponse) {
  return HandleQueuedAny(
      context, state_, "SamplerService/Sample", request->options().return_future(),
      [&](const tenancy::Tenant& t) {
        std::vector<std::vector<int64_t>> prompts;
        for (const v1::Prompt& p : request->prompts()) prompts.emplace_back(p.tokens().begin(), p.tokens().end());
        const sampling::SamplingParams params = ToParams(request->params());
        // Charged to the tenant's token rate like training.
        sampling::SamplerCoordinator& sampler = state_.models->SamplerFor(t.id, request->sampling_session_id());
        const int64_t tokens = sampler.TokensOf(prompts, params);
        if (absl::Status s = state_.rate_limiter->Acquire(t, tokens); !s.ok()) return absl::StatusOr<uint64_t>(s);
        absl::StatusOr<uint64_t> id = sampler.SubmitSample(training::ContextOf(t), request->sampling_session_id(),
                                                           std::move(prompts), params,
                                                           ToSubmitOptions(context, request->options(), request));
        if (!id.ok()) state_.rate_limiter->Refund(t, tokens);
        return id;
      },
      [response](uint64_t id) { response->set_future_id(id); },
      [response](const FutureValue& value) { return FillSample(value, response); });
}

TWINKLE_RPC_DEF(WaitSample, WaitFutureRequest, SampleResponse) {
  return HandleWait(
      context, state_, "SamplerService/WaitSample", request->future_id(), WaitTimeout(*context, *request),
      [response](const FutureValue& value) { return FillSample(value, response); },
      [response] { response->set_done(false); });
}

}  // namespace twinkle
