#include "core/training/future_journal.h"

#include <nlohmann/json.hpp>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/common/log.h"

namespace twinkle::training {
namespace {

using nlohmann::json;
constexpr char kLog[] = "futures";

}  // namespace

std::string OpOutputToJson(const OpOutput& out) {
  json seqs = json::array();
  for (const SequenceResult& s : out.sequences) seqs.push_back({{"logps", s.logps}, {"loss", s.loss}});
  json tensors = json::object();
  for (const auto& [name, t] : out.tensors) tensors[name] = {{"shape", t.shape}, {"values", t.values}};
  return json{{"sequences", seqs},
              {"loss", out.loss},
              {"metrics", out.metrics},
              {"value", out.value},
              {"skipped", out.skipped},
              {"text", out.text},
              {"metric_strings", out.metric_strings},
              {"tensors", tensors},
              {"checkpoint_uri", out.checkpoint_uri},
              {"checkpoint_dir", out.checkpoint_dir},
              {"cur_step", out.cur_step},
              {"consumed_train_samples", out.consumed_train_samples},
              {"gradient_accumulation_steps", out.gradient_accumulation_steps}}
      .dump();
}

absl::StatusOr<OpOutput> OpOutputFromJson(const std::string& text) {
  try {
    const json j = json::parse(text);
    OpOutput out;
    for (const json& s : j.at("sequences")) {
      out.sequences.push_back({s.at("logps").get<std::vector<float>>(), s.at("loss").get<std::vector<float>>()});
    }
    out.loss = j.at("loss").get<double>();
    out.metrics = j.at("metrics").get<std::map<std::string, double>>();
    out.value = j.at("value").get<double>();
    out.skipped = j.at("skipped").get<bool>();
    out.text = j.at("text").get<std::string>();
    out.metric_strings = j.at("metric_strings").get<std::map<std::string, std::string>>();
    for (const auto& [name, t] : j.at("tensors").items()) {
      out.tensors[name] = {t.at("shape").get<std::vector<int64_t>>(), t.at("values").get<std::vector<float>>()};
    }
    out.checkpoint_uri = j.at("checkpoint_uri").get<std::string>();
    out.checkpoint_dir = j.at("checkpoint_dir").get<std::string>();
    out.cur_step = j.at("cur_step").get<int64_t>();
    out.consumed_train_samples = j.at("consumed_train_samples").get<int64_t>();
    out.gradient_accumulation_steps = j.at("gradient_accumulation_steps").get<int32_t>();
    return out;
  } catch (const json::exception& e) {
    return absl::DataLossError(absl::StrCat("stored future result: ", e.what()));
  }
}

std::string EncodedResultToJson(const EncodedResult& out) {
  return json{{"encoded", {{"json", out.json}, {"proto", absl::Base64Escape(out.proto)}}}}.dump();
}

absl::StatusOr<FutureValue> StoredValueFromJson(const std::string& text) {
  try {
    const json j = json::parse(text);
    if (j.is_object() && j.contains("encoded")) {
      EncodedResult out;
      out.json = j.at("encoded").at("json").get<std::string>();
      if (!absl::Base64Unescape(j.at("encoded").at("proto").get<std::string>(), &out.proto)) {
        return absl::DataLossError("stored future result: its protobuf is not base64");
      }
      return FutureValue(std::move(out));
    }
  } catch (const json::exception& e) {
    return absl::DataLossError(absl::StrCat("stored future result: ", e.what()));
  }
  absl::StatusOr<OpOutput> out = OpOutputFromJson(text);
  if (!out.ok()) return out.status();
  return FutureValue(*std::move(out));
}

absl::StatusOr<std::unique_ptr<RegistryFutureJournal>> RegistryFutureJournal::Open(registry::Registry& registry) {
  const absl::Time now = absl::Now();
  absl::StatusOr<int64_t> interrupted = registry.InterruptPendingFutures(now);
  if (!interrupted.ok()) return interrupted.status();
  absl::StatusOr<uint64_t> max_id = registry.MaxFutureId();
  if (!max_id.ok()) return max_id.status();
  const uint64_t boot = (*max_id >> kFutureBootShift) + 1;
  // A boot marker (counter 0, no tenant): the next boot numbers itself above this one even if
  // this one records nothing else.
  registry::FutureRecord marker;
  marker.id = boot << kFutureBootShift;
  marker.state = "done";
  marker.created = marker.updated = now;
  if (absl::Status s = registry.PutFuture(marker); !s.ok()) return s;
  if (*interrupted > 0) LogInfo(kLog, absl::StrCat(*interrupted, " futures were interrupted by the restart"));
  return std::unique_ptr<RegistryFutureJournal>(new RegistryFutureJournal(registry, boot));
}

RegistryFutureJournal::RegistryFutureJournal(registry::Registry& registry, uint64_t boot)
    : registry_(registry), boot_(boot), writer_([this] { WriterLoop(); }) {}

RegistryFutureJournal::~RegistryFutureJournal() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  writer_.join();
}

void RegistryFutureJournal::Queue(Write w) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(w));
}

void RegistryFutureJournal::Created(uint64_t id, const std::string& tenant) {
  registry::FutureRecord r;
  r.id = id;
  r.tenant = tenant;
  r.state = "pending";
  r.created = r.updated = absl::Now();
  Queue({std::move(r)});
}

