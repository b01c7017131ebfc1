#include "core/engine/sampler/sampler.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <limits>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/common/splitmix.h"
#include "core/engine/tensor_io.h"

namespace twinkle::engine {
namespace {

// The generator stream of prompt_alt_tokens_k's draws: (seed, this), never a sample's (seed, s).
constexpr uint64_t kAltTokensStream = 0xa17a17a17a17a17aULL;

// One token from a float32 [vocab] row of logits (host memory), as sampler.h describes.
// `logits` are the penalised ones when the row has penalties (Penalised).
int64_t ChooseToken(const at::Tensor& logits, const ipc::SampleRowMsg& row, at::Generator& gen) {
  if (row.temperature == 0) return logits.argmax().item<int64_t>();
  at::Tensor scores = logits / row.temperature;
  const int64_t vocab = scores.size(0);
  if (row.top_k > 0 && row.top_k < vocab) {
    // TopKLogitsWarper: remove scores < the k-th largest (ties with it stay).
    const at::Tensor kth = std::get<0>(scores.topk(row.top_k)).select(0, row.top_k - 1);
    scores = scores.masked_fill(scores < kth, -std::numeric_limits<float>::infinity());
  }
  if (row.top_p < 1.0) {
    // TopPLogitsWarper: ascending sort, remove where cumulative probability <= 1 - top_p,
    // keep the last (most likely) token whatever happens.
    auto [sorted, order] = scores.sort(/*dim=*/0, /*descending=*/false);
    at::Tensor remove = sorted.softmax(0).cumsum(0) <= (1 - row.top_p);
    remove.select(0, vocab - 1).fill_(false);
    const at::Tensor mask = remove.scatter(0, order, remove);
    scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  }
  if (row.min_p > 0) {
    // MinPLogitsWarper: remove tokens whose probability is < min_p x the largest one (the
    // most likely token always stays, as min_p <= 1).
    const at::Tensor probs = scores.softmax(0);
    scores = scores.masked_fill(probs < probs.max() * row.min_p, -std::numeric_limits<float>::infinity());
  }
  const at::Tensor probs = scores.softmax(0);
  return at::multinomial(probs, 1, /*replacement=*/false, gen).item<int64_t>();
}

// The k most likely tokens of each row of `logits` (float32 [R, V], host) with their logprobs
// logit - lse[r], written row-major to ids / lps ([R, k] each). Rows go by descending logprob
// and equal logprobs by ascending token id, also where a tie straddles the k-th place:
// at::topk finds the k-th largest value t, then one pass takes every token above t and the
// lowest ids equal to t, so the result never depends on at::topk's tie order.
void TopLogprobs(const at::Tensor& logits, const at::Tensor& lse, int64_t k, int64_t* ids,
                 float* lps) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  if (rows == 0 || k == 0) return;
  auto [values, indices] = logits.topk(k, /*dim=*/1, /*largest=*/true, /*sorted=*/true);
  values = values.contiguous();
  indices = indices.contiguous();
  const float* lse_data = lse.const_data_ptr<float>();
  std::vector<std::pair<float, int64_t>> picked;
  picked.reserve(k);
  for (int64_t r = 0; r < rows; ++r) {
    const float* v = logits.const_data_ptr<float>() + r * vocab;
    const float t = values.const_data_ptr<float>()[r * k + k - 1];
    picked.clear();
    if (std::isnan(t)) {  // no order to speak of: at::topk's answer as it is
      for (int64_t j = 0; j < k; ++j) {
        const int64_t id = indices.const_data_ptr<int64_t>()[r * k + j];
        picked.emplace_back(v[id], id);
      }
    } else {
      for (int64_t i = 0; i < vocab; ++i) {
        if (v[i] > t) picked.emplace_back(v[i], i);  // at most k - 1 of them
      }
      for (int64_t i = 0; i < vocab && static_cast<int64_t>(picked.size()) < k; ++i) {
        if (v[i] == t) picked.emplace_back(v[i], i);
      }
      std::sort(picked.begin(), picked.end(), [](const auto& a, const auto& b) {
        return a.first != b.first ? a.first > b.first : a.second < b.second;
      });
    }
    for (int64_t j = 0; j < k; ++j) {
      ids[r * k + j] = picked[j].second;
      // The same formula as every other reported logprob: logit - logsumexp(logits).
      lps[r * k + j] = picked[j].first - lse_data[r];
    }
  }
}

}  // namespace

// One (request, sample) sequence.
struct SampleSeq {
  at::Generator generator;
  BlockTable table;
  StateSlot state;  // hybrid models: its recurrent state slot, held until it finishes
  int64_t length = 0;  // tokens in the cache
  std::vector<int64_t> tokens;
  std::vector<float> logprobs;
  // [tokens, row.top_logprobs] row-major when asked (TopLogprobs).
  std::vector<int64_t> top_ids;
  std::vector<float> top_lps;
  std::string stop_reason;
  bool done = false;
  size_t reported = 0;  // tokens already sent as progress (report_tokens rows)
  // Rows with penalties (GenRequest::penalised) only: how often each token was generated.
  std::unordered_map<int64_t, int64_t> counts;
};

