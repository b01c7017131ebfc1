#pragma once
// Internal to core/training's coordinator: the state it keeps per adapter and session and the
// payloads of its queued ops, shared by coordinator.cc (registry and submission),
// coordinator_checkpoints.cc (save, load, export) and coordinator_execution.cc (what runs on
// the scheduler thread). Not part of the library's interface.

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/time/time.h"
#include "core/ipc/envelope.h"
#include "core/ipc/training_messages.h"
#include "core/training/coordinator.h"
#include "core/training/inputs.h"
#include "core/training/lr_scheduler.h"

namespace twinkle::training {
namespace coordinator_internal {

inline constexpr char kLog[] = "training";
// Twinkle's transformers backend defaults (twinkle-api.md §7).
inline constexpr double kDefaultLr = 1e-5;
inline constexpr double kDefaultWeightDecay = 0.01;

inline bool IsTwinkleLoss(const std::string& name) { return name.rfind("twinkle:", 0) == 0; }

}  // namespace coordinator_internal

using coordinator_internal::kDefaultLr;
using coordinator_internal::kDefaultWeightDecay;


struct TrainingCoordinator::Session {
  std::string tenant;
  absl::Time last_heartbeat;
};

struct TrainingCoordinator::Adapter {
  // Fixed at creation.
  std::string tenant, name, key, run_id, session_id;
  LoraArgs lora;
  int32_t gradient_accumulation_steps = 1;
  absl::Time created;
  std::atomic<int64_t> last_request_ns{0};  // any thread: set at every submission

  // Scheduler thread only from here on.
  ipc::LossSpecMsg loss{"twinkle:cross_entropy", {}, {}};
  std::string optimizer_cls = "adamw";
  std::map<std::string, double> hyper = {{"learning_rate", kDefaultLr}, {"weight_decay", kDefaultWeightDecay}};
  std::optional<SchedulerSpec> schedule;
  std::unique_ptr<LrScheduler> scheduler;
  int64_t lr_steps = 0;        // lr_step calls that acted
  int64_t backward_count = 0;  // backwards ever: gates the accumulation window
  // A Twinkle token-mean loss over an accumulation window (gradient_accumulation_steps > 1,
  // see RunFused): the masked tokens of the window's backwards so far, and once the window
  // is complete the factor its gradients still need (applied by the first clip or step).
  int64_t window_tokens = 0;
  std::optional<double> pending_grad_scale;
  int64_t optimizer_steps = 0;

  bool created_on_engine = false;
  int64_t num_parameters = 0;
  bool resident = false;
  bool lost = false;           // the engine restarted while it was resident, with no restore point
  uint64_t generation = 0;
  uint64_t last_use = 0;
  // Offloaded: get_adapter_state's reply, set back on the device by EnsureResident.
  std::shared_ptr<const ipc::Message> host_state;
  // Resident (with CoordinatorOptions::restore_points): the adapter's complete state as of
  // its last state change other than a backward (creation, optimizer step, zero_grad,
  // set_optimizer, load, reload). An engine restart sets it back from here instead of losing
  // the adapter; the backwards run since are counted, because their gradients are lost.
  std::shared_ptr<const ipc::Message> restore_point;
  int64_t backwards_since_restore_point = 0;
  // Backwards whose gradients an engine restart lost: the next optimizer step refuses to
  // run on what is left (ABORTED, once) rather than step on partial gradients.
  int64_t lost_backwards = 0;

  std::optional<PackedOp> last_forward;
  // The estimated activation bytes of the last forward (kForward) submitted, for the
  // backward that recomputes it (set and read on submitting threads).
  std::atomic<int64_t> last_forward_activation_bytes{0};
  std::optional<double> last_loss;
  // calculate_metric accumulators since the last call.
  double loss_sum = 0;
  int64_t loss_count = 0;
  std::optional<double> last_grad_norm, last_lr;

  bool Synced() const {  // Twinkle's do_grad_sync, without its off-by-one
    return gradient_accumulation_steps <= 1 ||
           (backward_count > 0 && backward_count % gradient_accumulation_steps == 0);
  }
  double LearningRate() const {
    const double base = hyper.at("learning_rate");
    return scheduler ? scheduler->LearningRate(base, lr_steps) : base;
  }
};

struct TrainingCoordinator::FusedPayload {
  std::shared_ptr<Adapter> adapter;
  std::optional<PackedOp> packed;  // empty: Backward, which uses the adapter's last Forward
  ForwardMode mode = ForwardMode::kForwardOnly;
  bool disable_lora = false;
};

struct TrainingCoordinator::ControlPayload {
  std::function<FutureResult()> run;
};

}  // namespace twinkle::training
