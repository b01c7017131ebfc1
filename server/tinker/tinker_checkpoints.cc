// TinkerApi: checkpoint retention, export and sharing — ttl_seconds on saves, PUT .../ttl,
// publish / unpublish, access_scope on the REST listings, save_weights_external with its
// signed download URLs (and the download itself), and copy_weights.
#include <algorithm>
#include <cctype>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "core/scheduler/op.h"
#include "core/storage/checkpoint_dir.h"
#include "core/storage/names.h"
#include "core/storage/tar_stream.h"
#include "server/tinker/tinker_api.h"
#include "server/tinker/tinker_codec.h"
#include "server/tinker/tinker_internal.h"
#include "server/tinker/tinker_json.h"
#include "server/tinker/url_signer.h"

namespace twinkle::tinker {

absl::StatusOr<std::optional<int64_t>> GetTtl(const Json& body) {
  if (!body.is_object() || !body.contains("ttl_seconds") || body["ttl_seconds"].is_null()) return std::nullopt;
  const Json& v = body["ttl_seconds"];
  if (!v.is_number_integer()) {
    return absl::InvalidArgumentError("ttl_seconds: must be an integer number of seconds, or null for no expiry");
  }
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return absl::InvalidArgumentError(absl::StrCat("ttl_seconds: ", v.dump(), " is out of range (1 to ",
                                                   training::kMaxTtlSeconds, " seconds, or null for no expiry)"));
  }
  const int64_t ttl = v.get<int64_t>();
  if (absl::Status s = training::ValidateTtl(ttl, "ttl_seconds"); !s.ok()) return s;
  return ttl;
}

absl::Status CheckScope(const std::string& scope) {
  if (scope.empty() || scope == "owned" || scope == "accessible") return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("access_scope: '", scope, "' is not one of 'owned', 'accessible'"));
}

namespace {

// Percent-encodes everything but RFC 3986's unreserved characters.
std::string UrlEncode(absl::string_view s) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~') {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}

constexpr char kArchive[] = "archive.tar";

std::string NewCopyRunId() {
  std::random_device rd;
  const uint64_t a = (static_cast<uint64_t>(rd()) << 32) | rd();
  static constexpr char kHex[] = "0123456789abcdef";
  std::string id = "copy-";
  for (int i = 0; i < 16; ++i) id.push_back(kHex[(a >> (4 * i)) & 15]);
  return id;
}

}  // namespace

void TinkerApi::SetDownloads(const UrlSigner* signer, absl::Duration url_ttl, const Clock* clock) {
  signer_ = signer;
  url_ttl_ = url_ttl;
  if (clock != nullptr) url_clock_ = clock;
}

// ---- listings with access_scope -------------------------------------------------------------

absl::StatusOr<Json> TinkerApi::GetTrainingRunScoped(const tenancy::Tenant& tenant, const std::string& model_id,
                                                     const std::string& access_scope) {
  if (absl::Status s = CheckScope(access_scope); !s.ok()) return s;
  absl::StatusOr<Json> own = GetTrainingRun(tenant, model_id);
  if (access_scope != "accessible" || !absl::IsNotFound(own.status())) return own;
  absl::StatusOr<std::vector<registry::CheckpointRecord>> shared = registry_->PublishedCheckpointsOfOthers(tenant.id);
  if (!shared.ok()) return shared.status();
  const std::string run_id = RunIdOf(model_id);
  std::vector<registry::CheckpointRecord> of_run;
  for (const registry::CheckpointRecord& c : *shared) {
    if (c.run_id == run_id) of_run.push_back(c);
  }
  if (of_run.empty()) return own;  // the same NotFound as an unknown run
  absl::StatusOr<registry::RunRecord> run = registry_->GetRun(of_run.front().tenant, run_id);
  if (!run.ok()) return own;
  return ToJson(RunOf(*run, of_run));
}

