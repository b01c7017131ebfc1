#include "server/tinker/stability_store.h"

#include <algorithm>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace twinkle::tinker {
namespace {

namespace v1 = ::tinker::v1;

struct Span {
  bool sampled = false;
  std::string sequence_id;
  int64_t offset = 0;
  int64_t length = 0;
};

absl::StatusOr<std::vector<Span>> SpansOf(const google::protobuf::RepeatedPtrField<v1::ProvenanceSpan>& list,
                                          const std::string& field, size_t field_length) {
  std::vector<Span> spans;
  int64_t covered = 0;
  for (int i = 0; i < list.size(); ++i) {
    const v1::ProvenanceSpan& s = list.Get(i);
    Span span;
    if (s.has_sampled_tokens()) {
      span = {true, s.sampled_tokens().sequence_id(), s.sampled_tokens().offset(), s.sampled_tokens().length()};
    } else if (s.has_prompt_tokens()) {
      span = {false, s.prompt_tokens().sequence_id(), s.prompt_tokens().offset(), s.prompt_tokens().length()};
    } else {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "]: neither prompt_tokens nor sampled_tokens"));
    }
    if (span.sequence_id.empty() || span.offset < 0 || span.length < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", i, "]: needs a sequence_id, offset >= 0 and length >= 0"));
    }
    if (span.length > static_cast<int64_t>(field_length) - covered) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": the spans cover more than the field's ",
                                                     field_length, " positions"));
    }
    covered += span.length;
    spans.push_back(std::move(span));
  }
  if (covered != static_cast<int64_t>(field_length)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": the spans cover ", covered, " positions, the field has ",
                                                   field_length, "; they must tile it exactly"));
  }
  return spans;
}

}  // namespace

void StabilityStore::DropExpiredLocked(Tenant& t, absl::Time now) {
  if (now - t.last_sweep < absl::Minutes(1)) return;
  t.last_sweep = now;
  for (auto it = t.records.begin(); it != t.records.end();) {
    if (it->second.expires <= now) {
      t.tokens -= it->second.cost;
      t.records.erase(it++);
    } else {
      ++it;
    }
  }
}

void StabilityStore::Record(const std::string& tenant, const std::string& sequence_id,
                            std::shared_ptr<const std::vector<int64_t>> prompt, std::vector<int64_t> tokens,
                            std::vector<float> logprobs, absl::Time now) {
  const int64_t cost = static_cast<int64_t>((prompt ? prompt->size() : 0) + tokens.size());
  if (cost > options_.max_tokens_per_tenant) return;
  absl::MutexLock lock(&mu_);
  Tenant& t = tenants_[tenant];
  DropExpiredLocked(t, now);
  if (auto old = t.records.find(sequence_id); old != t.records.end()) {
    t.tokens -= old->second.cost;
    t.records.erase(old);
  }
  // Over budget: the records closest to expiry (the least recently made or used) go first.
  while (t.tokens + cost > options_.max_tokens_per_tenant && !t.records.empty()) {
    auto oldest = std::min_element(t.records.begin(), t.records.end(), [](const auto& a, const auto& b) {
      return a.second.expires < b.second.expires;
    });
    t.tokens -= oldest->second.cost;
    t.records.erase(oldest);
  }
  t.tokens += cost;
  t.records[sequence_id] = Record_{std::move(prompt), std::move(tokens), std::move(logprobs),
                                   now + options_.retention, cost};
}

int64_t StabilityStore::TokensHeld(const std::string& tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = tenants_.find(tenant);
  return it == tenants_.end() ? 0 : it->second.tokens;
}

absl::Status StabilityStore::Resolve(const std::string& tenant, const v1::Datum& proto, const std::string& field,
                                     training::TokenDatum& datum, absl::Time now) {
  if (proto.model_input_spans_size() == 0 || proto.loss_fn_input_spans_size() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": stable_reinforce needs the datum's provenance (Datum.with_provenance: model_input_spans and "
               "loss_fn_input_spans naming the sequence_ids of a sampling client made with "
               "record_stability_info=True)"));
  }
  const size_t n = datum.input_tokens.size();
  absl::StatusOr<std::vector<Span>> inputs = SpansOf(proto.model_input_spans(), field + ".model_input_spans", n);
  if (!inputs.ok()) return inputs.status();
  absl::StatusOr<std::vector<Span>> targets =
      SpansOf(proto.loss_fn_input_spans(), field + ".loss_fn_input_spans", datum.target_tokens.size());
  if (!targets.ok()) return targets.status();

  std::vector<float> logprobs(datum.target_tokens.size(), 0.f), mask(datum.target_tokens.size(), 0.f);
  absl::MutexLock lock(&mu_);
  Tenant& t = tenants_[tenant];
  DropExpiredLocked(t, now);
  // Checks one field's spans against the records; fills the loss inputs for the targets.
  auto check = [&](const std::vector<Span>& spans, const std::vector<int64_t>& tokens, const std::string& where,
                   bool fill) -> absl::Status {
    size_t pos = 0;
    for (size_t i = 0; i < spans.size(); ++i) {
      const Span& s = spans[i];
      auto it = t.records.find(s.sequence_id);
      if (it != t.records.end() && it->second.expires <= now) {  // expired since the last sweep
        t.tokens -= it->second.cost;
        t.records.erase(it);
        it = t.records.end();
      }
      if (it == t.records.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, "[", i, "]: sequence_id '", s.sequence_id,
            "' is unknown or expired (sequences are kept one day after their last use, for the tenant that sampled "
            "them with record_stability_info=True)"));
      }
      Record_& r = it->second;
      const std::vector<int64_t>& source = s.sampled ? r.tokens : *r.prompt;
      if (s.offset + s.length > static_cast<int64_t>(source.size())) {
        return absl::InvalidArgumentError(absl::StrCat(where, "[", i, "]: offset ", s.offset, " + length ", s.length,
                                                       " is past the ", source.size(), " ",
                                                       s.sampled ? "sampled" : "prompt", " tokens of '",
                                                       s.sequence_id, "'"));
      }
      for (int64_t j = 0; j < s.length; ++j) {
        if (tokens[pos + j] != source[s.offset + j]) {
          return absl::InvalidArgumentError(absl::StrCat(where, "[", i, "]: token ", pos + j, " is ", tokens[pos + j],
                                                         ", the recorded sequence has ", source[s.offset + j]));
        }
        if (fill && s.sampled) {
          logprobs[pos + j] = r.logprobs[s.offset + j];
          mask[pos + j] = 1.f;
        }
      }
      r.expires = now + options_.retention;  // each use renews the day
      pos += s.length;
    }
    return absl::OkStatus();
  };
  if (absl::Status s = check(*inputs, datum.input_tokens, field + ".model_input_spans", false); !s.ok()) return s;
  if (absl::Status s = check(*targets, datum.target_tokens, field + ".loss_fn_input_spans", true); !s.ok()) return s;
  datum.inputs["logprobs"] = std::move(logprobs);
  datum.inputs["stability_mask"] = std::move(mask);
  return absl::OkStatus();
}

}  // namespace twinkle::tinker
