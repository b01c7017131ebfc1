#include "server/grpc/utility_service.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

#include "server/grpc/handler.h"
#include "twinkle_version.h"

namespace twinkle {

grpc::ServerUnaryReactor* UtilityServiceImpl::GetServerInfo(
    grpc::CallbackServerContext* context, const twinkle::v1::GetServerInfoRequest* request,
    twinkle::v1::ServerInfo* response) {
  return HandleNow(context, state_, "UtilityService/GetServerInfo", [&](const tenancy::Tenant&) -> absl::Status {
    absl::StatusOr<ModelStack*> named = state_.models->ForBaseModel(request->base_model());
    if (!named.ok()) return named.status();
    const ModelStack& stack = **named;
    const Config& config = stack.config();  // the named model's (ForModel)
    response->set_server_version(kTwinkleVersion);
    response->set_base_model_id(config.model.name);
    response->set_base_model_name(std::filesystem::path(config.model.path).filename().string());
    response->set_dtype(config.model.dtype);
    response->set_max_lora_rank(config.limits.max_lora_rank);
    auto* limits = response->mutable_limits();
    limits->set_max_adapters(config.limits.max_adapters);
    limits->set_max_lora_rank(config.limits.max_lora_rank);
    limits->set_max_tokens_per_request(config.limits.max_tokens_per_request);
    if (std::optional<ModelInfo> info = stack.supervisor().model_info()) {
      response->set_architecture(info->architecture);
      response->set_parameter_count(info->parameter_count);
      for (const std::string& loss : info->supported_losses) response->add_supported_loss_names(loss);
    }
    // Pools keep the names "training" and "sampler"; `model` says whose workers they are.
    auto add_devices = [&](const Supervisor& supervisor, const char* pool, const std::string& model) {
      for (const WorkerSnapshot& w : supervisor.Snapshot()) {
        auto* device = response->add_devices();
        device->set_rank(w.rank);
        device->set_device(w.device);
        device->set_ready(w.ready);
        device->set_restarts(w.restarts);
        device->set_pool(pool);
        device->set_model(model);
      }
    };
    for (const ModelStack* m : state_.models->stacks()) {
      add_devices(m->supervisor(), "training", m->name());
      if (m->sampler_supervisor() != nullptr) add_devices(*m->sampler_supervisor(), "sampler", m->name());
      twinkle::v1::ModelSummary* summary = response->add_models();
      summary->set_name(m->name());
      summary->set_directory(std::filesystem::path(m->model_dir()).filename().string());
      if (std::optional<ModelInfo> info = m->supervisor().model_info()) summary->set_architecture(info->architecture);
      summary->set_dtype(m->config().model.dtype);
      summary->set_max_adapters(m->config().limits.max_adapters);
      summary->set_used_adapters(m->coordinator().adapter_count());
      summary->set_serving(!state_.draining.load() && m->AllReady());
    }
    response->set_serving(state_.Serving());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* UtilityServiceImpl::GetCapacity(grpc::CallbackServerContext* context,
                                                          const twinkle::v1::GetCapacityRequest* request,
                                                          twinkle::v1::Capacity* response) {
  return HandleNow(context, state_, "UtilityService/GetCapacity", [&](const tenancy::Tenant& tenant) -> absl::Status {
    absl::StatusOr<ModelStack*> named = state_.models->ForBaseModel(request->base_model());
    if (!named.ok()) return named.status();
    ModelStack& stack = **named;
    response->set_base_model(stack.name());
    if (state_.checkpoints != nullptr) {
      absl::StatusOr<int64_t> stored = state_.checkpoints->StorageBytes(tenant.id);
      if (!stored.ok()) return stored.status();
      response->set_storage_bytes_used(*stored);
      response->set_storage_quota_bytes(state_.checkpoints->quotas().For(tenant.id));
    }
    // The model's: how many adapters live on it, of how many it holds at most
    // (models[i].max_adapters; limits.max_adapters with one model).
    const int32_t max = stack.config().limits.max_adapters;
    const int32_t used = stack.coordinator().adapter_count();
    response->set_max_adapters(max);
    response->set_used_adapters(used);
    response->set_free_adapters(std::max(0, max - used));
    // The sampler's room is that of the workers that sample: the dedicated pool when there is one.
    const Supervisor& sampling = stack.sampling_supervisor();
    response->set_sampler_mode(stack.sampler_supervisor() != nullptr ? "dedicated" : "colocated");
    response->set_sampler_ready(!state_.draining.load() && sampling.AllReady());
    response->set_sampler_max_snapshots(state_.config.sampler.max_snapshots);
    {
      const sampling::SamplerStats stats = stack.sampler().stats();
      // One lane per worker that samples (the training pool's rank 0 when colocated, every
      // sampler worker when dedicated), each with the cache size every worker loaded with.
      if (std::optional<ModelInfo> info = sampling.model_info()) {
        response->set_sampler_kv_blocks_total(info->kv_cache_blocks * static_cast<int64_t>(stats.lanes.size()));
        response->set_sampler_kv_block_size(info->kv_block_size);
        response->set_sampler_state_slots_total(info->state_slots * static_cast<int64_t>(stats.lanes.size()));
      }
      response->set_sampler_kv_blocks_in_use(stats.blocks_in_use);
      response->set_sampler_state_slots_in_use(stats.states_in_use);
      response->set_sampler_snapshots(static_cast<int32_t>(stats.snapshots));
      response->set_sampler_running(stats.running);
      response->set_sampler_waiting(stats.waiting);
      const std::vector<WorkerSnapshot> workers = sampling.Snapshot();
      for (size_t lane = 0; lane < stats.lanes.size(); ++lane) {
        const sampling::SamplerLaneStats& l = stats.lanes[lane];
        twinkle::v1::SamplerWorkerLoad* load = response->add_sampler_workers();
        load->set_rank(static_cast<int32_t>(lane));  // lane i is rank i of the pool that samples
        if (lane < workers.size()) load->set_device(workers[lane].device);
        load->set_kv_blocks_total(l.blocks_total);
        load->set_kv_blocks_in_use(l.blocks_in_use);
        load->set_state_slots_total(l.states_total);
        load->set_state_slots_in_use(l.states_in_use);
        load->set_running(l.running);
        load->set_waiting(l.waiting);
        load->set_tokens_generated(l.tokens_generated);
      }
    }
    return absl::OkStatus();
  });
}

namespace {

std::string Rfc3339(absl::Time t) { return absl::FormatTime(absl::RFC3339_full, t, absl::UTCTimeZone()); }

void FillRun(const registry::RunRecord& run, twinkle::v1::TrainingRun* out) {
  out->set_training_run_id(run.run_id);
  out->set_base_model(run.base_model);
  out->set_model_owner(run.tenant);
  out->set_is_lora(true);
  out->set_created_time(Rfc3339(run.created));
  out->set_last_request_time(Rfc3339(run.last_request));
  out->set_adapter_name(run.adapter_name);
  out->set_last_step(run.last_step);
  const nlohmann::json lora = nlohmann::json::parse(run.lora_config_json, nullptr, false);
  if (lora.is_object()) {
    out->set_lora_rank(lora.value("r", 0));
    if (lora.contains("target_modules") && lora["target_modules"].is_array()) {
      for (const auto& t : lora["target_modules"]) {
        if (t.is_string()) out->add_target_modules(t.get<std::string>());
      }
    }
  }
}

void FillCheckpoint(const registry::CheckpointRecord& c, twinkle::v1::Checkpoint* out) {
  out->set_checkpoint_id(c.checkpoint_id);
  out->set_checkpoint_type(c.kind);
  out->set_time(Rfc3339(c.created));
  out->set_size_bytes(c.size_bytes);
  out->set_twinkle_path(absl::StrCat("twinkle://", c.run_id, "/", c.checkpoint_id));
}

// The files transformers reads to build a tokenizer; nothing else leaves the model folder.
constexpr const char* kTokenizerFiles[] = {
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json",     "merges.txt",            "tokenizer.model",         "chat_template.jinja",
    "generation_config.json"};

}  // namespace

grpc::ServerUnaryReactor* UtilityServiceImpl::ListTrainingRuns(grpc::CallbackServerContext* context,
                                                               const twinkle::v1::ListTrainingRunsRequest* request,
                                                               twinkle::v1::ListTrainingRunsResponse* response) {
  return HandleNow(context, state_, "UtilityService/ListTrainingRuns", [&](const tenancy::Tenant& t) -> absl::Status {
    if (request->limit() < 0 || request->offset() < 0) {
      return absl::InvalidArgumentError("limit and offset must not be negative");
    }
    const int32_t limit = request->limit() == 0 ? 20 : request->limit();
    int32_t total = 0;
    absl::StatusOr<std::vector<registry::RunRecord>> runs =
        state_.registry->ListRuns(t.id, registry::Page{limit, request->offset()}, &total);
    if (!runs.ok()) return runs.status();
    for (const registry::RunRecord& run : *runs) FillRun(run, response->add_training_runs());
    response->mutable_cursor()->set_limit(limit);
    response->mutable_cursor()->set_offset(request->offset());
    response->mutable_cursor()->set_total_count(total);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* UtilityServiceImpl::GetTrainingRun(grpc::CallbackServerContext* context,
                                                             const twinkle::v1::GetTrainingRunRequest* request,
                                                             twinkle::v1::TrainingRun* response) {
  return HandleNow(context, state_, "UtilityService/GetTrainingRun", [&](const tenancy::Tenant& t) -> absl::Status {
    absl::StatusOr<registry::RunRecord> run = state_.registry->GetRun(t.id, request->run_id());
    if (!run.ok()) return run.status();
    FillRun(*run, response);
    absl::StatusOr<std::vector<registry::CheckpointRecord>> checkpoints =
        state_.registry->ListCheckpoints(t.id, request->run_id());
    if (checkpoints.ok()) {
      for (auto it = checkpoints->rbegin(); it != checkpoints->rend(); ++it) {
        if (it->kind == "training") {
          response->set_last_checkpoint(absl::StrCat("twinkle://", it->run_id, "/", it->checkpoint_id));
          break;
        }
      }
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* UtilityServiceImpl::ListCheckpoints(grpc::CallbackServerContext* context,
                                                              const twinkle::v1::ListCheckpointsRequest* request,
                                                              twinkle::v1::ListCheckpointsResponse* response) {
  return HandleNow(context, state_, "UtilityService/ListCheckpoints", [&](const tenancy::Tenant& t) -> absl::Status {
    if (absl::Status s = state_.registry->GetRun(t.id, request->run_id()).status(); !s.ok()) return s;
    absl::StatusOr<std::vector<registry::CheckpointRecord>> checkpoints =
        state_.registry->ListCheckpoints(t.id, request->run_id());
    if (!checkpoints.ok()) return checkpoints.status();
    for (const registry::CheckpointRecord& c : *checkpoints) FillCheckpoint(c, response->add_checkpoints());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* UtilityServiceImpl::DeleteCheckpoint(grpc::CallbackServerContext* context,
                                                               const twinkle::v1::DeleteCheckpointRequest* request,
                                                               twinkle::v1::DeleteCheckpointResponse* response) {
  return HandleNow(context, state_, "UtilityService/DeleteCheckpoint", [&](const tenancy::Tenant& t) -> absl::Status {
    if (absl::Status s = state_.checkpoints->Delete(t.id, request->run_id(), request->checkpoint_id()); !s.ok()) {
      return s;
    }
    response->set_success(true);
    response->set_message(absl::StrCat("deleted ", request->checkpoint_id()));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* UtilityServiceImpl::GetTokenizerFiles(grpc::CallbackServerContext* context,
                                                                const twinkle::v1::GetTokenizerFilesRequest* request,
                                                                twinkle::v1::GetTokenizerFilesResponse* response) {
  return HandleNow(context, state_, "UtilityService/GetTokenizerFiles", [&](const tenancy::Tenant&) -> absl::Status {
    absl::StatusOr<ModelStack*> named = state_.models->ForBaseModel(request->base_model());
    if (!named.ok()) return named.status();
    const std::filesystem::path dir((*named)->model_dir());
    for (const char* name : kTokenizerFiles) {
      std::ifstream in(dir / name, std::ios::binary);
      if (!in) continue;
      twinkle::v1::TokenizerFile* file = response->add_files();
      file->set_name(name);
      file->set_content(std::string(std::istreambuf_iterator<char>(in), {}));
    }
    if (response->files_size() == 0) {
      return absl::NotFoundError(absl::StrCat("the model folder has no tokenizer files"));
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* UtilityServiceImpl::ExportMergedModel(grpc::CallbackServerContext* context,
                                                                const twinkle::v1::ExportMergedModelRequest* request,
                                                                twinkle::v1::ExportMergedModelResponse* response) {
  return HandleQueued(
      context, state_, "UtilityService/ExportMergedModel", false,
      [&](const tenancy::Tenant& t) {
        // Folded into the base model its run was trained on.
        return state_.models->ForCheckpoint(t.id, request->checkpoint_path()).coordinator().SubmitExport(training::ContextOf(t), request->checkpoint_path(), request->name());
      },
      [](uint64_t) {},
      [response](const training::OpOutput& out) {
        response->set_path(out.checkpoint_dir);
        response->set_size_bytes(static_cast<int64_t>(out.value));
        return absl::OkStatus();
      });
}

}  // namespace twinkle