absl::StatusOr<Json> TinkerApi::ListUserCheckpointsScoped(const tenancy::Tenant& tenant, int32_t limit,
                                                          int32_t offset, const std::string& access_scope) {
  if (absl::Status s = CheckScope(access_scope); !s.ok()) return s;
  if (access_scope != "accessible") return ListUserCheckpoints(tenant, limit, offset);
  absl::StatusOr<Json> own = ListUserCheckpoints(tenant, 1 << 30, 0);
  if (!own.ok()) return own;
  std::vector<Json> all((*own)["checkpoints"].begin(), (*own)["checkpoints"].end());
  absl::StatusOr<std::vector<registry::CheckpointRecord>> shared = registry_->PublishedCheckpointsOfOthers(tenant.id);
  if (!shared.ok()) return shared.status();
  for (const registry::CheckpointRecord& c : *shared) all.push_back(ToJson(CheckpointOf(c)));
  Json list = Json::array();
  for (size_t i = static_cast<size_t>(offset); i < all.size() && list.size() < static_cast<size_t>(limit); ++i) {
    list.push_back(all[i]);
  }
  return Json{{"checkpoints", std::move(list)},
              {"cursor", {{"offset", offset}, {"limit", limit}, {"total_count", all.size()}}}};
}

// ---- retention and sharing -------------------------------------------------------------------

absl::StatusOr<Json> TinkerApi::SetCheckpointTtl(const tenancy::Tenant& tenant, const std::string& model_id,
                                                 const std::string& checkpoint_id, const Json& body) {
  if (checkpoints_ == nullptr) return NoCheckpoints();
  if (!body.is_object() || !body.contains("ttl_seconds")) {
    return absl::InvalidArgumentError("ttl_seconds: required (an integer number of seconds, or null to clear)");
  }
  absl::StatusOr<std::optional<int64_t>> ttl = GetTtl(body);
  if (!ttl.ok()) return ttl.status();
  if (absl::Status s = checkpoints_->SetTtl(tenant.id, RunIdOf(model_id), checkpoint_id, *ttl); !s.ok()) return s;
  return Json::object();
}

absl::StatusOr<Json> TinkerApi::PublishCheckpoint(const tenancy::Tenant& tenant, const std::string& model_id,
                                                  const std::string& checkpoint_id, bool publish) {
  if (registry_ == nullptr) return NoCheckpoints();
  if (absl::Status s = registry_->SetCheckpointPublished(tenant.id, RunIdOf(model_id), checkpoint_id, publish);
      !s.ok()) {
    return s;
  }
  return Json::object();
}

// ---- export ----------------------------------------------------------------------------------

absl::StatusOr<Json> TinkerApi::SaveWeightsExternal(const tenancy::Tenant& tenant, const Json& body) {
  // save_weights' fields (its overwrite is not read: every export makes a new checkpoint).
  absl::StatusOr<SaveWeightsRequest> request = DecodeSaveWeights(body);
  if (!request.ok()) return request.status();
  absl::StatusOr<ModelCall> call = ModelCallOf(tenant, request->model_id, request->seq_id, request->path);
  if (!call.ok()) return call.status();
  const std::optional<int64_t> ttl = request->ttl_seconds;
  if (body.contains("age_encryption_recipients") && body["age_encryption_recipients"].is_array() &&
      !body["age_encryption_recipients"].empty()) {
    return absl::UnimplementedError("age_encryption_recipients: encrypted exports are not supported by this server");
  }
  const training::TenantContext context = ContextOf(tenant);
  Submit submit = [context, stack = call->model->stack, adapter = call->model->adapter, name = call->name, ttl]() {
    training::SaveArgs args;
    args.name = name;
    args.save_optimizer = false;
    args.is_external = true;
    args.ttl_seconds = ttl;
    return stack->coordinator().SubmitSave(context, adapter, args);
  };
  Encoder encode = [model_id = call->model_id, name = call->name](const FutureValue&) {
    return Outcome::Of(OpResult::OfPath("save_weights_external",
                                          absl::StrCat("tinker://", model_id, "/external_weights/", name)));
  };
  absl::StatusOr<FuturePromise> promise =
      Sequenced(tenant, call->model, call->seq,
                {"save_weights_external", FingerprintOf(absl::StrCat(call->name, "\n", ttl.value_or(0)))},
                std::move(submit), std::move(encode));
  if (!promise.ok()) return promise.status();
  return ToJson(*promise);
}

