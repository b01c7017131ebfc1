// TinkerApi: construction and the training calls — create_model / unload_model (and a
// model created through load_weights), forward_backward, optim_step, save_weights,
// load_weights, get_info and weights_info — with the helpers that turn their arguments into
// coordinator calls and their results into Tinker's answers. The request-id / future
// machinery and seq_id ordering they submit through are in tinker_futures.cc, the REST
// listings in tinker_runs.cc, client configuration in tinker_rest.cc, sessions in
// tinker_sessions.cc, sampling in tinker_sampling.cc. Requests arrive decoded and checked
// for their wire form (tinker_requests.h); the values are checked here.
#include "server/tinker/tinker_api.h"

#include <cmath>
#include <filesystem>
#include <cstring>
#include <map>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/log.h"
#include "core/storage/names.h"
#include "server/tinker/stored_result.h"
#include "server/tinker/tinker_internal.h"
#include "server/tinker/tinker_json.h"

namespace twinkle::tinker {

using training::OpOutput;

namespace {

// PEFT target modules for Tinker's three switches.
absl::StatusOr<std::vector<std::string>> Targets(bool attn, bool mlp, bool unembed) {
  std::vector<std::string> t;
  if (attn && mlp) {
    t.push_back("all-linear");
  } else if (attn) {
    t = {"q_proj", "k_proj", "v_proj", "o_proj"};
  } else if (mlp) {
    t = {"gate_proj", "up_proj", "down_proj"};
  }
  if (unembed) t.push_back("lm_head");
  if (t.empty()) {
    return absl::InvalidArgumentError(
        "lora_config: train_attn, train_mlp and train_unembed are all false (nothing to train)");
  }
  return t;
}

Switches SwitchesOf(const std::vector<std::string>& targets) {
  Switches s;
  for (const std::string& t : targets) {
    if (t == "all-linear") s.attn = s.mlp = true;
    if (t == "q_proj" || t == "k_proj" || t == "v_proj" || t == "o_proj") s.attn = true;
    if (t == "gate_proj" || t == "up_proj" || t == "down_proj") s.mlp = true;
    if (t == "lm_head") s.unembed = true;
  }
  return s;
}

const std::vector<std::string>& TinkerLosses() {
  static const auto* names =
      new std::vector<std::string>{"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo",
                                   "stable_reinforce"};
  return *names;
}


// The forward_backward result: one ArrayRecord for all datums (logprobs and the per-token
// loss as float32 BatchedTensors) and the metrics, as protobuf and as ≤0.24 JSON.
// `width` > 0: every datum had [N, width] soft targets, so its outputs are [N, width] too
// (BatchedTensor.trailing_shape).
Outcome EncodeForwardBackward(const OpOutput& out, int64_t width) {
  Outcome o;
  v1::ForwardBackwardOutput proto;
  proto.set_loss_fn_output_type("ArrayRecord");
  v1::ArrayRecord* record = proto.add_loss_fn_outputs();
  record->set_type_tag("ArrayRecord");
  record->set_num_datums(static_cast<int64_t>(out.sequences.size()));
  Json outputs = Json::array();
  for (const char* field : {"logprobs", "elementwise_loss"}) {
    const bool lp = std::strcmp(field, "logprobs") == 0;
    if (!lp && std::none_of(out.sequences.begin(), out.sequences.end(),
                            [](const training::SequenceResult& s) { return !s.loss.empty(); })) {
      continue;
    }
    v1::BatchedTensor& t = (*record->mutable_fields())[field];
    t.set_dtype(v1::DTYPE_FLOAT32);
    std::string data, offsets;
    int64_t offset = 0;
    offsets.append(reinterpret_cast<const char*>(&offset), sizeof(offset));
    for (const training::SequenceResult& s : out.sequences) {
      std::vector<float> values = lp ? s.logps : s.loss;
      if (!lp && values.size() != s.logps.size()) values.assign(s.logps.size(), 0.f);
      data.append(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
      offset = static_cast<int64_t>(data.size());
      offsets.append(reinterpret_cast<const char*>(&offset), sizeof(offset));
    }
    t.set_data(std::move(data));
    t.set_offsets(std::move(offsets));
    if (width > 0) t.add_trailing_shape(width);
  }
  auto shape_of = [width](size_t size) {
    return width > 0 ? Json{size / static_cast<size_t>(width), width} : Json{size};
  };
  for (const training::SequenceResult& s : out.sequences) {
    Json d;
    d["logprobs"] = {{"data", FiniteOrNull(s.logps)}, {"dtype", "float32"}, {"shape", shape_of(s.logps.size())}};
    if (!s.loss.empty()) {
      d["elementwise_loss"] = {{"data", FiniteOrNull(s.loss)}, {"dtype", "float32"}, {"shape", shape_of(s.loss.size())}};
    }
    outputs.push_back(std::move(d));
  }
  Json metrics = Json::object();
  // The SDK merges chunks by "name:reduction" keys: exactly one colon.
  for (const auto& [key, value] : out.metrics) {
    if (std::count(key.begin(), key.end(), ':') != 1 || !std::isfinite(value)) continue;
    (*proto.mutable_metrics())[key] = value;
    metrics[key] = value;
  }
  if (!metrics.contains("loss:sum") && std::isfinite(out.loss)) {
    (*proto.mutable_metrics())["loss:sum"] = out.loss;
    metrics["loss:sum"] = out.loss;
  }
  o.json = {{"loss_fn_output_type", "ArrayRecord"}, {"loss_fn_outputs", std::move(outputs)}, {"metrics", metrics}};
  o.proto = StoredProto(std::move(proto));
  return o;
}

}  // namespace

// ---- state -----------------------------------------------------------------------------------

TinkerApi::TinkerApi(TinkerOptions options, ModelSet& models, FutureStore& futures, registry::Registry* registry,
                     training::CheckpointStore* checkpoints, tenancy::TokenRateLimiter* rate_limiter)
    : options_(std::move(options)),
      served_(models),
      futures_(futures),
      registry_(registry),
      checkpoints_(checkpoints),
      rate_limiter_(rate_limiter),
      blocking_(std::make_unique<Worker>()),
      timers_(std::make_unique<Worker>()) {
  timers_->After(absl::Seconds(60), [this] { Housekeep(); });
}

TinkerApi::~TinkerApi() {
  // Workers first: their jobs touch the maps.
  timers_.reset();
  blocking_.reset();
}

absl::StatusOr<std::shared_ptr<TinkerApi::Model>> TinkerApi::FindModel(const tenancy::Tenant& tenant,
                                                                       const std::string& model_id) {
  absl::MutexLock lock(&mu_);
  auto it = models_.find(ModelKey(tenant.id, model_id));
  if (it == models_.end() || it->second->tenant != tenant.id) {
    return absl::NotFoundError(absl::StrCat("model_id: no model '", model_id, "'"));
  }
  return it->second;
}

absl::StatusOr<TinkerApi::ModelCall> TinkerApi::ModelCallOf(const tenancy::Tenant& tenant,
                                                            const std::string& model_id, int64_t seq_id,
                                                            const std::string& path, bool path_required) {
  absl::StatusOr<std::shared_ptr<Model>> model = FindModel(tenant, model_id);
  if (!model.ok()) return model.status();
  if (path_required || !path.empty()) {
    if (absl::Status s = storage::ValidatePathName(path, "path"); !s.ok()) return s;
  }
  return ModelCall{model_id, seq_id, *std::move(model), path};
}

// ---- create / unload ------------------------------------------------------------------------

absl::StatusOr<FuturePromise> TinkerApi::CreateModel(const tenancy::Tenant& tenant, const CreateModelRequest& r) {
  // The base model the model is created on (InvalidArgument naming the served ones).
  absl::StatusOr<ModelStack*> stack = served_.ForBaseModel(r.base_model);
  if (!stack.ok()) return stack.status();
  const LoraConfig& lora = r.lora_config;
  if (lora.rank <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("lora_config.rank: ", lora.rank, " must be positive"));
  }
  if (lora.rank > options_.max_lora_rank) {
    return absl::InvalidArgumentError(absl::StrCat("lora_config.rank: ", lora.rank, " above the server's limit of ",
                                                   options_.max_lora_rank));
  }
  if (lora.rank > tenant.quotas.max_lora_rank) {
    return absl::PermissionDeniedError(absl::StrCat("lora_config.rank: ", lora.rank, " above your quota of ",
                                                    tenant.quotas.max_lora_rank));
  }
  absl::StatusOr<std::vector<std::string>> targets = Targets(lora.train_attn, lora.train_mlp, lora.train_unembed);
  if (!targets.ok()) return targets.status();
  // user_metadata: kept with the run and returned by the REST run listings (the cookbook
  // checks its renderer there on resume).
  absl::StatusOr<std::string> metadata = StoredMetadata(r.user_metadata);
  if (!metadata.ok()) return metadata.status();
  ModelSpec spec{*stack,         r.session_id,  r.model_seq_id,    lora.rank, lora.seed,
                 lora.train_attn, lora.train_mlp, lora.train_unembed, *targets};
  return StartModel(tenant, std::move(spec), [this, metadata = *metadata, tenant_id = tenant.id](
                                                 const std::shared_ptr<Model>& model, const std::shared_ptr<Entry>& entry) {
    if (!metadata.empty() && registry_ != nullptr) {
      if (absl::Status s = registry_->SetRunUserMetadata(tenant_id, RunIdOf(model->model_id), metadata); !s.ok()) {
        Complete(entry, Outcome::Failed(s));
        return;
      }
    }
    Complete(entry, Outcome::Of(OpResult::OfModel("create_model", model->model_id)));
  });
}

absl::StatusOr<FuturePromise> TinkerApi::StartModel(const tenancy::Tenant& tenant, ModelSpec spec, ModelThen then) {
  // A model lives in one of the caller's sessions: without one (or in another tenant's) its
  // id would be shared with other tenants' models.
  if (spec.session.empty()) {
    return absl::InvalidArgumentError("session_id: empty; create a session first (create_session)");
  }
  if (absl::Status s = served_.Heartbeat(ContextOf(tenant), spec.session); !s.ok()) {
    // NotFound names the field; anything else (max_sessions while an earlier run's session
    // resumes) is passed on as it is.
    if (!absl::IsNotFound(s)) return s;
    return absl::NotFoundError(absl::StrCat("session_id: no session '", spec.session, "'"));
  }
  const std::string key = absl::StrCat("create_model\n", tenant.id, "\n", spec.session, "\n", spec.model_seq);
  const std::string model_id = ModelIdFor(spec.session, spec.model_seq);
  std::shared_ptr<Entry> entry;
  {
    absl::MutexLock lock(&mu_);
    auto d = dedupe_.find(key);
    if (d != dedupe_.end()) {
      auto e = entries_.find(d->second);
      if (e != entries_.end()) return Promise(*e->second);
    }
  }
  // A lasting limit: 403 at once (the SDK does not retry it), not a failed future. The
  // tenant's quota counts its models on every base model; the server's room is per model
  // (the coordinator's max_adapters, models[i].max_adapters).
  size_t live = 0;
  for (ModelStack* s : served_.stacks()) live += s->coordinator().ListRuns(ContextOf(tenant)).size();
  if (live >= static_cast<size_t>(tenant.quotas.max_adapters)) {
    return absl::PermissionDeniedError(absl::StrCat("you have ", live, " models, your quota (max_adapters) is ",
                                                    tenant.quotas.max_adapters, "; unload one first"));
  }
  entry = NewEntry(tenant.id, model_id);
  {
    absl::MutexLock lock(&mu_);
    dedupe_[key] = entry->request_id;
  }
  training::AddAdapterArgs args;
  args.name = AdapterNameFor(spec.session, spec.model_seq);
  args.session_id = spec.session;
  args.lora.rank = spec.rank;
  args.lora.alpha = training::kDefaultLoraAlpha;
  args.lora.use_rslora = false;
  args.lora.targets = spec.targets;
  args.lora.seed = spec.seed;
  const training::TenantContext context = ContextOf(tenant);
  // AddAdapter waits for the engine: not on a transport thread.
  blocking_->Post([this, entry, args, context, spec, key, model_id, then = std::move(then)] {
    absl::StatusOr<training::AddAdapterResult> r = spec.stack->coordinator().AddAdapter(context, args);
    if (!r.ok()) {
      LogInfo(kLog, absl::StrCat("tenant ", context.id, ": create_model failed: ", r.status().message()));
      {
        absl::MutexLock lock(&mu_);
        dedupe_.erase(key);
      }
      Complete(entry, Outcome::Failed(r.status()));
      return;
    }
    auto model = std::make_shared<Model>();
    model->model_id = model_id;
    model->run_id = r->run_id;
    model->tenant = context.id;
    model->adapter = r->name;
    model->session_id = args.session_id;
    model->stack = spec.stack;
    model->base_model = spec.stack->name();
    model->rank = args.lora.rank;
    model->seed = args.lora.seed;
    model->switches = Switches{spec.attn, spec.mlp, spec.unembed};
    {
      absl::MutexLock lock(&mu_);
      models_[ModelKey(model->tenant, model->model_id)] = model;
    }
    then(model, entry);
  });
  return Promise(*entry);
}

// The SDK's create_training_client_from_state: one load_weights with session_id and
// model_seq_id instead of a model_id. The model takes the checkpoint's LoRA shape; the load
// is its first op (seq_id 0), so its later ops start at 1 as after create_model.
absl::StatusOr<FuturePromise> TinkerApi::CreateViaLoad(const tenancy::Tenant& tenant, const LoadWeightsRequest& r) {
  absl::StatusOr<WeightsInfoResult> info = WeightsInfo(tenant, WeightsInfoRequest{r.path});
  if (!info.ok()) return info.status();
  absl::StatusOr<std::vector<std::string>> targets = Targets(info->train_attn, info->train_mlp, info->train_unembed);
  if (!targets.ok()) return targets.status();
  // The model the checkpoint was trained on (its run's base model), else the default one.
  ModelSpec spec{&served_.ForCheckpoint(tenant.id, InternalPath(r.path)),
                 r.session_id,    r.model_seq_id,  info->lora_rank,     0,
                 info->train_attn, info->train_mlp, info->train_unembed, *targets};
  const training::TenantContext context = ContextOf(tenant);
  return StartModel(tenant, std::move(spec),
                    [this, context, tinker_path = r.path, optimizer = r.optimizer](const std::shared_ptr<Model>& model,
                                                                                  const std::shared_ptr<Entry>& entry) {
                      absl::StatusOr<uint64_t> id = model->stack->coordinator().SubmitLoad(
                          context, model->adapter, InternalPath(tinker_path),
                          optimizer ? training::LoadMode::kWeightsAndOptimizer
                                    : training::LoadMode::kWeightsFreshOptimizer);
                      if (!id.ok()) return Complete(entry, Outcome::Failed(id.status()));
                      Attach(entry, *id, [tinker_path, model_id = model->model_id](const FutureValue&) {
                        return Outcome::Of(OpResult::OfLoad(model_id, tinker_path));
                      });
                    });
}

absl::StatusOr<FuturePromise> TinkerApi::UnloadModel(const tenancy::Tenant& tenant, const ModelRequest& r) {
  absl::StatusOr<std::shared_ptr<Model>> model = FindModel(tenant, r.model_id);
  if (!model.ok()) return model.status();
  std::shared_ptr<Entry> entry = NewEntry(tenant.id, r.model_id);
  const training::TenantContext context = ContextOf(tenant);
  blocking_->Post([this, entry, context, m = *model] {
    absl::Status s = m->stack->coordinator().RemoveAdapter(context, m->adapter);
    {
      absl::MutexLock lock(&mu_);
      models_.erase(ModelKey(m->tenant, m->model_id));
    }
    Complete(entry, s.ok() ? Outcome::Of(OpResult::OfModel("unload_model", m->model_id))
                           : Outcome::Failed(s));
  });
  return Promise(*entry);
}

// ---- forward_backward ------------------------------------------------------------------------

absl::StatusOr<FuturePromise> TinkerApi::ForwardBackwardArgs(const tenancy::Tenant& tenant, const std::string& model_id,
                                                    int64_t seq_id, training::ForwardArgs args, bool forward_only,
                                                    uint64_t fingerprint, absl::Status bad_input) {
  absl::StatusOr<std::shared_ptr<Model>> model = FindModel(tenant, model_id);
  if (!model.ok()) return model.status();
  const training::TenantContext context = ContextOf(tenant);
  // A bad loss name or config fails the future (category user), like any bad input that is
  // found once the op is queued.
  absl::Status bad = std::move(bad_input);
  if (std::find(TinkerLosses().begin(), TinkerLosses().end(), args.loss->name) == TinkerLosses().end()) {
    bad = absl::InvalidArgumentError(absl::StrCat("loss_fn: unknown loss '", args.loss->name, "' (supported: ",
                                                  absl::StrJoin(TinkerLosses(), ", "), ")"));
  }
  int64_t tokens = 0;
  for (const training::TokenDatum& d : args.datums) tokens += static_cast<int64_t>(d.input_tokens.size());
  // Soft targets: the outputs' trailing width when all datums share one (else flat).
  int64_t width = args.datums.empty() ? 0 : args.datums[0].target_width;
  for (const training::TokenDatum& d : args.datums) {
    if (d.target_width != width) width = 0;
  }
  auto shared_args = std::make_shared<training::ForwardArgs>(std::move(args));
  // Its tokens are charged to the tenant's rate by Sequenced, before it is queued or buffered.
  Submit submit = [context, stack = (*model)->stack, adapter = (*model)->adapter, shared_args, forward_only, bad,
                   seq_id, fingerprint]() -> absl::StatusOr<uint64_t> {
    if (!bad.ok()) return bad;
    training::SubmitOptions options;
    options.idempotency_key = seq_id > 0 ? absl::StrCat("tinker-seq-", seq_id) : "";
    options.fingerprint = fingerprint;
    absl::StatusOr<uint64_t> id = stack->coordinator().SubmitForward(
        context, adapter,
        forward_only ? training::ForwardMode::kForward : training::ForwardMode::kForwardBackward, *shared_args,
        false, options);
    return id;
  };
  Encoder encode = [width](const FutureValue& value) {
    absl::StatusOr<const OpOutput*> out = ValueAs<OpOutput>(value, "forward_backward result");
    return out.ok() ? EncodeForwardBackward(**out, width) : Outcome::Failed(out.status());
  };
  return Sequenced(tenant, *model, seq_id, {forward_only ? "forward" : "forward_backward", fingerprint, tokens},
                   std::move(submit), std::move(encode));
}

absl::StatusOr<FuturePromise> TinkerApi::ForwardBackward(const tenancy::Tenant& tenant,
                                                         const v1::ForwardBackwardRequest& r) {
  training::ForwardArgs args;
  absl::StatusOr<training::LossOverride> loss = LossFromProto(r);
  if (!loss.ok()) return loss.status();
  args.loss = *std::move(loss);
  absl::Status bad;
  for (int i = 0; i < r.data_size(); ++i) {
    absl::StatusOr<training::TokenDatum> d = DatumFromProto(r.data(i), absl::StrCat("data[", i, "]"));
    if (!d.ok()) return d.status();
    // StableReinforce takes its sampler log-probs from the recorded sequences the datum's
    // provenance names (docs/losses.md); other losses ignore provenance.
    // An unresolvable provenance fails the op's future (its seq_id is used), like a bad loss.
    if (args.loss->name == "stable_reinforce" && bad.ok()) {
      bad = stability_->Resolve(tenant.id, r.data(i), absl::StrCat("data[", i, "]"), *d, absl::Now());
    }
    args.datums.push_back(*std::move(d));
  }
  if (args.datums.empty()) return absl::InvalidArgumentError("data: empty batch (no datums)");
  return ForwardBackwardArgs(tenant, r.model_id(), r.seq_id(), std::move(args), r.forward_only(), FingerprintOf(r),
                             bad);
}

absl::StatusOr<FuturePromise> TinkerApi::ForwardBackwardJson(const tenancy::Tenant& tenant, const Json& body,
                                                    bool forward_only) {
  const char* input_key = body.contains("forward_backward_input") ? "forward_backward_input" : "forward_input";
  if (!body.contains(input_key) || !body[input_key].is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(input_key, ": missing"));
  }
  const Json& input = body[input_key];
  absl::StatusOr<std::string> model_id = GetString(body, "model_id");
  if (!model_id.ok()) return model_id.status();
  absl::StatusOr<int64_t> seq = GetInt(body, "seq_id", 0);
  if (!seq.ok()) return seq.status();
  training::ForwardArgs args;
  absl::StatusOr<training::LossOverride> loss = LossFromJson(input);
  if (!loss.ok()) return loss.status();
  args.loss = *std::move(loss);
  if (!input.contains("data") || !input["data"].is_array()) return absl::InvalidArgumentError("data: missing");
  for (size_t i = 0; i < input["data"].size(); ++i) {
    absl::StatusOr<training::TokenDatum> d = DatumFromJson(input["data"][i], absl::StrCat("data[", i, "]"));
    if (!d.ok()) return d.status();
    args.datums.push_back(*std::move(d));
  }
  if (args.datums.empty()) return absl::InvalidArgumentError("data: empty batch (no datums)");
  const bool fwd_only = forward_only || GetBool(body, "forward_only", false).value_or(false) ||
                        GetBool(input, "forward_only", false).value_or(false);
  absl::Status bad;
  if (args.loss->name == "stable_reinforce") {
    bad = absl::InvalidArgumentError(
        "loss_fn: stable_reinforce needs datums with provenance, which only the protobuf forward_backward of "
        "newer SDKs carries");
  }
  return ForwardBackwardArgs(tenant, *model_id, *seq, std::move(args), fwd_only, FingerprintOf(body.dump()), bad);
}