struct GenRequest {
  uint64_t id = 0;
  ipc::SampleRowMsg row;       // the parameters (row.prompt_tokens is not used)
  Adapter* adapter = nullptr;  // null: base model
  at::Tensor prompt;           // int64 [P], host
  int64_t blocks_needed = 0;
  std::vector<SampleSeq> samples;
  at::Tensor prompt_logprobs;  // float32 [P - 1] when asked
  at::Tensor prompt_top_ids;   // int64 [P - 1, k] when asked (TopLogprobs)
  at::Tensor prompt_top_lps;   // float32 [P - 1, k]
  at::Tensor target_ids;       // int64 [P - 1, K] when asked (row.target_prompt_tokens)
  at::Tensor target_lps;       // float32 [P - 1, K]
  at::Tensor alt_ids;          // int64 [P - 1, k] when asked (row.prompt_alt_tokens_k)
  at::Tensor alt_lps;          // float32 [P - 1, k]
  // Whether a penalty changes this row's logits (Penalised); else no counts are kept.
  bool penalised = false;
  std::vector<int64_t> prompt_set;  // repetition_penalty != 1: the prompt's distinct ids, sorted
  bool prompt_reported = false;     // report_tokens rows: the prompt's log-probs went with a report

  // Whether the prefill needs the logits of every prompt row, not just the last.
  bool wants_prompt_rows() const {
    return row.want_prompt_logprobs || row.prompt_top_logprobs > 0 || target_ids.defined() ||
           row.prompt_alt_tokens_k > 0;
  }

  int64_t prompt_len() const { return prompt.numel(); }
  bool done() const {
    return std::all_of(samples.begin(), samples.end(), [](const SampleSeq& s) { return s.done; });
  }
};

