#pragma once
// Learning-rate schedules for the Twinkle-native API, which sets one per adapter
// (set_lr_scheduler). Tinker clients schedule on their side and send the rate with each
// optim_step, so the Tinker surface never uses these.
//
// Each schedule is a pure function of (base_lr, step) in closed form: the only state is the
// step count its owner keeps (the training coordinator counts an adapter's acting lr_step
// calls), so checkpoints and restarts cannot desynchronize it. Torch-free: the coordinator
// and the engine's optimizer probe share it. torch's schedulers update the rate recursively; the closed forms below
// are the ones torch documents (and uses for scheduler.step(epoch)); they agree to rounding.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"

namespace twinkle::training {

// name (case-insensitive; Twinkle's class names are accepted as aliases) and its config:
//   constant                                   lr = base_lr
//   linear         (LinearLR)                  torch LinearLR: start_factor = 1/3,
//                                              end_factor = 1.0, total_iters = 5
//   cosine         (CosineAnnealingLR)         torch CosineAnnealingLR: T_max (required),
//                                              eta_min = 0
//   cosine_warmup  (CosineWarmupScheduler)     transformers get_cosine_schedule_with_warmup:
//                                              num_warmup_steps, num_training_steps
//                                              (required), num_cycles = 0.5
//   linear_warmup  (LinearWarmupScheduler)     transformers get_linear_schedule_with_warmup:
//                                              num_warmup_steps, num_training_steps (required)
struct SchedulerSpec {
  std::string name;
  std::map<std::string, double> config;
};

class LrScheduler {
 public:
  enum class Kind { kConstant, kLinear, kCosine, kCosineWarmup, kLinearWarmup };

  // Unknown name or config key, a missing required key, or an out-of-range value →
  // InvalidArgument that lists what is accepted.
  static absl::StatusOr<std::unique_ptr<LrScheduler>> Create(const SchedulerSpec& spec);

  // The rate for optimizer step number `step`, 0-based (the first step uses step 0): what
  // torch's scheduler.get_last_lr() returns after `step` calls of scheduler.step().
  double LearningRate(double base_lr, int64_t step) const;

  Kind kind() const { return kind_; }

 private:
  LrScheduler(Kind kind, std::map<std::string, double> config)
      : kind_(kind), config_(std::move(config)) {}

  double Get(const std::string& key) const { return config_.at(key); }

  Kind kind_;
  std::map<std::string, double> config_;  // every accepted key, defaults filled in
};

}  // namespace twinkle::training
