#pragma once
// The training engine of one worker: the base model, the resident adapters, and the IPC
// methods that drive them (create/remove adapter, forward, forward_backward over a fused
// plan, optim_step, zero_grad, set_optimizer, clip_grad_norm, get/set adapter state).
//
// A forward or forward_backward request carries several ops, one per adapter (or base-only).
// Their datums are packed into one row batch: the base model runs ONCE over all rows, each
// op's rows get their adapter's LoRA terms, and each op's loss is computed over its own
// datums only. Adapters' parameters are disjoint, so the single backward over the summed
// losses gives every adapter exactly the gradient it would get alone.

#include <c10/core/Device.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/common/activation_memory.h"
#include "core/engine/distributed.h"
#include "core/engine/lora/adapter.h"
#include "core/engine/model/decoder.h"
#include "core/engine/request_handler.h"
#include "core/engine/sampler/sampler.h"
#include "core/ipc/forward_split.h"
#include "core/ipc/training_messages.h"

namespace twinkle::engine {

class Trainer {
 public:
  // max_lora_rank: create_adapter refuses larger ranks (0 = no limit). group: this rank's
  // data-parallel process group (null = a single rank): forward_backward then sums the
  // gradients of its request's allreduce_adapters over the ranks (docs/device_pool.md).
  Trainer(std::unique_ptr<DecoderModel> model, c10::Device device, int64_t max_lora_rank = 0,
          std::unique_ptr<ProcessGroup> group = nullptr);

  // The engine's activation-memory coefficients (for passes under max_pass_bytes).
  void set_activation_cost(const ActivationCost& cost) { activation_cost_ = cost; }

  // Allocates the sampler's KV cache (0 = defaults); before RegisterMethods.
  absl::Status InitSampler(at::ScalarType dtype, KvCacheSize cache_size);
  const Sampler& sampler() const { return *sampler_; }

  // Adds this trainer's methods to the worker's method table.
  void RegisterMethods(std::map<std::string, Method>& methods);

 private:
  absl::StatusOr<MethodReply> CreateAdapter(const ipc::Message& request);
  absl::StatusOr<MethodReply> RemoveAdapter(const ipc::Message& request);
  // A forward / forward_backward request: one pass, or (over its max_pass_bytes) several
  // passes whose gradients accumulate; on a rank of a process group, the all-reduce after.
  absl::StatusOr<MethodReply> Forward(const ipc::Message& request, bool backward);
  // The request's passes when its activation estimate is above its max_pass_bytes; none
  // (one pass) otherwise.
  absl::StatusOr<std::optional<ForwardSplit>> PlanPasses(const ipc::Message& request,
                                                         const ipc::ForwardRequest& req) const;
  // Runs `passes` one after the other (or `req` as one pass) and merges their replies.
  absl::StatusOr<MethodReply> RunPasses(const ipc::Message& request, const ipc::ForwardRequest& req,
                                        const std::optional<ForwardSplit>& passes, bool backward);
  struct PassOptions {
    // Whether this pass counts the adapters' micro-batch (else Forward counts it once).
    bool count_micro_batch = true;
    uint64_t pass = 0;  // index of this pass within its request
  };
  // One forward (and backward) over `req`'s ops.
  absl::StatusOr<MethodReply> ForwardPass(const ipc::Message& request, const ipc::ForwardRequest& req,
                                          bool backward, PassOptions options);
  absl::StatusOr<MethodReply> OptimStep(const ipc::Message& request);
  absl::StatusOr<MethodReply> ZeroGrad(const ipc::Message& request);
  absl::StatusOr<MethodReply> SetOptimizer(const ipc::Message& request);
  absl::StatusOr<MethodReply> ClipGradNorm(const ipc::Message& request);
  absl::StatusOr<MethodReply> GetAdapterState(const ipc::Message& request);
  absl::StatusOr<MethodReply> SetAdapterState(const ipc::Message& request);
  absl::StatusOr<MethodReply> RejoinGroup(const ipc::Message& request);

  // A method's reply: `body` packed, with `reply`'s tensor frames.
  template <typename T>
  static MethodReply Reply(const T& body, MethodReply reply = {}) {
    reply.envelope.body = ipc::Pack(body);
    return reply;
  }

  absl::StatusOr<Adapter*> FindAdapter(const std::string& id);
  // Data parallelism: after this rank's backward, `adapters`' gradients hold what this
  // rank's rows added (their earlier gradients moved to `earlier`, one per parameter in
  // named_parameters order, undefined when there were none). Sums the new gradients over the
  // ranks in one all-reduce and adds back the earlier ones, so every rank ends with the
  // gradient of the whole fused batch, accumulated as on one rank.
  absl::Status ReduceGradients(const std::vector<Adapter*>& adapters,
                               std::vector<at::Tensor> earlier);

  // A method body that names an adapter, decoded, with the adapter it names (NotFound else).
  template <typename Request>
  struct AdapterCall {
    Request request;
    Adapter* adapter;
  };
  template <typename Request>
  absl::StatusOr<AdapterCall<Request>> ParseAdapterCall(const ipc::Message& request,
                                                        const char* method);

  std::unique_ptr<DecoderModel> model_;
  c10::Device device_;
  int64_t max_lora_rank_ = 0;
  std::unique_ptr<ProcessGroup> group_;
  ActivationCost activation_cost_;
  std::map<std::string, std::unique_ptr<Adapter>> adapters_;
  // After adapters_: destroyed first, while the adapters its requests point to still exist.
  std::unique_ptr<Sampler> sampler_;
};

}  // namespace twinkle::engine