absl::StatusOr<Json> TinkerApi::ExternalWeightsUrls(const tenancy::Tenant& tenant, const std::string& model_id,
                                                    const std::string& checkpoint_id, const std::string& base_url) {
  if (checkpoints_ == nullptr) return NoCheckpoints();
  if (signer_ == nullptr) return NoSigner();
  const std::string run_id = RunIdOf(model_id);
  absl::StatusOr<registry::CheckpointRecord> record =
      checkpoints_->Resolve(tenant.id, absl::StrCat("twinkle://", run_id, "/", checkpoint_id), "");
  if (!record.ok()) return record.status();
  absl::StatusOr<Json> files = checkpoints_->ListFiles(*record);
  if (!files.ok()) return files.status();
  const absl::Time expires = url_clock_->Now() + url_ttl_;
  const int64_t expires_unix = absl::ToUnixSeconds(expires);
  Json urls = Json::object();
  Json sums = Json::object();
  for (const auto& [file, info] : files->items()) {
    const std::string sig =
        signer_->Sign(UrlSigner::Message(tenant.id, record->run_id, record->checkpoint_id, file, expires_unix));
    std::string path = absl::StrCat("/twinkle/weights/", UrlEncode(tenant.id), "/", UrlEncode(record->run_id));
    for (absl::string_view part : absl::StrSplit(record->checkpoint_id, '/')) absl::StrAppend(&path, "/", UrlEncode(part));
    absl::StrAppend(&path, "/", UrlEncode(file));
    urls[file] = absl::StrCat(base_url, path, "?expires=", expires_unix, "&sig=", sig);
    sums[file] = info.value("sha256", std::string());
  }
  return Json{{"urls", std::move(urls)}, {"expires", IsoTime(absl::FromUnixSeconds(expires_unix))},
              {"sha256", std::move(sums)}};
}

absl::StatusOr<Json> TinkerApi::ArchiveUrl(const tenancy::Tenant& tenant, const std::string& model_id,
                                           const std::string& checkpoint_id, const std::string& base_url) {
  if (checkpoints_ == nullptr) return NoCheckpoints();
  if (signer_ == nullptr) return NoSigner();
  absl::StatusOr<registry::CheckpointRecord> record =
      checkpoints_->Resolve(tenant.id, absl::StrCat("twinkle://", RunIdOf(model_id), "/", checkpoint_id), "");
  if (!record.ok()) return record.status();
  const int64_t expires_unix = absl::ToUnixSeconds(url_clock_->Now() + url_ttl_);
  const std::string sig =
      signer_->Sign(UrlSigner::Message(tenant.id, record->run_id, record->checkpoint_id, kArchive, expires_unix));
  std::string path = absl::StrCat("/twinkle/weights/", UrlEncode(tenant.id), "/", UrlEncode(record->run_id));
  for (absl::string_view part : absl::StrSplit(record->checkpoint_id, '/')) absl::StrAppend(&path, "/", UrlEncode(part));
  return Json{{"url", absl::StrCat(base_url, path, "/", kArchive, "?expires=", expires_unix, "&sig=", sig)},
              {"expires", IsoTime(absl::FromUnixSeconds(expires_unix))}};
}