// ---- optim_step, save, load -----------------------------------------------------------------

absl::StatusOr<FuturePromise> TinkerApi::OptimStep(const tenancy::Tenant& tenant, const OptimStepRequest& r) {
  absl::StatusOr<std::shared_ptr<Model>> model = FindModel(tenant, r.model_id);
  if (!model.ok()) return model.status();
  const AdamParams& a = r.adam_params;
  const std::map<std::string, double> hyper = {{"learning_rate", a.learning_rate}, {"beta1", a.beta1},
                                               {"beta2", a.beta2},                 {"eps", a.eps},
                                               {"weight_decay", a.weight_decay},   {"grad_clip_norm", a.grad_clip_norm}};
  for (const auto& [key, value] : hyper) {
    if (!std::isfinite(value)) return absl::InvalidArgumentError(absl::StrCat(key, ": not finite"));
  }
  const training::TenantContext context = ContextOf(tenant);
  const uint64_t fingerprint = FingerprintOf(Json(hyper).dump());
  Submit submit = [context, stack = (*model)->stack, adapter = (*model)->adapter, hyper, seq = r.seq_id,
                   fingerprint]() {
    training::SubmitOptions options;
    options.idempotency_key = seq > 0 ? absl::StrCat("tinker-seq-", seq) : "";
    options.fingerprint = fingerprint;
    return stack->coordinator().SubmitOptimStep(context, adapter, hyper, options);
  };
  Encoder encode = [](const FutureValue& value) {
    absl::StatusOr<const OpOutput*> out = ValueAs<OpOutput>(value, "optim_step result");
    if (!out.ok()) return Outcome::Failed(out.status());
    std::map<std::string, double> metrics;
    for (const auto& [k, v] : (*out)->metrics) {
      if (std::isfinite(v)) metrics[k] = v;
    }
    return Outcome::Of(OpResult::OfMetrics("optim_step", std::move(metrics)));
  };
  return Sequenced(tenant, *model, r.seq_id, {"optim_step", fingerprint}, std::move(submit), std::move(encode));
}

