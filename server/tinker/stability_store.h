#pragma once
// StableReinforce's server side (docs/losses.md): the sequences a sampling request made with
// record_stability_info, kept per tenant under their sequence_id, and the resolution of a
// training datum's provenance spans against them.
//
// What is kept per sequence is what the loss needs: the request's prompt tokens, the sampled
// tokens and the sampler's log-prob of each (the unwarped model's, as the sample reply
// reports them). A record lives `retention` (Tinker: one day) after it was made or last
// named by a training request; a tenant holds at most `max_tokens_per_tenant` tokens of
// records (prompt + sampled, counted per sequence), the oldest going first when a new one
// would exceed it. Thread-safe.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/training/types.h"
#include "tinker/v1/tinker_public.pb.h"

namespace twinkle::tinker {

struct StabilityStoreOptions {
  absl::Duration retention = absl::Hours(24);
  int64_t max_tokens_per_tenant = int64_t{1} << 22;  // 4 Mi tokens, about 50 MiB
};

class StabilityStore {
 public:
  explicit StabilityStore(StabilityStoreOptions options = {}) : options_(options) {}

  // Records one sampled sequence. A sequence longer than the tenant's whole budget is not
  // kept (training on it then fails with the unknown-sequence error).
  void Record(const std::string& tenant, const std::string& sequence_id,
              std::shared_ptr<const std::vector<int64_t>> prompt, std::vector<int64_t> tokens,
              std::vector<float> logprobs, absl::Time now);

  // Resolves `proto`'s provenance against the tenant's records and writes the loss inputs
  // stable_reinforce takes into `datum`: "logprobs" (the recorded sampler log-prob at every
  // position a SampledProvenanceSpan covers; 0 elsewhere) and "stability_mask" (1 there, 0 at
  // positions a PromptProvenanceSpan covers). Checks that both span lists are present and
  // tile their fields, and that every covered token is the recorded one; renews every
  // record it uses. InvalidArgument naming `field` and the span otherwise.
  absl::Status Resolve(const std::string& tenant, const ::tinker::v1::Datum& proto, const std::string& field,
                       training::TokenDatum& datum, absl::Time now);

  // Records held (tests, metrics).
  int64_t TokensHeld(const std::string& tenant) const;

 private:
  struct Record_ {
    std::shared_ptr<const std::vector<int64_t>> prompt;
    std::vector<int64_t> tokens;
    std::vector<float> logprobs;
    absl::Time expires;
    int64_t cost = 0;
  };
  struct Tenant {
    absl::flat_hash_map<std::string, Record_> records;
    int64_t tokens = 0;
    absl::Time last_sweep = absl::InfinitePast();
  };
  // Drops the tenant's expired records, at most once a minute (a whole pass over them);
  // between sweeps an expired record is still refused where it is looked up.
  void DropExpiredLocked(Tenant& t, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const StabilityStoreOptions options_;
  mutable absl::Mutex mu_;
  std::map<std::string, Tenant> tenants_ ABSL_GUARDED_BY(mu_);
};

}  // namespace twinkle::tinker
