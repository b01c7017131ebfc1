#include "core/engine/sampler/sampler.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/engine/tensor_io.h"
#include "core/ipc/training_messages.h"

namespace twinkle::engine {
namespace {

// splitmix64: neighbouring (seed, sample) pairs get unrelated generator streams.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

struct Sequence {
  size_t row = 0;
  Adapter* adapter = nullptr;  // null: base model
  DecoderModel::KvCache cache;
  at::Generator generator;
  std::vector<int64_t> tokens;
  std::vector<float> logprobs;
  std::string stop_reason;
  bool done = false;
};

// One token from a float32 [vocab] row of logits (host memory), as the header describes.
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
  const at::Tensor probs = scores.softmax(0);
  return at::multinomial(probs, 1, /*replacement=*/false, gen).item<int64_t>();
}

absl::Status CheckRow(const ipc::SampleRowMsg& row, const at::Tensor& prompt, int64_t vocab,
                      size_t index) {
  const std::string where = absl::StrCat("row ", index);
  if (prompt.dim() != 1 || prompt.numel() == 0 || prompt.scalar_type() != at::kLong) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": prompt_tokens must be a non-empty int64 [P]"));
  }
  const int64_t* p = prompt.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < prompt.numel(); ++i) {
    if (p[i] < 0 || p[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": prompt token outside [0, ", vocab, ")"));
    }
  }
  if (row.max_tokens < 0) return absl::InvalidArgumentError(absl::StrCat(where, ": max_tokens must be >= 0"));
  if (!(row.temperature >= 0)) return absl::InvalidArgumentError(absl::StrCat(where, ": temperature must be >= 0"));
  if (!(row.top_p > 0 && row.top_p <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": top_p must be in (0, 1]"));
  }
  if (row.num_samples < 1) return absl::InvalidArgumentError(absl::StrCat(where, ": num_samples must be >= 1"));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<MethodReply> Sample(const DecoderModel& model, c10::Device device,
                                   const AdapterLookup& find_adapter, const ipc::Message& request) {
  absl::StatusOr<ipc::SampleRequest> req =
      ipc::Unpack<ipc::SampleRequest>(request.envelope.body, ipc::kMethodSample);
  if (!req.ok()) return req.status();
  if (req->rows.empty()) return absl::InvalidArgumentError("sample: no rows");
  const int64_t vocab = model.config().vocab_size;

  std::vector<at::Tensor> prompts;
  std::vector<Sequence> seqs;
  for (size_t r = 0; r < req->rows.size(); ++r) {
    const ipc::SampleRowMsg& row = req->rows[r];
    absl::StatusOr<at::Tensor> prompt = ReadTensor(row.prompt_tokens, request);
    if (!prompt.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("row ", r, " prompt_tokens: ", prompt.status().message()));
    }
    if (absl::Status s = CheckRow(row, *prompt, vocab, r); !s.ok()) return s;
    Adapter* adapter = nullptr;
    if (!row.adapter_id.empty()) {
      absl::StatusOr<Adapter*> found = find_adapter(row.adapter_id);
      if (!found.ok()) return found.status();
      adapter = *found;
    }
    prompts.push_back(*prompt);
    for (int64_t s = 0; s < row.num_samples; ++s) {
      Sequence seq;
      seq.row = r;
      seq.adapter = adapter;
      seq.generator = at::make_generator<at::CPUGeneratorImpl>(Mix(Mix(row.seed) ^ static_cast<uint64_t>(s)));
      if (row.max_tokens == 0) {
        seq.done = true;
        seq.stop_reason = "length";
      }
      seqs.push_back(std::move(seq));
    }
  }

  c10::NoGradGuard no_grad;
  MethodReply reply;
  ipc::SampleReply body;
  body.rows.resize(req->rows.size());

  // Runs one batched step over `active` (indices into seqs) with `lens` new tokens each;
  // returns the logits on the host.
  auto step = [&](const std::vector<size_t>& active, const std::vector<at::Tensor>& inputs,
                  const std::vector<int64_t>& lens) {
    std::vector<DecoderModel::KvCache*> caches;
    std::vector<std::pair<int64_t, int64_t>> bounds;
    int64_t n = 0;
    for (size_t i = 0; i < active.size(); ++i) {
      caches.push_back(&seqs[active[i]].cache);
      bounds.emplace_back(n, n + lens[i]);
      n += lens[i];
    }
    const LoraSegmentsFn lora = [&](int64_t layer, LinearKind kind, const at::Tensor&) {
      std::vector<kernels::LoraSegment> segments;
      for (size_t i = 0; i < active.size(); ++i) {
        const Adapter* a = seqs[active[i]].adapter;
        if (a == nullptr || !a->targets(kind)) continue;
        segments.push_back(kernels::LoraSegment{bounds[i].first, bounds[i].second, a->a(layer, kind),
                                                a->b(layer, kind), a->scale(), {}});
      }
      return segments;
    };
    const at::Tensor tokens = at::cat(inputs).to(device);
    return model.ForwardWithCache(tokens, lens, caches, lora).to(at::kCPU);
  };

  // Picks each active sequence's next token from its last logits row; marks finished ones.
  auto advance = [&](const std::vector<size_t>& active, const at::Tensor& logits,
                     const std::vector<int64_t>& last_rows) {
    for (size_t i = 0; i < active.size(); ++i) {
      Sequence& seq = seqs[active[i]];
      const ipc::SampleRowMsg& row = req->rows[seq.row];
      const at::Tensor l = logits.select(0, last_rows[i]);
      const int64_t token = ChooseToken(l, row, seq.generator);
      // The training forward's formula: logit[token] - logsumexp(logits).
      seq.logprobs.push_back((l.select(0, token) - at::logsumexp(l, {0})).item<float>());
      seq.tokens.push_back(token);
      if (std::find(row.stop_token_ids.begin(), row.stop_token_ids.end(), token) != row.stop_token_ids.end()) {
        seq.done = true;
        seq.stop_reason = "stop";
      } else if (static_cast<int64_t>(seq.tokens.size()) >= row.max_tokens) {
        seq.done = true;
        seq.stop_reason = "length";
      }
    }
  };

  // Prefill: every sequence's prompt in one packed pass (the prompt logprobs come from it too).
  {
    std::vector<size_t> all;
    std::vector<at::Tensor> inputs;
    std::vector<int64_t> lens, last_rows;
    int64_t n = 0;
    for (size_t i = 0; i < seqs.size(); ++i) {
      all.push_back(i);
      inputs.push_back(prompts[seqs[i].row]);
      lens.push_back(prompts[seqs[i].row].numel());
      n += lens.back();
      last_rows.push_back(n - 1);
    }
    const at::Tensor logits = step(all, inputs, lens);
    int64_t begin = 0;
    for (size_t i = 0; i < seqs.size(); ++i) {
      const size_t r = seqs[i].row;
      const int64_t p = lens[i];
      if (req->rows[r].want_prompt_logprobs && !body.rows[r].prompt_logprobs.has_value()) {
        const at::Tensor rows = logits.narrow(0, begin, p - 1);
        const at::Tensor targets = prompts[r].narrow(0, 1, p - 1);
        const at::Tensor lp = rows.gather(1, targets.unsqueeze(1)).squeeze(1) - at::logsumexp(rows, {-1});
        absl::StatusOr<ipc::TensorDesc> desc = AppendTensor(lp.contiguous(), reply);
        if (!desc.ok()) return desc.status();
        body.rows[r].prompt_logprobs = *desc;
      }
      begin += p;
    }
    std::vector<size_t> live;
    std::vector<int64_t> live_rows;
    for (size_t i = 0; i < seqs.size(); ++i) {
      if (!seqs[i].done) {
        live.push_back(i);
        live_rows.push_back(last_rows[i]);
      }
    }
    advance(live, logits, live_rows);
  }

  // Decode: every unfinished sequence advances by one token per batched step.
  while (true) {
    std::vector<size_t> active;
    std::vector<at::Tensor> inputs;
    for (size_t i = 0; i < seqs.size(); ++i) {
      if (seqs[i].done) continue;
      active.push_back(i);
      inputs.push_back(at::full({1}, seqs[i].tokens.back(), at::kLong));
    }
    if (active.empty()) break;
    const std::vector<int64_t> lens(active.size(), 1);
    std::vector<int64_t> last_rows(active.size());
    for (size_t i = 0; i < active.size(); ++i) last_rows[i] = static_cast<int64_t>(i);
    advance(active, step(active, inputs, lens), last_rows);
  }

  for (Sequence& seq : seqs) {
    ipc::SampledSequenceMsg out;
    const int64_t t = static_cast<int64_t>(seq.tokens.size());
    absl::StatusOr<ipc::TensorDesc> tokens =
        AppendTensor(at::tensor(seq.tokens, at::kLong).view({t}), reply);
    if (!tokens.ok()) return tokens.status();
    absl::StatusOr<ipc::TensorDesc> logprobs =
        AppendTensor(at::tensor(seq.logprobs, at::kFloat).view({t}), reply);
    if (!logprobs.ok()) return logprobs.status();
    out.tokens = *tokens;
    out.logprobs = *logprobs;
    out.stop_reason = seq.stop_reason;
    body.rows[seq.row].samples.push_back(std::move(out));
  }
  reply.envelope.body = ipc::Pack(body);
  return reply;
}

}  // namespace twinkle::engine