namespace {

using RequestPtr = std::unique_ptr<GenRequest>;

// floor(P / B) shared prompt blocks + per sample the rest of ceil((P + M) / B); saturates
// at int64 max instead of overflowing (such a request is rejected anyway).
int64_t BlocksNeeded(int64_t prompt, int64_t max_tokens, int64_t samples, int64_t block) {
  const int64_t shared = prompt / block;
  const int64_t per_sample = (prompt + max_tokens + block - 1) / block - shared;
  if (per_sample > 0 && samples > (std::numeric_limits<int64_t>::max() - shared) / per_sample) {
    return std::numeric_limits<int64_t>::max();
  }
  return shared + samples * per_sample;
}

// Checks a row and builds its request (no blocks yet). The message names the problem;
// NotFound for an unknown adapter, InvalidArgument otherwise.
absl::StatusOr<RequestPtr> Prepare(uint64_t id, const ipc::SampleRowMsg& row,
                                   const ipc::Message& message, const ModelConfig& config,
                                   const KvBlockPool& pool, const AdapterLookup& find_adapter) {
  absl::StatusOr<at::Tensor> prompt = ReadTensor(row.prompt_tokens, message);
  if (!prompt.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("prompt_tokens: ", prompt.status().message()));
  }
  if (prompt->dim() != 1 || prompt->numel() == 0 || prompt->scalar_type() != at::kLong) {
    return absl::InvalidArgumentError("prompt_tokens must be a non-empty int64 [P]");
  }
  const int64_t vocab = config.vocab_size;
  const int64_t* p = prompt->const_data_ptr<int64_t>();
  for (int64_t i = 0; i < prompt->numel(); ++i) {
    if (p[i] < 0 || p[i] >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt token ", p[i], " at position ", i, " is outside [0, ", vocab, ")"));
    }
  }
  if (row.max_tokens < 0) return absl::InvalidArgumentError("max_tokens must be >= 0");
  if (!(row.temperature >= 0) || std::isinf(row.temperature)) {
    return absl::InvalidArgumentError("temperature must be finite and >= 0");
  }
  if (!(row.top_p > 0 && row.top_p <= 1)) {
    return absl::InvalidArgumentError("top_p must be in (0, 1]");
  }
  if (row.num_samples < 1) return absl::InvalidArgumentError("num_samples must be >= 1");
  const int64_t max_top = std::min(vocab, ipc::kMaxTopLogprobs);
  if (row.top_logprobs < 0 || row.top_logprobs > max_top) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_logprobs (", row.top_logprobs, ") must be in [0, ", max_top, "]"));
  }
  if (row.prompt_top_logprobs < 0 || row.prompt_top_logprobs > max_top) {
    return absl::InvalidArgumentError(absl::StrCat("prompt_top_logprobs (", row.prompt_top_logprobs,
                                                   ") must be in [0, ", max_top, "]"));
  }
  const int64_t prompt_len = prompt->numel();
  const int64_t max_pos = config.max_position_embeddings;
  if (max_pos > 0 && row.max_tokens > max_pos - prompt_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt + max_tokens = ", prompt_len + row.max_tokens, " (", prompt_len, " + ",
                     row.max_tokens, ") exceeds max_position_embeddings ", max_pos));
  }
  if (pool.states_total() > 0 && row.num_samples > pool.states_total()) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_samples (", row.num_samples, ") exceeds the ", pool.states_total(),
                     " recurrent state slots (sequences that can run at once: sampler.state_slots)"));
  }
  const int64_t capacity = pool.total() * pool.block_size();
  if (row.max_tokens > capacity) {  // also keeps P + max_tokens far from overflowing
    return absl::InvalidArgumentError(absl::StrCat(
        "max_tokens (", row.max_tokens, ") exceeds the KV cache (", capacity, " tokens)"));
  }
  const int64_t needed =
      BlocksNeeded(prompt_len, row.max_tokens, row.num_samples, pool.block_size());
  if (needed > pool.total()) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt (", prompt_len, " tokens) + max_tokens (", row.max_tokens,
                     ") x num_samples (", row.num_samples, ") needs ", needed, " KV blocks of ",
                     pool.block_size(), " tokens, the cache has only ", pool.total()));
  }
  auto request = std::make_unique<GenRequest>();
  if (!row.adapter_id.empty()) {
    absl::StatusOr<Adapter*> adapter = find_adapter(row.adapter_id);
    if (!adapter.ok()) return adapter.status();
    request->adapter = *adapter;
  }
  if (row.prompt_alt_tokens_k < 0 || row.prompt_alt_tokens_k > ipc::kMaxPromptTargets) {
    return absl::InvalidArgumentError(absl::StrCat("prompt_alt_tokens_k (", row.prompt_alt_tokens_k,
                                                   ") must be in [0, ", ipc::kMaxPromptTargets, "]"));
  }
  if (!(row.repetition_penalty > 0) || std::isinf(row.repetition_penalty)) {
    return absl::InvalidArgumentError(
        absl::StrCat("repetition_penalty (", row.repetition_penalty, ") must be finite and > 0"));
  }
  for (const auto& [name, value] : {std::pair<const char*, double>{"presence_penalty", row.presence_penalty},
                                    std::pair<const char*, double>{"frequency_penalty", row.frequency_penalty}}) {
    if (!(std::fabs(value) <= ipc::kMaxPenalty)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " (", value, ") must be in [", -ipc::kMaxPenalty, ", ", ipc::kMaxPenalty, "]"));
    }
  }
  if (!(row.min_p >= 0 && row.min_p <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("min_p (", row.min_p, ") must be in [0, 1]"));
  }
  at::Tensor target_ids;
  if (row.target_prompt_tokens.has_value()) {
    absl::StatusOr<at::Tensor> t = ReadTensor(*row.target_prompt_tokens, message);
    if (!t.ok()) return absl::InvalidArgumentError(absl::StrCat("target_prompt_tokens: ", t.status().message()));
    if (t->scalar_type() != at::kLong || t->dim() != 2 || t->size(0) != prompt_len - 1 || t->size(1) < 1 ||
        t->size(1) > ipc::kMaxPromptTargets) {
      return absl::InvalidArgumentError(absl::StrCat("target_prompt_tokens must be int64 [", prompt_len - 1,
                                                     ", K] (P - 1 rows) with 1 <= K <= ", ipc::kMaxPromptTargets));
    }
    const int64_t* ids = t->const_data_ptr<int64_t>();
    for (int64_t i = 0; i < t->numel(); ++i) {
      if (ids[i] < -1 || ids[i] >= vocab) {
        return absl::InvalidArgumentError(absl::StrCat("target_prompt_tokens: token id ", ids[i],
                                                       " is neither -1 (none) nor in [0, ", vocab, ")"));
      }
    }
    target_ids = t->contiguous();
  }
  request->id = id;
  request->row = row;
  request->row.prompt_tokens = {};
  request->row.target_prompt_tokens.reset();
  request->target_ids = std::move(target_ids);
  request->prompt = *std::move(prompt);
  request->blocks_needed = needed;
  request->penalised =
      row.repetition_penalty != 1.0 || row.presence_penalty != 0.0 || row.frequency_penalty != 0.0;
  if (row.repetition_penalty != 1.0) {
    const int64_t* ids = request->prompt.const_data_ptr<int64_t>();
    request->prompt_set.assign(ids, ids + prompt_len);
    std::sort(request->prompt_set.begin(), request->prompt_set.end());
    request->prompt_set.erase(std::unique(request->prompt_set.begin(), request->prompt_set.end()),
                              request->prompt_set.end());
  }
  return request;
}

// The row's penalties (sampler.h) on a copy of `logits` (float32 [vocab], host), for the
// sample `seq`: repetition_penalty on every distinct token of the prompt and of the sample's
// tokens so far, then presence / frequency on the sample's tokens so far.
at::Tensor Penalised(const at::Tensor& logits, const GenRequest& r, const SampleSeq& seq) {
  at::Tensor out = logits.clone();
  float* v = out.data_ptr<float>();
  const bool repeat = r.row.repetition_penalty != 1.0;
  const auto penalty = static_cast<float>(r.row.repetition_penalty);
  // RepetitionPenaltyLogitsProcessor: where(score < 0, score * penalty, score / penalty).
  const auto repeat_one = [v, penalty](int64_t id) { v[id] = v[id] < 0 ? v[id] * penalty : v[id] / penalty; };
  if (repeat) {
    for (int64_t id : r.prompt_set) repeat_one(id);
  }
  const auto frequency = static_cast<float>(r.row.frequency_penalty);
  const auto presence = static_cast<float>(r.row.presence_penalty);
  for (const auto& [id, count] : seq.counts) {
    if (repeat && !std::binary_search(r.prompt_set.begin(), r.prompt_set.end(), id)) repeat_one(id);
    // OpenAI: logit - count * frequency_penalty - (count > 0) * presence_penalty.
    v[id] = v[id] - static_cast<float>(count) * frequency - presence;
  }
  return out;
}

