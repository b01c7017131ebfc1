// TinkerApi's futures: request ids ("tk-<future id>": futures of the one FutureStore,
// completed with the encoded answer) and the entries behind them (NewEntry, Complete,
// Attach, Promise), their expiry (Housekeep), seq_id ordering per model (Sequenced,
// DrainLocked, ArmGapTimer) and retrieve_future's long poll; also what a finished future or
// a direct call's error answers (FailureJson, ErrorCategory, HttpStatusFor). Every
// training and sampling call of tinker_api.cc and tinker_sampling.cc submits through here.
#include "server/tinker/tinker_api.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/common/log.h"
#include "core/sampling/sampler_coordinator.h"
#include "server/status_map.h"
#include "server/tinker/stored_result.h"
#include "server/tinker/tinker_codec.h"
#include "server/tinker/tinker_internal.h"

namespace twinkle::tinker {

namespace {

// Transient refusals the SDK should retry with the same ids (nothing was accepted).
bool Transient(const absl::Status& s) {
  return absl::IsResourceExhausted(s) || absl::IsUnavailable(s);
}

}  // namespace

const char* ErrorCategory(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kCancelled:
      return "user";
    default:
      return "server";
  }
}

int HttpStatusFor(const absl::Status& status) { return ToHttpStatus(status); }

Json FailureJson(const absl::Status& status) {
  return {{"error", std::string(status.message())}, {"category", ErrorCategory(status)}};
}

Outcome Outcome::Of(const OpResult& result) {
  Outcome o;
  o.json = ToJson(result);
  o.proto = StoredProto(result);
  return o;
}

void TinkerApi::Housekeep() {
  // Results live in the FutureStore (bounded and expired there: count, bytes and age per
  // tenant); every table here that is keyed by a request follows it, so none of them grows
  // past the store's bounds however long a model or a loop lives.
  const absl::Time cutoff = absl::Now() - options_.retention;
  std::vector<std::shared_ptr<Model>> models;
  {
    absl::MutexLock lock(&mu_);
    // An entry answers a replayed request with its promise, while its future is held.
    absl::erase_if(entries_, [&](const auto& e) {
      return e.second->created < cutoff || !futures_.Holds(e.second->future);
    });
    // A dedupe key outlives nothing it points at (asample adds one per call).
    absl::erase_if(dedupe_, [&](const auto& d) { return !entries_.contains(d.second); });
    // create_sampling_session's answer is replayed while its sampling session is open.
    absl::erase_if(direct_dedupe_, [&](const auto& d) {
      return served_.OfSamplingSession(d.second.tenant.id, d.second.sampling_session_id) == nullptr;
    });
    for (const auto& [key, model] : models_) models.push_back(model);
  }
  // A seq_id's record (for idempotent replays) goes with its request's future. Taken after
  // mu_ is released: Sequenced locks a model before mu_.
  for (const std::shared_ptr<Model>& model : models) {
    absl::MutexLock lock(&model->mu);
    std::erase_if(model->by_seq, [&](const auto& r) {
      uint64_t id = 0;
      return absl::SimpleAtoi(absl::string_view(r.second.request_id).substr(sizeof(kRequestIdPrefix) - 1), &id) &&
             !futures_.Holds(id);
    });
  }
  timers_->After(absl::Seconds(60), [this] { Housekeep(); });
}

std::shared_ptr<TinkerApi::Entry> TinkerApi::NewEntry(const std::string& tenant, const std::string& model_id) {
  // A request id is a future of the one store: journaled, bounded and retrievable after a
  // restart like every other future.
  auto e = std::make_shared<Entry>();
  e->future = NewFutureId();
  e->request_id = absl::StrCat(kRequestIdPrefix, e->future);
  e->tenant = tenant;
  e->model_id = model_id;
  e->store = &futures_;
  e->created = absl::Now();
  futures_.Create(e->future, tenant);
  absl::MutexLock lock(&mu_);
  entries_[e->request_id] = e;
  return e;
}

void TinkerApi::Complete(const std::shared_ptr<Entry>& entry, Outcome outcome) {
  if (!outcome.error.ok()) {
    entry->store->Complete(entry->future, outcome.error);
    return;
  }
  // What retrieve_future answers, encoded once (invalid UTF-8 in text is replaced, never thrown).
  EncodedResult encoded{outcome.json.dump(-1, ' ', false, Json::error_handler_t::replace), std::move(outcome.proto)};
  entry->store->Complete(entry->future, FutureValue(std::move(encoded)));
}

void TinkerApi::Attach(const std::shared_ptr<Entry>& entry, uint64_t future_id, Encoder encode) {
  FutureStore* store = &futures_;
  absl::Status s = futures_.OnComplete(
      future_id, entry->tenant, [entry, store, future_id, encode = std::move(encode)](const FutureResult& result) {
        Outcome outcome = result.ok() ? encode(*result) : Outcome::Failed(result.status());
        // The request id's future takes the answer; the op's own result is not needed (and
        // is released first, so it never counts against the tenant's bound beside it).
        store->Release(future_id);
        Complete(entry, std::move(outcome));
      });
  if (!s.ok()) Complete(entry, Outcome::Failed(s));
}

