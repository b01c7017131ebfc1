// SamplerCoordinator, the decode threads (one per lane, i.e. per engine that samples): each
// admits its lane's waiting rows into its engine's continuous batch (ipc sample_step), runs
// bounded decode chunks, ends samples early whose text met a stop string, rebuilds snapshots
// and replays its rows after its engine restarts, and turns finished rows into results
// (Collect) and completed futures (Finish). Sessions, snapshots, submission and the spreading
// of rows over lanes are in sampler_coordinator.cc.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/common/log.h"
#include "core/ipc/envelope.h"
#include "core/ipc/training_messages.h"
#include "core/sampling/sampler_coordinator.h"
#include "core/sampling/sampler_state.h"

namespace twinkle::sampling {
namespace {

using sampler_internal::kLog;

// A top-k pair from a sample_step reply: int64 ids and float32 logprobs, both [n, k].
absl::StatusOr<TopLogprobs> ReadTop(const std::optional<ipc::TensorDesc>& ids,
                                    const std::optional<ipc::TensorDesc>& lps, int64_t k,
                                    const std::vector<std::string>& buffers) {
  if (!ids || !lps) return absl::InternalError("sample_step reply: top-k logprobs asked for but missing");
  absl::StatusOr<std::vector<int64_t>> token_ids = ipc::ReadVectorFrame<int64_t>(*ids, buffers, "sample_step reply");
  if (!token_ids.ok()) return token_ids.status();
  absl::StatusOr<std::vector<float>> logprobs = ipc::ReadVectorFrame<float>(*lps, buffers, "sample_step reply");
  if (!logprobs.ok()) return logprobs.status();
  if (token_ids->size() != logprobs->size() || token_ids->size() % static_cast<size_t>(k) != 0) {
    return absl::InternalError(absl::StrCat("sample_step reply: top-k of ", token_ids->size(), " ids and ",
                                            logprobs->size(), " logprobs is not [n, ", k, "]"));
  }
  return TopLogprobs{k, *std::move(token_ids), *std::move(logprobs)};
}

// The prompt's log-probs of a row ([P - 1], top-k [P - 1, k]) aligned as PromptOutput's:
// position 0 predicts nothing (NaN; ids -1 and NaN).
void AlignPromptLogprobs(const std::vector<float>& lps, int64_t k, const std::vector<int64_t>& top_ids,
                         const std::vector<float>& top_lps, std::vector<float>* out, TopLogprobs* top) {
  out->assign(1, std::numeric_limits<float>::quiet_NaN());
  out->insert(out->end(), lps.begin(), lps.end());
  if (k <= 0) return;
  top->k = k;
  top->token_ids.assign(k, -1);
  top->logprobs.assign(k, std::numeric_limits<float>::quiet_NaN());
  top->token_ids.insert(top->token_ids.end(), top_ids.begin(), top_ids.end());
  top->logprobs.insert(top->logprobs.end(), top_lps.begin(), top_lps.end());
}

}  // namespace

void SamplerCoordinator::Finish(Request& request, FutureResult result) {
  std::shared_ptr<Snapshot> released;  // let go after the lock (its deleter takes the graveyard's)
  {
    absl::MutexLock lock(&mu_);
    if (request.finished) return;
    request.finished = true;
    // Other lanes may be admitting rows of this request right now: they copy the pointer
    // under mu_, so it is reset under mu_ too.
    released = std::move(request.snapshot);
    if (--in_flight_by_tenant_[request.tenant] <= 0) in_flight_by_tenant_.erase(request.tenant);
    // Its other rows leave the engines' batches and the waiting lines, on every lane.
    for (const std::unique_ptr<Lane>& lane : lanes_) {
      for (auto it = lane->running.begin(); it != lane->running.end();) {
        if (it->second->request.get() == &request) {
          lane->cancel.push_back(it->first);
          it = lane->running.erase(it);
        } else {
          ++it;
        }
      }
      std::erase_if(lane->waiting, [&](const std::shared_ptr<Row>& r) { return r->request.get() == &request; });
    }
  }
  released.reset();
  futures_.Complete(request.future_id, std::move(result));
}

void SamplerCoordinator::Collect(Row& row, const ipc::SampleRowResultMsg& result,
                                 const std::vector<std::string>& buffers) {
  Request& request = *row.request;
  PromptOutput& out = request.output.prompts[row.prompt_index];
  for (const ipc::SampledSequenceMsg& s : result.samples) {
    absl::StatusOr<std::vector<int64_t>> tokens = ipc::ReadVectorFrame<int64_t>(s.tokens, buffers, "sample_step reply");
    absl::StatusOr<std::vector<float>> logprobs = ipc::ReadVectorFrame<float>(s.logprobs, buffers, "sample_step reply");
    if (!tokens.ok() || !logprobs.ok()) {
      Finish(request, tokens.ok() ? logprobs.status() : tokens.status());
      return;
    }
    SampledSequence seq{*std::move(tokens), *std::move(logprobs), s.stop_reason, {}};
    if (const int64_t k = request.params.top_logprobs; k > 0) {
      absl::StatusOr<TopLogprobs> top = ReadTop(s.top_token_ids, s.top_logprobs, k, buffers);
      if (!top.ok()) {
        Finish(request, top.status());
        return;
      }
      seq.top_logprobs = *std::move(top);
    }
    if (!request.params.stop_strings.empty() && token_text_) {
      if (std::optional<size_t> n = token_text_->TokensThroughFirstStop(seq.tokens, request.params.stop_strings)) {
        seq.tokens.resize(*n);
        seq.logprobs.resize(std::min(seq.logprobs.size(), *n));
        TopLogprobs& top = seq.top_logprobs;
        const size_t cells = std::min(top.token_ids.size(), *n * static_cast<size_t>(top.k));
        top.token_ids.resize(cells);
        top.logprobs.resize(cells);
        seq.stop_reason = "stop";
      }
    }
    out.sequences.push_back(std::move(seq));
  }
  const size_t first_sequence = out.sequences.size() - result.samples.size();
  if (request.params.prompt_logprobs) {
    out.prompt_logprobs.assign(1, std::numeric_limits<float>::quiet_NaN());
    if (result.prompt_logprobs) {
      absl::StatusOr<std::vector<float>> lp = ipc::ReadVectorFrame<float>(*result.prompt_logprobs, buffers, "sample_step reply");
      if (!lp.ok()) {
        Finish(request, lp.status());
        return;
      }
      out.prompt_logprobs.insert(out.prompt_logprobs.end(), lp->begin(), lp->end());
    }
  }
  if (const int64_t k = request.params.prompt_top_logprobs; k > 0) {
    absl::StatusOr<TopLogprobs> top = ReadTop(result.prompt_top_token_ids, result.prompt_top_logprobs, k, buffers);
    if (!top.ok()) {
      Finish(request, top.status());
      return;
    }
    // Position 0 has no distribution: it gets placeholder cells, so position i is prompt[i]'s.
    TopLogprobs& aligned = out.prompt_top_logprobs;
    aligned.k = k;
    aligned.token_ids.assign(k, -1);
    aligned.logprobs.assign(k, std::numeric_limits<float>::quiet_NaN());
    aligned.token_ids.insert(aligned.token_ids.end(), top->token_ids.begin(), top->token_ids.end());
    aligned.logprobs.insert(aligned.logprobs.end(), top->logprobs.begin(), top->logprobs.end());
  }
  if (request.streams()) {
    // A row that finished before any progress report: its prompt log-probs come from here.
    if (request.params.prompt_logprobs && row.prompt_logprobs.empty()) {
      row.prompt_logprobs = out.prompt_logprobs;
      row.prompt_top_logprobs = out.prompt_top_logprobs;
    }
    for (size_t s = first_sequence; s < out.sequences.size(); ++s) {
      const SampledSequence& seq = out.sequences[s];
      EmitDelta(row, s - first_sequence, seq, seq.tokens.size(), seq.stop_reason);
    }
  }
  if (request.params.target_prompt_width > 0) {
    absl::StatusOr<std::vector<float>> lp =
        result.target_prompt_logprobs
            ? ipc::ReadVectorFrame<float>(*result.target_prompt_logprobs, buffers, "sample_step reply")
            : absl::InternalError("sample_step reply: no target_prompt_logprobs");
    if (!lp.ok()) {
      Finish(request, lp.status());
      return;
    }
    out.target_prompt_logprobs = *std::move(lp);
  }
  if (request.params.prompt_alt_tokens_k > 0) {
    if (!result.prompt_alt_token_ids || !result.prompt_alt_logprobs) {
      Finish(request, absl::InternalError("sample_step reply: no prompt_alt_tokens"));
      return;
    }
    absl::StatusOr<std::vector<int64_t>> ids =
        ipc::ReadVectorFrame<int64_t>(*result.prompt_alt_token_ids, buffers, "sample_step reply");
    absl::StatusOr<std::vector<float>> lps =
        ipc::ReadVectorFrame<float>(*result.prompt_alt_logprobs, buffers, "sample_step reply");
    if (!ids.ok() || !lps.ok()) {
      Finish(request, ids.ok() ? lps.status() : ids.status());
      return;
    }
    out.prompt_alt_token_ids = *std::move(ids);
    out.prompt_alt_logprobs = *std::move(lps);
  }
  bool done = false;
  {
    absl::MutexLock lock(&mu_);
    done = --request.rows_left == 0;
  }
  if (!done) return;
  if (usage_listener_) {
    SampleUsage usage{request.tenant, request.key_id, request.usage_session, 0, 0};
    for (const std::vector<int64_t>& prompt : request.prompts) usage.prefill_tokens += static_cast<int64_t>(prompt.size());
    for (const PromptOutput& p : request.output.prompts) {
      for (const SampledSequence& s : p.sequences) usage.sampled_tokens += static_cast<int64_t>(s.tokens.size());
    }
    usage_listener_(usage);
  }
  Finish(request, FutureValue(std::move(request.output)));
}

absl::Status SamplerCoordinator::EnsureOnEngine(Lane& lane, Snapshot& snapshot) {
  uint64_t& on_engine = snapshot.engine_generation[lane.index];
  if (on_engine != 0 && on_engine == lane.generation) return absl::OkStatus();
  training::EngineLink& engine = *lane.engine;
  absl::StatusOr<ipc::Message> created =
      engine.Call(ipc::MakeRequest(ipc::kMethodCreateAdapter, ipc::Pack(snapshot.weights.config)));
  if (!created.ok()) return created.status();
  ipc::SetAdapterStateRequest set;
  set.adapter_id = snapshot.engine_id;
  set.weights = snapshot.weights.weights;
  absl::StatusOr<ipc::Message> r =
      engine.Call(ipc::MakeRequest(ipc::kMethodSetAdapterState, ipc::Pack(set), snapshot.weights.buffers));
  if (!r.ok()) {
    (void)engine.Call(ipc::MakeRequest(ipc::kMethodRemoveAdapter, ipc::Pack(ipc::AdapterRequest{snapshot.engine_id})));
    return r.status();
  }
  on_engine = lane.generation;
  return absl::OkStatus();
}

void SamplerCoordinator::RemoveDeadSnapshots(Lane& lane) {
  std::vector<std::string> dead;
  {
    absl::MutexLock lock(&graveyard_->mu);
    dead.swap(graveyard_->engine_ids[lane.index]);
  }
  for (const std::string& id : dead) {
    absl::StatusOr<ipc::Message> r = lane.engine->Call(ipc::MakeRequest(ipc::kMethodRemoveAdapter, ipc::Pack(ipc::AdapterRequest{id})));
    if (!r.ok()) LogWarning(kLog, absl::StrCat("removing snapshot ", id, ": ", r.status().message()));
  }
}

void SamplerCoordinator::EmitDelta(Row& row, size_t sample, const SampledSequence& so_far, size_t upto,
                                   const std::string& finish_reason) {
  SampleStream& stream = *row.request->stream;
  if (sample >= row.emitted.size() || stream.cancelled()) return;
  size_t& emitted = row.emitted[sample];
  const std::vector<int64_t>& tokens = so_far.tokens;
  upto = std::min(upto, tokens.size());
  if (upto <= emitted && finish_reason.empty()) return;
  StreamDelta delta;
  delta.prompt_index = row.prompt_index;
  delta.sample = static_cast<int64_t>(sample);
  if (emitted == 0) {  // the sample's first delta
    delta.prompt_logprobs = row.prompt_logprobs;
    delta.prompt_top_logprobs = row.prompt_top_logprobs;
  }
  if (upto > emitted) {
    const auto from = static_cast<std::ptrdiff_t>(emitted), to = static_cast<std::ptrdiff_t>(upto);
    delta.tokens.assign(tokens.begin() + from, tokens.begin() + to);
    if (so_far.logprobs.size() >= upto) {
      delta.logprobs.assign(so_far.logprobs.begin() + from, so_far.logprobs.begin() + to);
    }
    if (const int64_t k = row.request->params.top_logprobs; k > 0 && so_far.top_logprobs.token_ids.size() >= upto * k) {
      delta.top_logprobs.k = k;
      delta.top_logprobs.token_ids.assign(so_far.top_logprobs.token_ids.begin() + from * k,
                                          so_far.top_logprobs.token_ids.begin() + to * k);
      delta.top_logprobs.logprobs.assign(so_far.top_logprobs.logprobs.begin() + from * k,
                                         so_far.top_logprobs.logprobs.begin() + to * k);
    }
  }
  emitted = std::max(emitted, upto);
  delta.finish_reason = finish_reason;
  stream.on_delta_(delta);
}

void SamplerCoordinator::DecodeLoop(Lane& lane) {
  training::EngineLink& engine = *lane.engine;
  while (true) {
    std::vector<std::shared_ptr<Row>> admit;
    std::vector<uint64_t> cancel;
    bool have_running = false;
    bool streaming = false;  // a streaming row is running or admitted: decode one step per call
    {
      // Streams whose consumer left: their requests end here (Finish drops their rows).
      std::vector<std::shared_ptr<Request>> cancelled;
      {
        absl::MutexLock lock(&mu_);
        auto gone = [&](const std::shared_ptr<Row>& row) {
          const Request& r = *row->request;
          if (r.stream != nullptr && r.stream->cancelled() && !r.finished) cancelled.push_back(row->request);
        };
        for (const std::shared_ptr<Row>& row : lane.waiting) gone(row);
        for (const auto& [id, row] : lane.running) gone(row);
      }
      for (const std::shared_ptr<Request>& r : cancelled) {
        Finish(*r, absl::CancelledError("the client of the request went away"));
      }
    }
    {
      absl::MutexLock lock(&mu_);
      while (!stop_ && lane.waiting.empty() && lane.running.empty() && lane.cancel.empty()) {
        // Wake now and then to free snapshots whose last session closed.
        lane.wake.WaitWithTimeout(&mu_, absl::Milliseconds(500));
        absl::MutexLock dead(&graveyard_->mu);
        if (!graveyard_->engine_ids[lane.index].empty()) break;
      }
      if (stop_) break;
      admit.assign(lane.waiting.begin(), lane.waiting.end());
      cancel.swap(lane.cancel);
      have_running = !lane.running.empty();
      for (const auto& [id, row] : lane.running) streaming |= row->request->streams();
      for (const std::shared_ptr<Row>& row : admit) streaming |= row->request->streams();
    }
    // A new engine process holds neither snapshots nor running rows: rebuild, replay.
    const uint64_t gen = engine.generation();
    if (gen != lane.generation) {
      if (lane.generation != 0) {
        LogWarning(kLog, absl::StrCat("lane ", lane.index,
                                      ": engine restarted: replaying the running sampling requests"));
      }
      lane.generation = gen;
      lane.reset_engine = true;
      lane.early_stops.clear();  // the replayed rows start over
      absl::MutexLock lock(&mu_);
      std::vector<std::shared_ptr<Row>> replay;
      for (auto& [id, row] : lane.running) replay.push_back(row);  // by engine id = arrival order
      lane.running.clear();
      lane.waiting.insert(lane.waiting.begin(), replay.begin(), replay.end());
      admit.assign(lane.waiting.begin(), lane.waiting.end());
      cancel.clear();
      have_running = false;
    }
    RemoveDeadSnapshots(lane);
    if (admit.empty() && !have_running && cancel.empty()) continue;

    ipc::SampleStepRequest step;
    std::vector<std::string> buffers;
    step.reset = lane.reset_engine;
    step.cancel = std::move(cancel);
    for (const auto& [id, sample] : lane.early_stops) step.stop.push_back({id, sample});
    lane.early_stops.clear();
    step.max_decode_steps =
        streaming ? std::min(options_.stream_decode_steps_per_call, options_.max_decode_steps_per_call)
                  : options_.max_decode_steps_per_call;
    std::map<uint64_t, std::shared_ptr<Row>> admitted;
    for (const std::shared_ptr<Row>& row : admit) {
      Request& request = *row->request;
      // The request's rows may be on several lanes, and another lane's thread may finish it
      // (and drop its snapshot) at any time: this lane works on a copy taken under mu_.
      std::shared_ptr<Snapshot> snapshot;
      {
        absl::MutexLock lock(&mu_);
        if (request.finished) continue;
        snapshot = request.snapshot;
      }
      if (snapshot != nullptr) {
        if (absl::Status s = EnsureOnEngine(lane, *snapshot); !s.ok()) {
          Finish(request, absl::Status(s.code(), absl::StrCat("loading the sampler weights of ", snapshot->source,
                                                              ": ", s.message())));
          continue;
        }
      }
      ipc::SampleAdmitMsg msg;
      msg.request_id = row->engine_id;
      ipc::SampleRowMsg& r = msg.row;
      r.adapter_id = snapshot != nullptr ? snapshot->engine_id : "";
      r.prompt_tokens = ipc::AppendVectorFrame(request.prompts[row->prompt_index], buffers);
      r.max_tokens = request.params.max_tokens;
      r.temperature = request.params.temperature;
      r.top_p = request.params.top_p;
      r.top_k = request.params.top_k;
      r.repetition_penalty = request.params.repetition_penalty;
      r.presence_penalty = request.params.presence_penalty;
      r.frequency_penalty = request.params.frequency_penalty;
      r.min_p = request.params.min_p;
      r.stop_token_ids = request.params.stop_token_ids;
      if (!request.params.ignore_eos) {
        r.stop_token_ids.insert(r.stop_token_ids.end(), eos_token_ids_.begin(), eos_token_ids_.end());
      }
      r.seed = *request.params.seed + row->prompt_index;  // prompts of one request draw independently
      r.num_samples = request.params.num_samples;
      r.want_prompt_logprobs = request.params.prompt_logprobs;
      r.top_logprobs = request.params.top_logprobs;
      r.prompt_top_logprobs = request.params.prompt_top_logprobs;
      if (const int64_t width = request.params.target_prompt_width; width > 0) {
        r.target_prompt_tokens = ipc::AppendVectorFrame(request.params.target_prompt_tokens, buffers);
        r.target_prompt_tokens->shape = {static_cast<int64_t>(request.params.target_prompt_tokens.size()) / width,
                                         width};
      }
      r.prompt_alt_tokens_k = request.params.prompt_alt_tokens_k;
      // Stop strings are matched on the decoded text as tokens arrive (the progress loop below);
      // the final result is cut again in Collect, so the early stop only saves decoding.
      // Streaming rows report every step's tokens too, for their stream.
      r.report_tokens =
          (!request.params.stop_strings.empty() && token_text_.has_value()) || request.streams();
      if (r.report_tokens) {
        row->partial.assign(request.params.num_samples, {});
        row->stop_sent.assign(request.params.num_samples, false);
      }
      // Kept across a replay after an engine restart: the seeded rows decode the same tokens
      // again, and the stream goes on after what it already has.
      if (request.streams() && row->emitted.empty()) row->emitted.assign(request.params.num_samples, 0);
      if (request.streams()) row->partial_streamed.assign(request.params.num_samples, {});
      step.admit.push_back(std::move(msg));
      admitted.emplace(row->engine_id, row);
    }
    absl::StatusOr<ipc::Message> reply =
        engine.Call(ipc::MakeRequest(ipc::kMethodSampleStep, ipc::Pack(step), std::move(buffers)));
    if (!reply.ok()) {
      if (engine.generation() != lane.generation) continue;  // restarted under us: replay
      // The worker refused the call itself: fail what it carried, keep the rest.
      // While a worker is down every retry fails alike; log each distinct error once.
      if (reply.status().message() != lane.last_step_error) {
        lane.last_step_error = std::string(reply.status().message());
        LogError(kLog, absl::StrCat("lane ", lane.index, ": sample_step failed: ", lane.last_step_error));
      }
      for (auto& [id, row] : admitted) Finish(*row->request, reply.status());
      absl::SleepFor(absl::Milliseconds(50));
      continue;
    }
    lane.reset_engine = false;
    lane.last_step_error.clear();
    absl::StatusOr<ipc::SampleStepReply> body = ipc::Unpack<ipc::SampleStepReply>(reply->envelope.body, "sample_step reply");
    if (!body.ok()) {
      LogError(kLog, std::string(body.status().message()));
      for (auto& [id, row] : admitted) Finish(*row->request, body.status());
      continue;
    }
    std::set<uint64_t> deferred(body->deferred.begin(), body->deferred.end());
    std::vector<std::pair<std::shared_ptr<Row>, std::string>> rejected;
    std::vector<std::pair<std::shared_ptr<Row>, const ipc::SampleRowResultMsg*>> finished;
    std::vector<std::pair<std::shared_ptr<Row>, const ipc::SampleProgressMsg*>> progress;
    {
      absl::MutexLock lock(&mu_);
      // Admitted rows leave the waiting line (deferred ones stay, in order).
      std::erase_if(lane.waiting, [&](const std::shared_ptr<Row>& r) {
        return admitted.count(r->engine_id) != 0 && deferred.count(r->engine_id) == 0;
      });
      for (const auto& [id, row] : admitted) {
        if (deferred.count(id) != 0) continue;
        if (!row->request->finished) {
          lane.running[id] = row;
        } else {
          lane.cancel.push_back(id);  // finished meanwhile by another lane: drop it from the batch
        }
      }
      for (const ipc::SampleRejectedMsg& r : body->rejected) {
        if (auto it = lane.running.find(r.request_id); it != lane.running.end()) {
          rejected.emplace_back(it->second, r.error);
          lane.running.erase(it);
        }
      }
      for (const ipc::SampleFinishedMsg& f : body->finished) {
        if (auto it = lane.running.find(f.request_id); it != lane.running.end()) {
          finished.emplace_back(it->second, &f.result);
          lane.running.erase(it);
        }
      }
      for (const ipc::SampleProgressMsg& m : body->progress) {
        if (auto it = lane.running.find(m.request_id); it != lane.running.end()) progress.emplace_back(it->second, &m);
      }
      lane.blocks_in_use = body->blocks_in_use;
      lane.blocks_total = body->blocks_total;
      lane.block_size = body->block_size;
      lane.states_in_use = body->states_in_use;
      lane.states_total = body->states_total;
    }
    for (auto& [row, m] : progress) {
      const Request& request = *row->request;
      if (request.streams() && request.params.prompt_logprobs &&
          (!m->prompt_logprobs.empty() || !m->prompt_top_token_ids.empty())) {
        AlignPromptLogprobs(m->prompt_logprobs, request.params.prompt_top_logprobs, m->prompt_top_token_ids,
                            m->prompt_top_logprobs, &row->prompt_logprobs, &row->prompt_top_logprobs);
      }
      const size_t sample = static_cast<size_t>(m->sample);
      if (sample >= row->partial.size() || row->stop_sent[sample]) continue;
      std::vector<int64_t>& tokens = row->partial[sample];
      tokens.insert(tokens.end(), m->tokens.begin(), m->tokens.end());
      size_t upto = tokens.size();
      const std::vector<std::string>& stops = row->request->params.stop_strings;
      if (!stops.empty() && token_text_) {
        if (std::optional<size_t> n = token_text_->TokensThroughFirstStop(tokens, stops)) {
          row->stop_sent[sample] = true;
          lane.early_stops.emplace_back(row->engine_id, m->sample);
          upto = *n;  // a stream never sees the tokens after the stop string's end
        }
      }
      if (row->request->streams() && sample < row->partial_streamed.size()) {
        SampledSequence& so_far = row->partial_streamed[sample];
        so_far.tokens.insert(so_far.tokens.end(), m->tokens.begin(), m->tokens.end());  // = `tokens`
        so_far.logprobs.insert(so_far.logprobs.end(), m->logprobs.begin(), m->logprobs.end());
        so_far.top_logprobs.k = row->request->params.top_logprobs;
        so_far.top_logprobs.token_ids.insert(so_far.top_logprobs.token_ids.end(), m->top_token_ids.begin(),
                                             m->top_token_ids.end());
        so_far.top_logprobs.logprobs.insert(so_far.top_logprobs.logprobs.end(), m->top_logprobs.begin(),
                                            m->top_logprobs.end());
        EmitDelta(*row, sample, so_far, upto, "");
      }
    }
    for (auto& [row, error] : rejected) Finish(*row->request, absl::InvalidArgumentError(error));
    int64_t generated = 0;
    for (auto& [row, result] : finished) {
      for (const ipc::SampledSequenceMsg& s : result->samples) {
        generated += s.tokens.shape.empty() ? 0 : s.tokens.shape[0];
      }
    }
    {
      // Counted before the futures complete, so a caller who has its result sees it counted.
      absl::MutexLock lock(&mu_);
      lane.tokens_generated += generated;
    }
    for (auto& [row, result] : finished) Collect(*row, *result, reply->buffers);
  }
  // Shutting down: nothing more will run on this lane.
  std::vector<std::shared_ptr<Request>> pending;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& row : lane.waiting) pending.push_back(row->request);
    for (const auto& [id, row] : lane.running) pending.push_back(row->request);
  }
  for (const auto& r : pending) Finish(*r, absl::UnavailableError("the server is shutting down"));
}

}  // namespace twinkle::sampling