// Whether the pool can take the request now: its blocks and, for a hybrid model, a
// recurrent state slot for each of its samples.
bool Fits(const GenRequest& r, const KvBlockPool& pool) {
  return r.blocks_needed <= pool.free() &&
         (pool.states_total() == 0 || r.row.num_samples <= pool.states_free());
}

}  // namespace

// A set of running requests over the shared pool: admission (blocks), prefill, decode.
class GenerationBatch {
 public:
  GenerationBatch(const DecoderModel& model, c10::Device device, KvBlockPool& pool)
      : model_(model), device_(device), pool_(pool) {}

  bool empty() const { return running_.empty(); }
  int64_t running() const { return static_cast<int64_t>(running_.size()); }
  bool Contains(uint64_t id) const {
    return std::any_of(running_.begin(), running_.end(),
                       [id](const RequestPtr& r) { return r->id == id; });
  }

  // Takes the request's blocks (and state slots) and makes its samples (the caller checked
  // Fits).
  void Reserve(GenRequest& r) {
    const int64_t block = pool_.block_size(), p = r.prompt_len();
    const int64_t shared_count = p / block;
    const int64_t per_sample = (p + r.row.max_tokens + block - 1) / block - shared_count;
    const std::vector<int64_t> shared = pool_.Take(shared_count);
    r.samples.clear();
    r.samples.reserve(r.row.num_samples);
    for (int64_t s = 0; s < r.row.num_samples; ++s) {
      SampleSeq seq;
      seq.table = BlockTable(&pool_);
      for (int64_t b : shared) {
        if (s > 0) pool_.Retain(b);
        seq.table.Append(b);
      }
      for (int64_t b : pool_.Take(per_sample)) seq.table.Append(b);
      if (pool_.states_total() > 0) seq.state = StateSlot(&pool_, pool_.TakeState());
      seq.generator =
          at::make_generator<at::CPUGeneratorImpl>(SplitMix64(SplitMix64(r.row.seed) ^ static_cast<uint64_t>(s)));
      r.samples.push_back(std::move(seq));
    }
  }

  // Prefills `admitted` (reserved) in one packed pass and picks every sample's first token.
  // Requests that are already done come back; the others join the batch.
  std::vector<RequestPtr> Prefill(std::vector<RequestPtr> admitted) {
    std::vector<RequestPtr> finished;
    if (admitted.empty()) return finished;
    std::vector<at::Tensor> tokens;
    std::vector<DecoderModel::PagedSequence> seqs;
    std::vector<int64_t> logit_rows, begins;
    int64_t n = 0;
    for (const RequestPtr& r : admitted) {
      const int64_t p = r->prompt_len();
      tokens.push_back(r->prompt);
      // The prompt goes once into sample 0's blocks; the others share or copy them below.
      seqs.push_back({&r->samples[0].table.blocks(), 0, p, r->samples[0].state.slot()});
      begins.push_back(n);
      for (int64_t i = r->wants_prompt_rows() ? 0 : p - 1; i < p; ++i) logit_rows.push_back(n + i);
      n += p;
    }
    const LoraSegmentsFn lora = [&](int64_t layer, LinearKind kind, const at::Tensor&) {
      std::vector<kernels::LoraSegment> segments;
      for (size_t i = 0; i < admitted.size(); ++i) {
        const Adapter* a = admitted[i]->adapter;
        if (a == nullptr || !a->targets(kind)) continue;
        segments.push_back(kernels::LoraSegment{begins[i],
                                                begins[i] + admitted[i]->prompt_len(),
                                                a->a(layer, kind),
                                                a->b(layer, kind),
                                                a->scale(kind),
                                                {}});
      }
      return segments;
    };
    const at::Tensor logits =
        model_.ForwardPaged(at::cat(tokens).to(device_), seqs, pool_.kv(), &logit_rows, lora)
            .to(at::kCPU)
            .contiguous();
    const at::Tensor lse = at::logsumexp(logits, {1}).contiguous();

    int64_t row = 0;  // into logits
    for (RequestPtr& r : admitted) {
      const int64_t p = r->prompt_len();
      if (r->wants_prompt_rows()) {
        const at::Tensor rows = logits.narrow(0, row, p - 1);
        const at::Tensor row_lse = lse.narrow(0, row, p - 1);
        if (r->row.want_prompt_logprobs) {
          const at::Tensor targets = r->prompt.narrow(0, 1, p - 1);
          r->prompt_logprobs =
              (rows.gather(1, targets.unsqueeze(1)).squeeze(1) - row_lse).contiguous();
        }
        if (const int64_t k = r->row.prompt_top_logprobs; k > 0) {
          r->prompt_top_ids = at::empty({p - 1, k}, at::kLong);
          r->prompt_top_lps = at::empty({p - 1, k}, at::kFloat);
          TopLogprobs(rows, row_lse, k, r->prompt_top_ids.data_ptr<int64_t>(),
                      r->prompt_top_lps.data_ptr<float>());
        }
        if (r->target_ids.defined()) {  // logit - lse at each asked cell, 0 where the id is -1
          const at::Tensor asked = r->target_ids >= 0;
          const at::Tensor lp = rows.gather(1, r->target_ids.clamp_min(0)) - row_lse.unsqueeze(1);
          r->target_lps = at::where(asked, lp, at::zeros_like(lp)).contiguous();
        }
        if (const int64_t k = r->row.prompt_alt_tokens_k; k > 0) {
          // Draws of their own stream (not any sample's): seeded by (seed, "alt").
          at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(SplitMix64(SplitMix64(r->row.seed) ^ kAltTokensStream));
          if (p - 1 == 0) {
            r->alt_ids = at::empty({0, k}, at::kLong);
          } else if (r->row.temperature == 0) {
            r->alt_ids = rows.argmax(1, /*keepdim=*/true).expand({p - 1, k}).contiguous();
          } else {
            r->alt_ids = at::multinomial((rows / r->row.temperature).softmax(1), k, /*replacement=*/true, gen);
          }
          r->alt_lps = (rows.gather(1, r->alt_ids) - row_lse.unsqueeze(1)).contiguous();
        }
        row += p - 1;
      }
      const int64_t last = row++;
      // Samples other than 0 get the prompt's partly filled last block copied.
      const int64_t block = pool_.block_size();
      if (p % block != 0) {
        const int64_t from = r->samples[0].table.blocks()[p / block];
        for (size_t s = 1; s < r->samples.size(); ++s) {
          pool_.CopySlots(from, r->samples[s].table.blocks()[p / block], p % block);
        }
      }
      // And the recurrent states the prompt left (hybrid models).
      if (pool_.states_total() > 0) {
        for (size_t s = 1; s < r->samples.size(); ++s) {
          pool_.CopyState(r->samples[0].state.slot(), r->samples[s].state.slot());
        }
      }
      for (SampleSeq& seq : r->samples) {
        seq.length = p;
        if (r->row.max_tokens == 0) {
          Finish(seq, "length");
        } else {
          Advance(*r, seq, logits, lse, last);
        }
      }
      if (r->done()) {
        finished.push_back(std::move(r));
      } else {
        running_.push_back(std::move(r));
      }
    }
    return finished;
  }