FuturePromise TinkerApi::Promise(const Entry& entry) const {
  return FuturePromise{entry.request_id, entry.model_id, entry.sample_sequence_ids};
}

// ---- seq_id ordering -----------------------------------------------------------------------

absl::StatusOr<FuturePromise> TinkerApi::Sequenced(const tenancy::Tenant& tenant, const std::shared_ptr<Model>& model,
                                                   int64_t seq_id, OpIdentity op, Submit submit, Encoder encode) {
  absl::MutexLock lock(&model->mu);
  if (seq_id > 0) {
    auto seen = model->by_seq.find(seq_id);
    if (seen != model->by_seq.end()) {
      const Model::SeqRecord& first = seen->second;
      if (first.op != op.name) {
        return sched::IdempotencyConflict(absl::StrCat("seq_id ", seq_id, " of model ", model->model_id,
                                                       " was already used for a ", first.op, "; this ", op.name,
                                                       " needs a seq_id of its own"));
      }
      if (first.fingerprint != 0 && op.fingerprint != 0 && first.fingerprint != op.fingerprint) {
        return sched::IdempotencyConflict(absl::StrCat("seq_id ", seq_id, " of model ", model->model_id,
                                                       " was already used for a ", first.op,
                                                       " with a different request body"));
      }
      absl::MutexLock map_lock(&mu_);
      auto e = entries_.find(first.request_id);
      if (e != entries_.end()) return Promise(*e->second);
    }
  }
  // Admission, on both paths: nothing is buffered or queued past the tenant's limits.
  const tenancy::Quotas& quotas = tenant.quotas;
  if (op.tokens > quotas.max_tokens_per_request) {
    return absl::FailedPreconditionError(absl::StrCat("data: ", op.tokens, " tokens, above your quota of ",
                                                      quotas.max_tokens_per_request,
                                                      " per request (max_tokens_per_request)"));
  }
  const bool ahead = seq_id > model->next_seq;
  {
    absl::MutexLock map_lock(&mu_);
    const std::pair<int64_t, int64_t> buffered = buffered_[tenant.id];
    const int64_t pending = buffered.first + QueuedFor(tenant.id);
    if (pending >= quotas.max_pending_ops) {
      return absl::ResourceExhaustedError(absl::StrCat("you have ", pending, " queued or buffered ops, your quota ",
                                                       "(max_pending_ops) is ", quotas.max_pending_ops,
                                                       "; wait for some to finish"));
    }
    if (ahead && buffered.second + op.tokens > quotas.max_buffered_tokens) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "you have ", buffered.second, " tokens of ops waiting for earlier seq_ids; this one's ", op.tokens,
          " would pass your quota (max_buffered_tokens) of ", quotas.max_buffered_tokens,
          "; send the missing seq_ids or wait for the gap to time out"));
    }
  }
  if (rate_limiter_ != nullptr && op.tokens > 0) {
    if (absl::Status s = rate_limiter_->Acquire(tenant, op.tokens); !s.ok()) return s;
  }
  if (ahead) {
    // Ahead of its turn: wait for the gap to fill (or time out).
    std::shared_ptr<Entry> entry = NewEntry(model->tenant, model->model_id);
    model->by_seq[seq_id] = Model::SeqRecord{entry->request_id, op.name, op.fingerprint};
    model->buffered[seq_id] = Model::Waiting{entry, std::move(submit), std::move(encode), tenant, op.tokens,
                                             absl::Now()};
    {
      absl::MutexLock map_lock(&mu_);
      auto& [count, tokens] = buffered_[tenant.id];
      ++count;
      tokens += op.tokens;
    }
    if (model->buffered.begin()->first == seq_id) ArmGapTimer(model);
    return Promise(*entry);
  }
  // In order (or unordered: no seq_id, or one whose turn was skipped): submit now, so a
  // refusal is the direct answer.
  absl::StatusOr<uint64_t> id = submit();
  if (!id.ok() && rate_limiter_ != nullptr && op.tokens > 0) rate_limiter_->Refund(tenant, op.tokens);
  if (!id.ok() && Transient(id.status())) return id.status();  // not accepted: the SDK retries it
  if (!id.ok() && sched::IsIdempotencyConflict(id.status())) {
    // The key belongs to another op: answer directly (400), remember nothing; the seq_id's
    // turn is over all the same (the SDK does not resend a 400).
    if (seq_id == model->next_seq) {
      model->next_seq = seq_id + 1;
      DrainLocked(*model);
      ArmGapTimer(model);
    }
    return id.status();
  }
  std::shared_ptr<Entry> entry = NewEntry(model->tenant, model->model_id);
  if (id.ok()) {
    Attach(entry, *id, std::move(encode));
  } else {
    Complete(entry, Outcome::Failed(id.status()));
  }
  if (seq_id > 0) model->by_seq[seq_id] = Model::SeqRecord{entry->request_id, op.name, op.fingerprint};
  if (seq_id == model->next_seq) {
    model->next_seq = seq_id + 1;
    DrainLocked(*model);
    ArmGapTimer(model);
  }
  // Bound the dedupe table.
  while (model->by_seq.size() > 4096) model->by_seq.erase(model->by_seq.begin());
  return Promise(*entry);
}