absl::StatusOr<TinkerApi::WeightsFile> TinkerApi::ServeWeightsFile(const std::string& path_tail,
                                                                   const std::string& expires,
                                                                   const std::string& signature) {
  if (checkpoints_ == nullptr) return NoCheckpoints();
  if (signer_ == nullptr) return NoSigner();
  const std::vector<std::string> parts = absl::StrSplit(path_tail, '/');
  if (parts.size() != 5) {
    return absl::InvalidArgumentError("download URL: expected /twinkle/weights/<tenant>/<run>/<kind>/<name>/<file>");
  }
  static constexpr const char* kFields[] = {"tenant", "run", "kind", "name", "file"};
  for (size_t i = 0; i < parts.size(); ++i) {
    if (absl::Status s = storage::ValidatePathName(parts[i], absl::StrCat("download URL ", kFields[i])); !s.ok()) {
      return s;
    }
  }
  const std::string& tenant = parts[0];
  const std::string checkpoint_id = absl::StrCat(parts[2], "/", parts[3]);
  int64_t expires_unix = 0;
  if (!absl::SimpleAtoi(expires, &expires_unix) ||
      !signer_->Verify(UrlSigner::Message(tenant, parts[1], checkpoint_id, parts[4], expires_unix), signature)) {
    return absl::PermissionDeniedError("download URL: the signature does not match (ask external_weights_urls for a new URL)");
  }
  if (absl::FromUnixSeconds(expires_unix) <= url_clock_->Now()) {
    return absl::PermissionDeniedError(
        absl::StrCat("download URL: expired at ", IsoTime(absl::FromUnixSeconds(expires_unix)),
                     " (ask external_weights_urls for a new URL)"));
  }
  // Checked now, not when signed: a deleted, expired or unpublished checkpoint is gone at once.
  absl::StatusOr<registry::CheckpointRecord> record =
      checkpoints_->Resolve(tenant, absl::StrCat("twinkle://", parts[1], "/", checkpoint_id), "");
  if (!record.ok()) return record.status();
  if (parts[4] == kArchive) {
    // The PEFT adapter as one tar (what SDKs <= 0.30 download and extract), with Tinker's
    // checkpoint_complete marker last. Its checksum goes in the answer's header, before the
    // body: a first pass reads (and checks) the files to compute it.
    std::vector<storage::StreamedFile> members;
    for (const char* name : {"adapter_model.safetensors", "adapter_config.json"}) {
      absl::StatusOr<storage::StreamedFile> f = checkpoints_->ListedFile(*record, name);
      if (absl::IsNotFound(f.status())) continue;
      if (!f.ok()) return f.status();
      members.push_back(*std::move(f));
    }
    members.push_back({"checkpoint_complete", "", 0, ""});  // empty: no file behind it
    const int64_t mtime = absl::ToUnixSeconds(record->created);
    absl::StatusOr<std::string> sha =
        storage::StreamTar(members, mtime, [](absl::string_view) { return absl::OkStatus(); });
    if (!sha.ok()) return sha.status();
    return WeightsFile{storage::TarSize(members), *std::move(sha),
                       [members = std::move(members), mtime](const storage::ChunkSink& sink) {
                         return storage::StreamTar(members, mtime, sink);
                       }};
  }
  absl::StatusOr<storage::StreamedFile> file = checkpoints_->ListedFile(*record, parts[4]);
  if (!file.ok()) return file.status();
  return WeightsFile{file->size, file->sha256,
                     [file = *file](const storage::ChunkSink& sink) { return storage::StreamFile(file, sink); }};
}

// ---- copy ------------------------------------------------------------------------------------