  // One decode step over every running sequence; returns the requests it finished.
  std::vector<RequestPtr> Decode() {
    struct Active {
      GenRequest* request;
      SampleSeq* seq;
    };
    std::vector<Active> active;
    std::vector<int64_t> input;
    std::vector<DecoderModel::PagedSequence> seqs;
    for (RequestPtr& r : running_) {
      for (SampleSeq& s : r->samples) {
        if (s.done) continue;
        active.push_back({r.get(), &s});
        input.push_back(s.tokens.back());
        seqs.push_back({&s.table.blocks(), s.length, 1, s.state.slot()});
      }
    }
    if (active.empty()) return {};
    const bool cpu = device_.is_cpu();
    const LoraSegmentsFn lora = [&](int64_t layer, LinearKind kind, const at::Tensor&) {
      // One segment per sequence, also for neighbours on the same adapter: a segment's
      // arithmetic then never depends on how many rows share its adapter. On CPU the weights
      // come transposed (Adapter::InferenceWeights), as the one-row kernels read them.
      std::vector<kernels::LoraSegment> segments;
      segments.reserve(active.size());
      for (size_t i = 0; i < active.size(); ++i) {
        const Adapter* a = active[i].request->adapter;
        if (a == nullptr || !a->targets(kind)) continue;
        const int64_t row = static_cast<int64_t>(i);
        if (cpu) {
          auto [wa, wb] = a->InferenceWeights(layer, kind);
          segments.push_back(
              kernels::LoraSegment{row, row + 1, std::move(wa), std::move(wb), a->scale(kind), {}});
        } else {
          segments.push_back(kernels::LoraSegment{
              row, row + 1, a->a(layer, kind), a->b(layer, kind), a->scale(kind), {}});
        }
      }
      return segments;
    };
    const at::Tensor tokens =
        at::from_blob(input.data(), {static_cast<int64_t>(input.size())}, at::kLong)
            .to(device_, false, true);
    const at::Tensor logits =
        model_.ForwardPaged(tokens, seqs, pool_.kv(), nullptr, lora).to(at::kCPU).contiguous();
    const at::Tensor lse = at::logsumexp(logits, {1}).contiguous();
    for (size_t i = 0; i < active.size(); ++i) {
      ++active[i].seq->length;
      Advance(*active[i].request, *active[i].seq, logits, lse, static_cast<int64_t>(i));
    }
    return TakeDone();
  }

  // Takes the requests whose samples have all finished out of the batch.
  std::vector<RequestPtr> TakeDone() {
    std::vector<RequestPtr> finished, still;
    for (RequestPtr& r : running_) {
      if (r->done()) {
        finished.push_back(std::move(r));
      } else {
        still.push_back(std::move(r));
      }
    }
    running_ = std::move(still);
    return finished;
  }