absl::StatusOr<FuturePromise> TinkerApi::SaveWeights(const tenancy::Tenant& tenant, const SaveWeightsRequest& r) {
  absl::StatusOr<ModelCall> call = ModelCallOf(tenant, r.model_id, r.seq_id, r.path);
  if (!call.ok()) return call.status();
  const training::TenantContext context = ContextOf(tenant);
  const std::string run_id = call->model->run_id;
  Submit submit = [this, context, stack = call->model->stack, adapter = call->model->adapter, name = call->name,
                   overwrite = r.overwrite, run_id, ttl = r.ttl_seconds]() -> absl::StatusOr<uint64_t> {
    if (!overwrite && registry_ != nullptr &&
        registry_->GetCheckpoint(context.id, run_id, absl::StrCat("weights/", name)).ok()) {
      return absl::AlreadyExistsError(absl::StrCat("path: checkpoint weights/", name, " of ", run_id,
                                                   " exists (save_state(..., overwrite=True) replaces it)"));
    }
    training::SaveArgs args;
    args.name = name;
    args.save_optimizer = true;
    args.ttl_seconds = ttl;
    return stack->coordinator().SubmitSave(context, adapter, args);
  };
  Encoder encode = [model_id = call->model_id, name = call->name](const FutureValue&) {
    return Outcome::Of(OpResult::OfPath("save_weights", absl::StrCat("tinker://", model_id, "/weights/", name)));
  };
  return Sequenced(tenant, call->model, call->seq,
                   {"save_weights", FingerprintOf(absl::StrCat(call->name, "\n", r.overwrite))}, std::move(submit),
                   std::move(encode));
}