absl::StatusOr<Json> TinkerApi::CopyWeights(const tenancy::Tenant& tenant, const Json& body,
                                            const std::string& idempotency_key, bool* replayed) {
  if (replayed != nullptr) *replayed = false;
  if (checkpoints_ == nullptr || registry_ == nullptr) return NoCheckpoints();
  if (idempotency_key.empty()) return CopyWeightsOnce(tenant, body);
  if (idempotency_key.size() > kMaxIdempotencyKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("X-Idempotency-Key: ", idempotency_key.size(),
                                                   " bytes, over the limit of ", kMaxIdempotencyKeyBytes));
  }
  const std::string key = absl::StrCat("copy_weights\n", tenant.id, "\n", idempotency_key);
  const uint64_t fingerprint = FingerprintOf(body.dump(-1, ' ', false, Json::error_handler_t::replace));
  auto first_of = [this, &key]() -> std::shared_ptr<Entry> {
    absl::MutexLock lock(&mu_);
    auto d = dedupe_.find(key);
    if (d == dedupe_.end()) return nullptr;
    auto e = entries_.find(d->second);
    return e == entries_.end() ? nullptr : e->second;
  };
  std::shared_ptr<Entry> first = first_of();
  std::shared_ptr<Entry> mine;
  if (first == nullptr) {
    mine = NewEntry(tenant.id, "");
    mine->fingerprint = fingerprint;
    absl::MutexLock lock(&mu_);
    auto d = dedupe_.find(key);
    if (auto e = d == dedupe_.end() ? entries_.end() : entries_.find(d->second); e != entries_.end()) {
      first = e->second;  // another replay got there first: answer as it does
    } else {
      dedupe_[key] = mine->request_id;
    }
  }
  if (first != nullptr) {
    if (mine != nullptr) {
      Complete(mine, Outcome::Failed(absl::CancelledError("a duplicate")));
      futures_.Release(mine->future);
    }
    if (first->fingerprint != fingerprint) {
      return sched::IdempotencyConflict(absl::StrCat("X-Idempotency-Key '", idempotency_key,
                                                     "' was already used for a copy_weights with another body"));
    }
    absl::StatusOr<FutureResult> answer = futures_.Wait(first->future, tenant.id, absl::Seconds(60));
    if (absl::IsUnavailable(answer.status())) {
      return absl::UnavailableError("copy_weights: the first call with this X-Idempotency-Key is still copying; retry");
    }
    if (!answer.ok()) return answer.status();
    if (!answer->ok()) return answer->status();  // dropped over a results bound: says which
    absl::StatusOr<const EncodedResult*> encoded = ValueAs<EncodedResult>(**answer, "copy_weights answer");
    if (!encoded.ok()) return encoded.status();
    Json json = Json::parse((*encoded)->json, nullptr, /*allow_exceptions=*/false);
    if (json.is_discarded()) return absl::DataLossError("the stored answer of this copy_weights is not JSON");
    if (replayed != nullptr) *replayed = true;
    return json;
  }
  absl::StatusOr<Json> answer = CopyWeightsOnce(tenant, body);
  if (!answer.ok()) {
    {
      absl::MutexLock lock(&mu_);
      dedupe_.erase(key);
    }
    Complete(mine, Outcome::Failed(answer.status()));
    futures_.Release(mine->future);
    return answer;
  }
  Outcome done;
  done.json = *answer;
  Complete(mine, std::move(done));
  return answer;
}

absl::StatusOr<Json> TinkerApi::CopyWeightsOnce(const tenancy::Tenant& tenant, const Json& body) {
  absl::StatusOr<std::string> source = GetString(body, "source_path");
  if (!source.ok()) return source.status();
  absl::StatusOr<std::optional<int64_t>> ttl = GetTtl(body);
  if (!ttl.ok()) return ttl.status();
  const std::string internal = InternalPath(*source);
  absl::StatusOr<training::CheckpointPath> parsed = training::ParseCheckpointPath(internal, "source_path");
  if (!parsed.ok()) return parsed.status();
  absl::StatusOr<registry::CheckpointRecord> record = checkpoints_->Resolve(tenant.id, internal, "");
  if (!record.ok()) return record.status();
  absl::StatusOr<registry::RunRecord> source_run = registry_->GetRun(record->tenant, record->run_id);
  if (!source_run.ok()) return source_run.status();
  // The copy lives in a run of its own that nothing trains (no adapter is ever created for it).
  registry::RunRecord run = *source_run;
  run.run_id = NewCopyRunId();
  run.tenant = tenant.id;
  run.adapter_name = run.run_id;
  run.created = run.last_request = url_clock_->Now();
  run.last_step = 0;
  // Recorded once the copy is admitted (quota), so a refused copy leaves no run behind.
  absl::StatusOr<registry::CheckpointRecord> copy = checkpoints_->Copy(
      tenant.id, *record, run.run_id, parsed->kind, parsed->name, *ttl, [&] { return registry_->PutRun(run); });
  if (!copy.ok()) return copy.status();
  return Json{{"tinker_path", TinkerPathOf(copy->run_id, copy->checkpoint_id)}};
}