  // Ends one running sample as "stop" with the tokens it has (its blocks go back now). The
  // request leaves the batch at the next TakeDone once all its samples are done.
  void StopSample(uint64_t id, int64_t sample) {
    for (RequestPtr& r : running_) {
      if (r->id != id) continue;
      if (sample >= 0 && sample < static_cast<int64_t>(r->samples.size()) && !r->samples[sample].done) {
        Finish(r->samples[sample], "stop");
      }
      return;
    }
  }

  // The tokens each running sample of a report_tokens request made since the last report.
  void ReportProgress(std::vector<ipc::SampleProgressMsg>& out) {
    for (RequestPtr& r : running_) {
      if (!r->row.report_tokens) continue;
      for (size_t s = 0; s < r->samples.size(); ++s) {
        SampleSeq& seq = r->samples[s];
        if (seq.done || seq.reported == seq.tokens.size()) continue;
        ipc::SampleProgressMsg m;
        m.request_id = r->id;
        m.sample = static_cast<int64_t>(s);
        const auto from = static_cast<std::ptrdiff_t>(seq.reported);
        m.tokens.assign(seq.tokens.begin() + from, seq.tokens.end());
        m.logprobs.assign(seq.logprobs.begin() + from, seq.logprobs.end());
        if (const int64_t k = r->row.top_logprobs; k > 0) {
          m.top_token_ids.assign(seq.top_ids.begin() + from * k, seq.top_ids.end());
          m.top_logprobs.assign(seq.top_lps.begin() + from * k, seq.top_lps.end());
        }
        if (!r->prompt_reported) {  // the request's first report carries the prompt's log-probs
          r->prompt_reported = true;
          if (const at::Tensor& lp = r->prompt_logprobs; lp.defined()) {
            m.prompt_logprobs.assign(lp.const_data_ptr<float>(), lp.const_data_ptr<float>() + lp.numel());
          }
          if (r->prompt_top_ids.defined()) {
            const at::Tensor& ids = r->prompt_top_ids;
            const at::Tensor& lps = r->prompt_top_lps;
            m.prompt_top_token_ids.assign(ids.const_data_ptr<int64_t>(), ids.const_data_ptr<int64_t>() + ids.numel());
            m.prompt_top_logprobs.assign(lps.const_data_ptr<float>(), lps.const_data_ptr<float>() + lps.numel());
          }
        }
        out.push_back(std::move(m));
        seq.reported = seq.tokens.size();
      }
    }
  }

  bool Cancel(uint64_t id) {
    for (auto it = running_.begin(); it != running_.end(); ++it) {
      if ((*it)->id == id) {
        running_.erase(it);  // its block tables release their blocks
        return true;
      }
    }
    return false;
  }

  std::vector<uint64_t> DropAdapter(const Adapter* adapter) {
    std::vector<uint64_t> dropped;
    std::vector<RequestPtr> still;
    for (RequestPtr& r : running_) {
      if (r->adapter == adapter) {
        dropped.push_back(r->id);
      } else {
        still.push_back(std::move(r));
      }
    }
    running_ = std::move(still);
    return dropped;
  }

  // Drops everything; returns the ids that were running.
  std::vector<uint64_t> Clear() {
    std::vector<uint64_t> ids;
    for (const RequestPtr& r : running_) ids.push_back(r->id);
    running_.clear();
    return ids;
  }

 private:
  void Finish(SampleSeq& seq, const char* reason) {
    seq.done = true;
    seq.stop_reason = reason;
    seq.table.Clear();  // its blocks go back now (shared ones when the last sample lets go)
    seq.state.Reset();  // and its recurrent state slot
  }

  // Picks the sequence's next token from logits row `row` and checks for its end.
  void Advance(const GenRequest& r, SampleSeq& seq, const at::Tensor& logits, const at::Tensor& lse,
               int64_t row) {
    const at::Tensor l = logits.select(0, row);
    const int64_t token = ChooseToken(r.penalised ? Penalised(l, r, seq) : l, r.row, seq.generator);
    if (r.penalised) ++seq.counts[token];
    // The training forward's formula: logit[token] - logsumexp(logits).
    seq.logprobs.push_back(l.const_data_ptr<float>()[token] - lse.const_data_ptr<float>()[row]);
    if (const int64_t k = r.row.top_logprobs; k > 0) {
      const size_t at = seq.top_ids.size();
      seq.top_ids.resize(at + k);
      seq.top_lps.resize(at + k);
      TopLogprobs(logits.narrow(0, row, 1), lse.narrow(0, row, 1), k, seq.top_ids.data() + at,
                  seq.top_lps.data() + at);
    }
    seq.tokens.push_back(token);
    const std::vector<int64_t>& stops = r.row.stop_token_ids;
    if (std::find(stops.begin(), stops.end(), token) != stops.end()) {
      Finish(seq, "stop");
    } else if (static_cast<int64_t>(seq.tokens.size()) >= r.row.max_tokens) {
      Finish(seq, "length");
    }
  }

  const DecoderModel& model_;
  c10::Device device_;
  KvBlockPool& pool_;
  std::vector<RequestPtr> running_;  // in admission order
};