void TinkerApi::DrainLocked(Model& model) {
  while (!model.buffered.empty() && model.buffered.begin()->first <= model.next_seq) {
    auto node = model.buffered.extract(model.buffered.begin());
    Model::Waiting& w = node.mapped();
    {
      absl::MutexLock map_lock(&mu_);
      auto& [count, tokens] = buffered_[w.tenant.id];
      --count;
      tokens -= w.tokens;
    }
    absl::StatusOr<uint64_t> id = w.submit();
    if (id.ok()) {
      Attach(w.entry, *id, std::move(w.encode));
    } else {
      if (rate_limiter_ != nullptr && w.tokens > 0) rate_limiter_->Refund(w.tenant, w.tokens);
      Complete(w.entry, Outcome::Failed(id.status()));
    }
    model.next_seq = std::max(model.next_seq, node.key() + 1);
  }
}

void TinkerApi::ArmGapTimer(const std::shared_ptr<Model>& model) {
  if (model->buffered.empty()) return;
  const absl::Time due = model->buffered.begin()->second.arrived + options_.seq_gap_timeout;
  std::weak_ptr<Model> weak = model;
  timers_->After(std::max(due - absl::Now(), absl::ZeroDuration()), [this, weak] {
    std::shared_ptr<Model> m = weak.lock();
    if (m == nullptr) return;
    absl::MutexLock lock(&m->mu);
    if (m->buffered.empty()) return;
    const auto& [first, waiting] = *m->buffered.begin();
    if (waiting.arrived + options_.seq_gap_timeout > absl::Now()) {
      ArmGapTimer(m);  // a later arrival is first now: its own gap, its own time
      return;
    }
    LogWarning(kLog, absl::StrCat("model ", m->model_id, ": seq_id ", m->next_seq, " did not arrive within ",
                                  absl::FormatDuration(options_.seq_gap_timeout), "; continuing with seq_id ",
                                  first));
    m->next_seq = first;
    DrainLocked(*m);
    ArmGapTimer(m);  // the next gap, timed from its own first op's arrival
  });
}

// ---- futures ----------------------------------------------------------------------------------

namespace {

// A request id's future id, or NotFound.
absl::StatusOr<uint64_t> FutureIdOf(const std::string& request_id) {
  uint64_t id = 0;
  if (!absl::StartsWith(request_id, kRequestIdPrefix) ||
      !absl::SimpleAtoi(absl::string_view(request_id).substr(sizeof(kRequestIdPrefix) - 1), &id) || id == 0) {
    return absl::NotFoundError(absl::StrCat("request_id: no future '", request_id, "'"));
  }
  return id;
}

// What a finished request id's future answers: the encodings stored at completion, as
// they are (each transport reads its own).
void FillPoll(const FutureResult& result, Poll& poll) {
  poll.done = true;
  if (!result.ok()) {
    poll.error = result.status();
    return;
  }
  absl::StatusOr<const EncodedResult*> encoded = ValueAs<EncodedResult>(*result, "Tinker answer");
  if (!encoded.ok()) {
    poll.error = encoded.status();
    return;
  }
  poll.result = **encoded;
}

}  // namespace

void TinkerApi::RetrieveFuture(const tenancy::Tenant& tenant, const RetrieveFutureRequest& request,
                               std::function<void(absl::StatusOr<Poll>)> done) {
  absl::StatusOr<uint64_t> future = FutureIdOf(request.request_id);
  if (!future.ok()) return done(future.status());
  // Whichever comes first answers: the completion or the long-poll timer.
  auto answered = std::make_shared<std::atomic<bool>>(false);
  auto shared_done = std::make_shared<std::function<void(absl::StatusOr<Poll>)>>(std::move(done));
  const std::string id = request.request_id;
  // The store answers from memory, or from the journal for a request of an earlier boot.
  absl::StatusOr<uint64_t> registered =
      futures_.Await(*future, tenant.id, [answered, shared_done, id](const FutureResult& result) {
        if (answered->exchange(true)) return;
        // An op the restart interrupted is the call's error (HTTP 410): the SDK resubmits.
        if (!result.ok() && IsInterruptedByRestart(result.status())) return (*shared_done)(result.status());
        Poll p;
        FillPoll(result, p);
        p.request_id = id;
        (*shared_done)(std::move(p));
      });
  if (!registered.ok()) {
    if (answered->exchange(true)) return;
    if (absl::IsNotFound(registered.status())) {
      return (*shared_done)(absl::NotFoundError(absl::StrCat("request_id: no future '", id, "'")));
    }
    return (*shared_done)(registered.status());
  }
  if (answered->load()) return;
  timers_->After(options_.long_poll, [this, answered, shared_done, id, future = *future, token = *registered] {
    if (answered->exchange(true)) return;
    futures_.Unwait(future, token);  // a poll that gave up leaves nothing on the future
    Poll p;
    p.request_id = id;
    (*shared_done)(std::move(p));
  });
}

}  // namespace twinkle::tinker