// ---- import -----------------------------------------------------------------------------------

absl::StatusOr<Json> TinkerApi::ImportAdapter(const tenancy::Tenant& tenant, const Json& body) {
  if (checkpoints_ == nullptr || registry_ == nullptr) return NoCheckpoints();
  absl::StatusOr<std::string> name = GetString(body, "name");
  if (!name.ok()) return name.status();
  if (absl::Status s = storage::ValidatePathName(*name, "name"); !s.ok()) return s;
  absl::StatusOr<std::optional<int64_t>> ttl = GetTtl(body);
  if (!ttl.ok()) return ttl.status();
  if (!body.contains("adapter_config") || !body["adapter_config"].is_object()) {
    return absl::InvalidArgumentError("adapter_config: required (the adapter's adapter_config.json as an object)");
  }
  absl::StatusOr<std::string> encoded = GetString(body, "adapter_model");
  if (!encoded.ok()) return encoded.status();
  std::string safetensors;
  if (!absl::Base64Unescape(*encoded, &safetensors)) {
    return absl::InvalidArgumentError("adapter_model: not base64 (adapter_model.safetensors, base64-encoded)");
  }
  absl::StatusOr<std::string> base_model = GetString(body, "base_model", "");
  if (!base_model.ok()) return base_model.status();
  absl::StatusOr<ModelStack*> stack = served_.ForBaseModel(*base_model);
  if (!stack.ok()) return stack.status();
  std::map<std::string, std::vector<int64_t>> shapes;
  {
    absl::MutexLock lock(&shapes_mu_);
    auto cached = base_shapes_.find((*stack)->name());
    if (cached == base_shapes_.end()) {
      absl::StatusOr<std::map<std::string, std::vector<int64_t>>> read = training::BaseWeightShapes((*stack)->model_dir());
      if (!read.ok()) return read.status();
      cached = base_shapes_.emplace((*stack)->name(), *std::move(read)).first;
    }
    shapes = cached->second;
  }
  registry::RunRecord run;
  run.run_id = "import-" + NewCopyRunId().substr(5);
  run.tenant = tenant.id;
  run.adapter_name = run.run_id;
  run.base_model = (*stack)->name();
  run.created = run.last_request = url_clock_->Now();
  absl::StatusOr<registry::CheckpointRecord> record = checkpoints_->ImportPeftAdapter(
      tenant.id, run.run_id, *name, safetensors, body["adapter_config"], shapes,
      std::min<int64_t>(options_.max_lora_rank, tenant.quotas.max_lora_rank), *ttl,
      [&](const training::LoraArgs& lora) {
        run.lora_config_json = Json{{"r", lora.rank}, {"lora_alpha", lora.alpha}, {"target_modules", lora.targets},
                                    {"use_rslora", lora.use_rslora}, {"imported", true}}.dump();
        return registry_->PutRun(run);
      });
  if (!record.ok()) return record.status();
  return Json{{"tinker_path", TinkerPathOf(record->run_id, record->checkpoint_id)},
              {"model_id", ModelIdOf(record->run_id)}};
}

}  // namespace twinkle::tinker