namespace {

absl::StatusOr<ipc::SampleRowResultMsg> ToResult(const GenRequest& r, MethodReply& reply) {
  ipc::SampleRowResultMsg out;
  for (const SampleSeq& seq : r.samples) {
    ipc::SampledSequenceMsg s;
    const int64_t t = static_cast<int64_t>(seq.tokens.size());
    absl::StatusOr<ipc::TensorDesc> tokens =
        AppendTensor(at::from_blob(const_cast<int64_t*>(seq.tokens.data()), {t}, at::kLong), reply);
    if (!tokens.ok()) return tokens.status();
    absl::StatusOr<ipc::TensorDesc> logprobs = AppendTensor(
        at::from_blob(const_cast<float*>(seq.logprobs.data()), {t}, at::kFloat), reply);
    if (!logprobs.ok()) return logprobs.status();
    s.tokens = *tokens;
    s.logprobs = *logprobs;
    s.stop_reason = seq.stop_reason;
    if (const int64_t k = r.row.top_logprobs; k > 0) {
      absl::StatusOr<ipc::TensorDesc> ids = AppendTensor(
          at::from_blob(const_cast<int64_t*>(seq.top_ids.data()), {t, k}, at::kLong), reply);
      if (!ids.ok()) return ids.status();
      absl::StatusOr<ipc::TensorDesc> lps = AppendTensor(
          at::from_blob(const_cast<float*>(seq.top_lps.data()), {t, k}, at::kFloat), reply);
      if (!lps.ok()) return lps.status();
      s.top_token_ids = *ids;
      s.top_logprobs = *lps;
    }
    out.samples.push_back(std::move(s));
  }
  if (r.prompt_logprobs.defined()) {
    absl::StatusOr<ipc::TensorDesc> desc = AppendTensor(r.prompt_logprobs, reply);
    if (!desc.ok()) return desc.status();
    out.prompt_logprobs = *desc;
  }
  if (r.target_lps.defined()) {
    absl::StatusOr<ipc::TensorDesc> desc = AppendTensor(r.target_lps, reply);
    if (!desc.ok()) return desc.status();
    out.target_prompt_logprobs = *desc;
  }
  if (r.alt_ids.defined()) {
    absl::StatusOr<ipc::TensorDesc> ids = AppendTensor(r.alt_ids, reply);
    if (!ids.ok()) return ids.status();
    absl::StatusOr<ipc::TensorDesc> lps = AppendTensor(r.alt_lps, reply);
    if (!lps.ok()) return lps.status();
    out.prompt_alt_token_ids = *ids;
    out.prompt_alt_logprobs = *lps;
  }
  if (r.prompt_top_ids.defined()) {
    absl::StatusOr<ipc::TensorDesc> ids = AppendTensor(r.prompt_top_ids, reply);
    if (!ids.ok()) return ids.status();
    absl::StatusOr<ipc::TensorDesc> lps = AppendTensor(r.prompt_top_lps, reply);
    if (!lps.ok()) return lps.status();
    out.prompt_top_token_ids = *ids;
    out.prompt_top_logprobs = *lps;
  }
  return out;
}

std::string ErrorText(const std::exception& e) {
  // c10::Error::what() carries a C++ backtrace; the first line is the message.
  std::string what = e.what();
  const size_t nl = what.find('\n');
  return nl == std::string::npos ? what : what.substr(0, nl);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Sampler>> Sampler::Create(const DecoderModel& model,
                                                         c10::Device device, at::ScalarType dtype,
                                                         KvCacheSize cache_size,
                                                         AdapterLookup find_adapter) {
  absl::StatusOr<std::unique_ptr<KvBlockPool>> pool =
      KvBlockPool::Create(model.config(), cache_size, dtype, device);
  if (!pool.ok()) return pool.status();
  return std::unique_ptr<Sampler>(
      new Sampler(model, device, *std::move(pool), std::move(find_adapter)));
}

Sampler::Sampler(const DecoderModel& model, c10::Device device, std::unique_ptr<KvBlockPool> pool,
                 AdapterLookup find_adapter)
    : model_(model),
      device_(device),
      pool_(std::move(pool)),
      find_adapter_(std::move(find_adapter)),
      running_(std::make_unique<GenerationBatch>(model_, device_, *pool_)) {}

Sampler::~Sampler() {
  running_.reset();  // releases its blocks while the pool still exists
}

void Sampler::AdapterRemoved(const Adapter* adapter) {
  for (uint64_t id : running_->DropAdapter(adapter)) {
    pending_rejected_.push_back({id, "adapter removed"});
  }
}

absl::StatusOr<MethodReply> Sampler::Sample(const ipc::Message& request) {
  absl::StatusOr<ipc::SampleRequest> req =
      ipc::Unpack<ipc::SampleRequest>(request.envelope.body, ipc::kMethodSample);
  if (!req.ok()) return req.status();
  if (req->rows.empty()) return absl::InvalidArgumentError("sample: no rows");

  std::vector<RequestPtr> queue;
  for (size_t i = 0; i < req->rows.size(); ++i) {
    absl::StatusOr<RequestPtr> r =
        Prepare(i, req->rows[i], request, model_.config(), *pool_, find_adapter_);
    if (!r.ok()) {
      return absl::Status(r.status().code(), absl::StrCat("row ", i, ": ", r.status().message()));
    }
    queue.push_back(*std::move(r));
  }

  const c10::NoGradGuard no_grad;
  // A private batch: the rows are admitted in order as blocks allow and stepped to the end.
  GenerationBatch batch(model_, device_, *pool_);
  std::vector<RequestPtr> done(queue.size());
  size_t next = 0;
  while (next < queue.size() || !batch.empty()) {
    std::vector<RequestPtr> admitted;
    while (next < queue.size() && Fits(*queue[next], *pool_)) {
      batch.Reserve(*queue[next]);
      admitted.push_back(std::move(queue[next++]));
    }
    if (admitted.empty() && batch.empty()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "sample: row ", next, " needs ", queue[next]->blocks_needed, " KV blocks, ",
          pool_->free(), " of ", pool_->total(),
          pool_->states_total() > 0
              ? absl::StrCat(" are free, and ", queue[next]->row.num_samples,
                             " recurrent state slots, ", pool_->states_free(), " of ",
                             pool_->states_total(), " are free")
              : std::string(" are free"),
          " (the rest hold running sample_step requests)"));
    }
    for (RequestPtr& r : batch.Prefill(std::move(admitted))) done[r->id] = std::move(r);
    if (!batch.empty()) {
      for (RequestPtr& r : batch.Decode()) done[r->id] = std::move(r);
    }
  }