absl::StatusOr<FuturePromise> TinkerApi::LoadWeights(const tenancy::Tenant& tenant, const LoadWeightsRequest& r) {
  if (!r.model_id) return CreateViaLoad(tenant, r);
  absl::StatusOr<std::shared_ptr<Model>> model = FindModel(tenant, *r.model_id);
  if (!model.ok()) return model.status();
  const training::TenantContext context = ContextOf(tenant);
  Submit submit = [context, stack = (*model)->stack, adapter = (*model)->adapter, path = InternalPath(r.path),
                   optimizer = r.optimizer]() {
    return stack->coordinator().SubmitLoad(context, adapter, path,
                                           optimizer ? training::LoadMode::kWeightsAndOptimizer
                                                     : training::LoadMode::kWeightsFreshOptimizer);
  };
  Encoder encode = [path = r.path, model_id = *r.model_id](const FutureValue&) {
    return Outcome::Of(OpResult::OfLoad(model_id, path));
  };
  return Sequenced(tenant, *model, r.seq_id, {"load_weights", FingerprintOf(absl::StrCat(r.path, "\n", r.optimizer))},
                   std::move(submit), std::move(encode));
}

// ---- direct training calls ------------------------------------------------------------------

absl::StatusOr<GetInfoResult> TinkerApi::GetInfo(const tenancy::Tenant& tenant, const ModelRequest& r) {
  absl::StatusOr<std::shared_ptr<Model>> model = FindModel(tenant, r.model_id);
  if (!model.ok()) return model.status();
  if (absl::StatusOr<training::RunInfo> run = (*model)->stack->coordinator().GetRun(ContextOf(tenant), (*model)->run_id);
      !run.ok()) {
    return absl::NotFoundError(absl::StrCat("model_id: model '", r.model_id, "' is no longer loaded"));
  }
  const Model& m = **model;
  GetInfoResult info;
  info.model_id = m.model_id;
  const std::optional<ModelInfo> loaded = m.stack->supervisor().model_info();
  info.model_data = {loaded ? loaded->architecture : "", m.base_model,
                     std::filesystem::absolute(m.stack->model_dir()).string()};
  info.lora_rank = m.rank;
  info.model_name = m.base_model;
  return info;
}