void RegistryFutureJournal::Dropped(uint64_t id, const std::string& tenant, const absl::Status& why) {
  registry::FutureRecord r;
  r.id = id;
  r.tenant = tenant;
  r.created = r.updated = absl::Now();
  if (why.ok()) {
    Queue({std::move(r), /*erase=*/true});
    return;
  }
  r.state = "failed";
  r.error_code = static_cast<int32_t>(why.code());
  r.error_message = std::string(why.message());
  Queue({std::move(r)});
}

void RegistryFutureJournal::BeginShutdown() {
  absl::MutexLock lock(&mu_);
  shutting_down_ = true;
}

void RegistryFutureJournal::Completed(uint64_t id, const std::string& tenant, const FutureResult& result) {
  registry::FutureRecord r;
  r.id = id;
  r.tenant = tenant;
  r.created = r.updated = absl::Now();
  if (result.ok() && std::holds_alternative<OpOutput>(*result)) {
    r.state = "done";
    r.result = OpOutputToJson(std::get<OpOutput>(*result));
  } else if (result.ok() && std::holds_alternative<EncodedResult>(*result)) {
    r.state = "done";
    r.result = EncodedResultToJson(std::get<EncodedResult>(*result));
  } else if (result.ok()) {
    // Results of other kinds (sampling outputs, sampling sessions) are served from memory
    // only; the journal is read once that is gone (a restart, or past future_retention_s), so
    // it records why the result cannot be had rather than an empty training result.
    r.state = "failed";
    r.error_code = static_cast<int32_t>(absl::StatusCode::kNotFound);
    r.error_message =
        "this operation finished, but its result is kept in memory only and is gone (the server restarted "
        "or sessions.future_retention_s passed): submit it again";
  } else {
    r.state = "failed";
    r.error_code = static_cast<int32_t>(result.status().code());
    r.error_message = std::string(result.status().message());
  }
  absl::MutexLock lock(&mu_);
  // Failing because the server stops is not an outcome: the row stays pending, and the next
  // boot reports it interrupted (retryable) instead of this error.
  if (shutting_down_ && !result.ok()) return;
  queue_.push_back({std::move(r)});
}

void RegistryFutureJournal::WriterLoop() {
  while (true) {
    std::shared_ptr<const std::deque<Write>> batch;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;
      auto taken = std::make_shared<std::deque<Write>>();
      taken->swap(queue_);
      batch = taken;
      writing_batch_ = batch;  // Lookup reads it until it is in the registry
      writing_ = true;
    }
    for (const Write& w : *batch) {
      // Writes keep their order: the row ends in the latest state written (or gone).
      const registry::FutureRecord& r = w.record;
      absl::Status s = w.erase ? registry_.DeleteFuture(r.id, r.tenant) : registry_.PutFuture(r);
      if (!s.ok()) LogWarning(kLog, absl::StrCat("recording future ", r.id, ": ", s.message()));
    }
    absl::MutexLock lock(&mu_);
    writing_ = false;
    writing_batch_.reset();
  }
}

void RegistryFutureJournal::Flush() {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queue_.empty() && !writing_; };
  mu_.Await(absl::Condition(&idle));
}

absl::StatusOr<FutureResult> RegistryFutureJournal::Lookup(uint64_t id, const std::string& tenant) {
  // A write not in the registry yet is the latest word on the future (a result just dropped
  // over a bound must not read back as the result).
  std::optional<Write> unwritten;
  {
    absl::MutexLock lock(&mu_);
    auto latest = [&](const std::deque<Write>& writes) {
      for (auto it = writes.rbegin(); it != writes.rend(); ++it) {
        if (it->record.id == id && it->record.tenant == tenant) return std::optional<Write>(*it);
      }
      return std::optional<Write>();
    };
    unwritten = latest(queue_);
    if (!unwritten && writing_batch_ != nullptr) unwritten = latest(*writing_batch_);
  }
  absl::StatusOr<registry::FutureRecord> r = absl::NotFoundError("no such future");
  if (!unwritten) {
    r = registry_.GetFuture(id, tenant);
  } else if (!unwritten->erase) {
    r = unwritten->record;
  }
  const uint64_t boot = id >> kFutureBootShift;
  if (!r.ok()) {
    if (!absl::IsNotFound(r.status())) return r.status();
    // Issued by an earlier boot but never recorded as finished: it was in flight at the
    // crash. (Another tenant's id gets the same answer, revealing nothing.)
    if (boot > 0 && boot < boot_) return FutureResult(InterruptedByRestart());
    return absl::NotFoundError("no such future");
  }
  if (r->state == "done") {
    if (r->result.empty()) return FutureResult(OpOutput{});
    absl::StatusOr<FutureValue> out = StoredValueFromJson(r->result);
    if (!out.ok()) return FutureResult(out.status());
    return FutureResult(*std::move(out));
  }
  if (r->state == "failed") {
    return FutureResult(absl::Status(static_cast<absl::StatusCode>(r->error_code), r->error_message));
  }
  if (boot == boot_) return absl::NotFoundError("no such future");  // ours, only in memory
  return FutureResult(InterruptedByRestart());
}

}  // namespace twinkle::training