  MethodReply reply;
  ipc::SampleReply body;
  for (const RequestPtr& r : done) {
    absl::StatusOr<ipc::SampleRowResultMsg> result = ToResult(*r, reply);
    if (!result.ok()) return result.status();
    body.rows.push_back(*std::move(result));
  }
  reply.envelope.body = ipc::Pack(body);
  return reply;
}

absl::StatusOr<MethodReply> Sampler::SampleStep(const ipc::Message& request) {
  absl::StatusOr<ipc::SampleStepRequest> req =
      ipc::Unpack<ipc::SampleStepRequest>(request.envelope.body, ipc::kMethodSampleStep);
  if (!req.ok()) return req.status();
  if (req->max_decode_steps < 0) {
    return absl::InvalidArgumentError("sample_step: max_decode_steps must be >= 0");
  }
  const c10::NoGradGuard no_grad;
  ipc::SampleStepReply body;
  MethodReply reply;
  if (req->reset) {
    running_->Clear();
    pending_rejected_.clear();
  }
  for (uint64_t id : req->cancel) running_->Cancel(id);
  for (const ipc::SampleRefMsg& stop : req->stop) running_->StopSample(stop.request_id, stop.sample);
  body.rejected = std::move(pending_rejected_);
  pending_rejected_.clear();

  std::vector<RequestPtr> finished = running_->TakeDone();
  // Admission, FIFO: once one request waits for blocks, every later one waits too.
  std::vector<RequestPtr> admitted;
  std::set<uint64_t> seen;
  bool deferring = false;
  for (const ipc::SampleAdmitMsg& a : req->admit) {
    if (running_->Contains(a.request_id) || !seen.insert(a.request_id).second) {
      body.rejected.push_back(
          {a.request_id, absl::StrCat("request_id ", a.request_id, " is already running")});
      continue;
    }
    absl::StatusOr<RequestPtr> r =
        Prepare(a.request_id, a.row, request, model_.config(), *pool_, find_adapter_);
    if (!r.ok()) {
      body.rejected.push_back({a.request_id, std::string(r.status().message())});
      continue;
    }
    if (deferring || !Fits(**r, *pool_)) {
      deferring = true;
      body.deferred.push_back(a.request_id);
      continue;
    }
    running_->Reserve(**r);
    admitted.push_back(*std::move(r));
  }

  // LibTorch errors inside a pass drop the requests the pass touched (their cache is
  // suspect) and report them as rejected; everything else stays as it was.
  std::vector<uint64_t> admitted_ids;
  for (const RequestPtr& r : admitted) admitted_ids.push_back(r->id);
  try {
    for (RequestPtr& r : running_->Prefill(std::move(admitted))) finished.push_back(std::move(r));
  } catch (const std::exception& e) {
    for (uint64_t id : admitted_ids) {
      running_->Cancel(id);
      body.rejected.push_back({id, absl::StrCat("engine error in prefill: ", ErrorText(e))});
    }
  }
  for (int64_t step = 0; step < req->max_decode_steps && !running_->empty(); ++step) {
    try {
      for (RequestPtr& r : running_->Decode()) finished.push_back(std::move(r));
    } catch (const std::exception& e) {
      for (uint64_t id : running_->Clear()) {
        body.rejected.push_back({id, absl::StrCat("engine error in decode: ", ErrorText(e))});
      }
    }
  }

  for (const RequestPtr& r : finished) {
    absl::StatusOr<ipc::SampleRowResultMsg> result = ToResult(*r, reply);
    if (!result.ok()) return result.status();
    body.finished.push_back({r->id, *std::move(result)});
  }
  running_->ReportProgress(body.progress);
  body.running = running_->running();
  body.blocks_in_use = pool_->in_use();
  body.blocks_total = pool_->total();
  body.block_size = pool_->block_size();
  body.states_in_use = pool_->states_total() - pool_->states_free();
  body.states_total = pool_->states_total();
  reply.envelope.body = ipc::Pack(body);
  return reply;
}

}  // namespace twinkle::engine