absl::StatusOr<WeightsInfoResult> TinkerApi::WeightsInfo(const tenancy::Tenant& tenant, const WeightsInfoRequest& r) {
  if (checkpoints_ == nullptr || registry_ == nullptr) return NoCheckpoints();
  const std::string internal = InternalPath(r.tinker_path);
  absl::StatusOr<training::CheckpointPath> parsed = training::ParseCheckpointPath(internal, "tinker_path");
  if (!parsed.ok()) return parsed.status();
  absl::StatusOr<registry::CheckpointRecord> record = checkpoints_->Resolve(tenant.id, internal, "");
  if (!record.ok()) return record.status();
  // The run's owner: a published checkpoint of another tenant is readable too.
  absl::StatusOr<registry::RunRecord> run = registry_->GetRun(record->tenant, record->run_id);
  if (!run.ok()) return run.status();
  Json lora = Json::parse(run->lora_config_json, nullptr, false);
  std::vector<std::string> targets;
  WeightsInfoResult info;
  info.base_model = run->base_model;
  if (lora.is_object()) {
    if (lora.contains("target_modules") && lora["target_modules"].is_array()) {
      for (const Json& t : lora["target_modules"]) {
        if (t.is_string()) targets.push_back(t.get<std::string>());
      }
    }
    if (lora.contains("r") && lora["r"].is_number_integer()) info.lora_rank = lora["r"].get<int64_t>();
  }
  const Switches s = SwitchesOf(targets);
  info.train_unembed = s.unembed;
  info.train_mlp = s.mlp;
  info.train_attn = s.attn;
  return info;
}

}  // namespace twinkle::tinker
