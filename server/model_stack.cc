#include "server/model_stack.h"

#include <algorithm>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "core/engine_client/one_shot.h"
#include "server/app.h"
#include "server/metrics.h"
#include "server/usage_meter.h"

namespace twinkle {
namespace {

// Merged exports run as `twinkle-engine export` processes, never in a device worker.
training::MergedExporter MakeExporter(const Config& c) {
  const std::string binary = c.engine.binary.empty() ? DefaultEngineBinary() : c.engine.binary;
  const absl::Duration timeout = absl::Seconds(c.engine.call_timeout_s);
  return [binary, timeout](const training::MergedExportJob& job,
                           const std::function<bool()>& cancelled) -> absl::StatusOr<training::MergedExportDone> {
    absl::StatusOr<OneShotResult> run = RunToCompletion(
        {binary, "export", "--model-dir", job.model_dir, "--adapter-dir", job.adapter_dir, "--parent", job.parent,
         "--name", job.name},
        timeout, cancelled);
    if (!run.ok()) return run.status();
    const nlohmann::json reply = nlohmann::json::parse(run->stdout_text, nullptr, false);
    if (reply.is_object() && reply.contains("path") && reply["path"].is_string()) {
      return training::MergedExportDone{reply["path"].get<std::string>(), reply.value("bytes", int64_t{0})};
    }
    if (reply.is_object() && reply.contains("code") && reply["code"].is_number_integer()) {
      return absl::Status(static_cast<absl::StatusCode>(reply["code"].get<int>()),
                          reply.value("message", std::string("export failed")));
    }
    return absl::InternalError(absl::StrCat("the export process ended with ", run->how_ended,
                                            " without saying how it went"));
  };
}

training::CoordinatorOptions MakeCoordinatorOptions(const Config& c) {
  training::CoordinatorOptions o;
  o.scheduler.max_tokens_per_step = c.scheduler.max_tokens_per_step;
  o.scheduler.max_ops_per_step = c.scheduler.max_ops_per_step;
  o.scheduler.fuse = c.scheduler.fuse;
  o.scheduler.queue_cap = c.scheduler.queue_cap;
  o.scheduler.max_pending_per_tenant = c.limits.max_pending_ops;
  o.max_loras = c.scheduler.max_loras;
  o.max_adapters = c.limits.max_adapters;  // this model's (ForModel: models[i].max_adapters)
  o.max_lora_rank = c.limits.max_lora_rank;
  o.max_tokens_per_request = c.limits.max_tokens_per_request;
  o.max_context_tokens = c.model.max_context_tokens;
  o.activation_memory_bytes = c.engine.activation_memory_mib * (int64_t{1} << 20);
  o.adapter_timeout = absl::Seconds(c.sessions.adapter_timeout_s);
  o.adapter_max_lifetime = absl::Seconds(c.sessions.adapter_max_lifetime_s);
  o.base_model = c.model.name;
  o.model_dir = c.model.path;
  o.restore_points = c.engine.adapter_restore_points;
  o.exporter = MakeExporter(c);
  return o;
}

const char* StepKindName(sched::OpKind kind) {
  switch (kind) {
    case sched::OpKind::kForward: return "forward";
    case sched::OpKind::kForwardBackward: return "forward_backward";
    default: return "other";
  }
}

bool DedicatedSampler(const Config& c) { return !c.sampler.devices.empty(); }

// The training workers. With a dedicated sampler pool they never sample, so their KV cache is
// a single block (the engine allocates one at load; on a GPU 2048 unused blocks would take
// memory from training).
SupervisorOptions MakeSupervisorOptions(const Config& c, const std::string& node_secret) {
  SupervisorOptions o;
  o.node_listen = c.nodes.listen;  // engines on other nodes (docs/device_pool.md)
  o.node_secret = node_secret;
  o.rendezvous_host = RendezvousHost(c);
  o.rendezvous_port = c.nodes.rendezvous_port;
  o.engine_binary = c.engine.binary.empty() ? DefaultEngineBinary() : c.engine.binary;
  o.devices = c.engine.devices;
  o.model_dir = c.model.path;
  o.dtype = c.model.dtype;
  o.log_level = c.logging.level;
  o.log_format = c.logging.format;
  o.max_lora_rank = c.limits.max_lora_rank;
  o.kv_cache_blocks = DedicatedSampler(c) ? 1 : c.sampler.kv_cache_blocks;
  o.kv_block_size = c.sampler.kv_block_size;
  o.state_slots = DedicatedSampler(c) ? 1 : c.sampler.state_slots;
  o.activation_checkpointing = c.engine.activation_checkpointing;
  o.logit_chunk_rows = c.engine.logit_chunk_rows;
  o.heartbeat_interval = absl::Milliseconds(c.engine.heartbeat_interval_ms);
  o.heartbeat_timeout = absl::Milliseconds(c.engine.heartbeat_timeout_ms);
  o.startup_timeout = absl::Seconds(c.engine.startup_timeout_s);
  o.backoff_initial = absl::Milliseconds(c.engine.restart_backoff_initial_ms);
  o.backoff_max = absl::Milliseconds(c.engine.restart_backoff_max_ms);
  o.call_timeout = absl::Seconds(c.engine.call_timeout_s);
  o.call_timeout_per_mib = absl::Seconds(c.engine.call_timeout_per_mib_s);
  o.test_hooks = c.testing.hooks;
  o.data_parallel = c.engine.devices.size() > 1;  // docs/device_pool.md
  o.collective_timeout = absl::Seconds(c.engine.collective_timeout_s);
  return o;
}

// The dedicated sampler workers (sampler.devices): the same model, binary, dtype, heartbeats
// and restart policy as the training workers, with the sampler's KV cache.
SupervisorOptions MakeSamplerSupervisorOptions(const Config& c) {
  SupervisorOptions o = MakeSupervisorOptions(c, "");
  o.node_listen.clear();  // sampler workers run on this node
  o.pool = "sampler";
  o.devices = c.sampler.devices;
  o.kv_cache_blocks = c.sampler.kv_cache_blocks;
  o.state_slots = c.sampler.state_slots;
  o.data_parallel = false;  // sampler workers are independent
  return o;
}

}  // namespace

ModelStack::ModelStack(Config config, const ModelStackDeps& deps, bool several, size_t index)
    : config_(std::move(config)) {
  const Config& c = config_;
  // Pools keep their old labels with one model; with several each carries the model's name
  // (engine log lines "<pool> engine rank N", the metrics' pool label).
  training_pool_ = several ? c.model.name : "training";
  sampler_pool_ = several ? absl::StrCat(c.model.name, "-sampler") : "sampler";
  SupervisorOptions training = MakeSupervisorOptions(c, deps.node_secret);
  if (several) training.pool = training_pool_;
  supervisor_ = std::make_unique<Supervisor>(std::move(training));
  if (DedicatedSampler(c)) {
    SupervisorOptions sampler = MakeSamplerSupervisorOptions(c);
    sampler.pool = several ? sampler_pool_ : "sampler";
    sampler_supervisor_ = std::make_unique<Supervisor>(std::move(sampler));
  }
  engine_link_ = std::make_unique<DataParallelLink>(*supervisor_, static_cast<int32_t>(c.engine.devices.size()),
                                                    DataParallelOptions{c.engine.rank_token_budget, c.engine.rebalance});
  // One store per model, over the shared data_dir and registry: it records this model as the
  // base model of what it writes (adapter_config.json, run rows).
  checkpoints_ = std::make_unique<training::CheckpointStore>(c.storage.data_dir, *deps.checkpoint_fs, *deps.registry,
                                                             c.model.name, *deps.retention_clock);
  training::CoordinatorOptions coordinator_options = MakeCoordinatorOptions(c);
  coordinator_options.registry = deps.registry;
  coordinator_options.checkpoints = checkpoints_.get();
  if (c.models_listed) {  // its own capacity, under its own key
    coordinator_options.capacity_holder = absl::StrCat("base model '", c.model.name, "'");
    coordinator_options.capacity_key = absl::StrCat("models[", index, "].max_adapters");
  }
  coordinator_ = std::make_unique<training::TrainingCoordinator>(coordinator_options, *engine_link_, *deps.futures);
  Metrics* metrics = deps.metrics;
  UsageMeter* usage = deps.usage;
  coordinator_->scheduler().SetStepListener([metrics, usage, name = c.model.name](const sched::StepStats& step) {
    usage->RecordStep(name, step);
    std::vector<Metrics::StepOp> ops;
    for (size_t i = 0; i < step.waits.size(); ++i) {
      ops.push_back({step.waits[i].first, absl::ToDoubleSeconds(step.waits[i].second),
                     i < step.op_tokens.size() ? step.op_tokens[i] : 0});
    }
    metrics->RecordStep(StepKindName(step.kind), step.ops, step.tokens, absl::ToDoubleSeconds(step.duration), ops);
  });
  sampling::SamplerOptions sampler_options;
  sampler_options.base_model = c.model.name;
  sampler_options.model_dir = c.model.path;
  sampler_options.max_decode_steps_per_call = c.sampler.max_decode_steps_per_call;
  sampler_options.stream_decode_steps_per_call = c.sampler.stream_decode_steps_per_call;
  sampler_options.max_snapshots = c.sampler.max_snapshots;
  sampler_options.max_snapshots_per_tenant = c.sampler.max_snapshots_per_tenant;
  sampler_options.max_sessions_per_tenant = c.sampler.max_sessions_per_tenant;
  sampler_options.session_timeout = absl::Seconds(c.sessions.adapter_timeout_s);
  sampler_options.default_max_tokens = c.sampler.default_max_tokens;
  sampler_options.max_num_samples = c.sampler.max_num_samples;
  sampler_options.registry = deps.registry;  // open sessions outlive a restart
  sampler_options.default_model = index == 0;
  if (index == 0) {
    sampler_options.other_models.assign(deps.model_names.begin() + std::min<size_t>(1, deps.model_names.size()),
                                        deps.model_names.end());
  }
  // Colocated, sampling calls go to the training engine and interleave with its steps;
  // dedicated, they go to the sampler workers. Either way sample requests and snapshots stay
  // scheduler ops of the training coordinator (futures, deadlines, quotas, fair share, and a
  // snapshot sees exactly the weights its adapter's earlier ops left).
  // One lane per engine that samples: each rank of the dedicated pool, else each training
  // rank (its snapshots are its own adapters, created on that rank only).
  std::vector<training::EngineLink*> sampling_engines;
  Supervisor& sampling_pool = sampler_supervisor_ != nullptr ? *sampler_supervisor_ : *supervisor_;
  const size_t sampling_ranks = sampler_supervisor_ != nullptr ? c.sampler.devices.size() : c.engine.devices.size();
  for (int32_t rank = 0; rank < static_cast<int32_t>(sampling_ranks); ++rank) {
    sampler_links_.push_back(std::make_unique<SupervisorEngineLink>(sampling_pool, rank));
    sampling_engines.push_back(sampler_links_.back().get());
  }
  sampler_ = std::make_unique<sampling::SamplerCoordinator>(sampler_options, sampling_engines, *coordinator_,
                                                            checkpoints_.get(), *deps.futures);
  sampler_->SetUsageListener([metrics, usage, name = c.model.name](const sampling::SamplerCoordinator::SampleUsage& u) {
    usage->RecordSample(name, u);
    metrics->RecordSampleTokens(u.tenant, u.prefill_tokens, u.sampled_tokens);
  });
}

ModelStack::~ModelStack() {
  StopWork();
  StopWorkers();
}

bool ModelStack::Serves(const std::string& id) const {
  if (id.empty()) return false;
  if (id == config_.model.name || id == config_.model.path) return true;
  std::error_code ec;
  return id == std::filesystem::absolute(config_.model.path, ec).string();
}

void ModelStack::Start() {
  coordinator_->Start();
  sampler_->Start();
}

void ModelStack::RequestStop() {
  supervisor_->RequestStop();
  if (sampler_supervisor_ != nullptr) sampler_supervisor_->RequestStop();
}

void ModelStack::StopWork() {
  if (work_stopped_) return;
  work_stopped_ = true;
  sampler_->Stop();      // running sampling requests fail with UNAVAILABLE
  coordinator_->Stop();  // queued work fails with UNAVAILABLE; the step in progress finishes
}

void ModelStack::StopWorkers() {
  if (workers_stopped_) return;
  workers_stopped_ = true;
  supervisor_->Stop(absl::Seconds(5));
  if (sampler_supervisor_ != nullptr) sampler_supervisor_->Stop(absl::Seconds(5));
}

}  // namespace twinkle
