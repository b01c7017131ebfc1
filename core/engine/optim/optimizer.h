#pragma once
// Per-adapter optimizers (AdamW, Adam, SGD) that reproduce torch.optim's single-tensor CPU
// code path operation for operation, so a tenant training here gets the same numbers as the
// same script run against torch.optim locally.
//
// Gradient accumulation is the caller's business: several backward passes accumulate into
// each parameter's .grad(); Step() reads them (without modifying them) and the caller calls
// ZeroGrad() once it wants to start a new accumulation window. Tinker's optim_step is
// "Step then ZeroGrad".
//
// Hyperparameters arrive with every Step (Tinker sends AdamParams per call; schedules are
// client side), so the optimizer stores none of them, only the state tensors and the count.
//
// Clipping comes in two forms that share one implementation: Tinker's grad_clip_norm
// hyperparameter scales a copy of the gradients inside Step (the accumulated .grad() stays
// as it was), and Twinkle's explicit ClipGradNorm scales .grad() in place, as
// torch.nn.utils.clip_grad_norm_ does, for a later Step to read.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace twinkle::engine {

struct OptimizerHyper {
  double learning_rate = 1e-4;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  // AdamW: decoupled; Adam and SGD: L2 added to the gradient
  // SGD only.
  double momentum = 0.0;
  bool nesterov = false;
  double dampening = 0.0;
  // > 0: scale gradients so their global L2 norm (over this optimizer's params) is at most
  // this, as torch.nn.utils.clip_grad_norm_ does; 0 = off.
  double grad_clip_norm = 0.0;
};

// The norms ClipGradNorm accepts (torch accepts any p; Twinkle uses these two).
enum class GradNormType { kL2, kInf };

// `norm_type` as a client sends it (2 or +inf); InvalidArgument naming norm_type otherwise.
absl::StatusOr<GradNormType> ParseGradNormType(double norm_type);

struct StepResult {
  double grad_norm = 0;  // global L2 norm of the gradients before clipping
  double learning_rate = 0;
  int64_t step = 0;  // the optimizer's step count after this step (1 for the first)
};

class Optimizer {
 public:
  enum class Kind { kAdamW, kAdam, kSgd };

  // kind: "adamw" | "adam" | "sgd", case-insensitive (Twinkle spells them "AdamW", "Adam",
  // "SGD"). params: defined floating-point leaf tensors, at least one; they are updated in
  // place, so the caller keeps sharing them with its model.
  static absl::StatusOr<std::unique_ptr<Optimizer>> Create(const std::string& kind,
                                                           std::vector<at::Tensor> params);

  // One update with the gradients currently in .grad(). An undefined .grad() counts as zero
  // (a step with no gradient anywhere still applies weight decay and advances the moments),
  // unlike torch, which skips such a parameter: Tinker documents optim_step without a
  // preceding backward as a zero-gradient step.
  // Errors (nothing is modified): InvalidArgument for a bad hyperparameter (naming it) or a
  // gradient whose shape/dtype/device differs from its parameter; FailedPrecondition when the
  // gradient norm is NaN/Inf, so one bad batch cannot poison the adapter's weights.
  absl::StatusOr<StepResult> Step(const OptimizerHyper& hyper);

  // torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type) on the gradients currently
  // in .grad(): the total norm over the parameters that have a gradient (0 when none has),
  // then every gradient scaled in place by min(1, max_norm / (norm + 1e-6)). Returns the
  // total norm before clipping. Unlike torch, a NaN/Inf total norm leaves the gradients
  // untouched (torch would turn them all into NaN): the next Step refuses them anyway, and
  // the caller still gets the norm to report.
  // Errors (nothing is modified): InvalidArgument for a negative or NaN max_norm, or a
  // gradient whose shape/dtype/device differs from its parameter.
  absl::StatusOr<double> ClipGradNorm(double max_norm, GradNormType norm_type);

  // Drops the gradients (undefined, like torch's set_to_none=True): frees their memory until
  // the next backward, which then allocates fresh ones.
  void ZeroGrad();

  int64_t step() const { return step_; }
  Kind kind() const { return kind_; }
  // "adamw", "adam" or "sgd": the name Create accepts for this kind.
  const char* kind_name() const;
  const std::vector<at::Tensor>& params() const { return params_; }

  // Checkpoint state as ordered (name, tensor) pairs: "step" (0-d int64) first, then per
  // parameter i "exp_avg.i", "exp_avg_sq.i" (Adam/AdamW) or "momentum_buffer.i" (SGD, only
  // once a step with momentum created it, as in torch). The tensors alias the live state:
  // copy them before the next Step if they must stay fixed.
  std::vector<std::pair<std::string, at::Tensor>> StateTensors() const;

  // Replaces the state with `state` (as StateTensors produced it, tensors on any device).
  // Validates everything first — unknown, duplicate or missing names, shapes, dtypes — so a
  // failed load leaves the optimizer unchanged.
  absl::Status LoadState(const std::vector<std::pair<std::string, at::Tensor>>& state);

 private:
  Optimizer(Kind kind, std::vector<at::Tensor> params);

  absl::Status ValidateHyper(const OptimizerHyper& hyper) const;
  // InvalidArgument unless every defined .grad() matches its parameter.
  absl::Status ValidateGrads() const;
  void AdamStep(const OptimizerHyper& hyper, const std::vector<at::Tensor>& grads);
  void SgdStep(const OptimizerHyper& hyper, const std::vector<at::Tensor>& grads);

  Kind kind_;
  std::vector<at::Tensor> params_;
  // Adam/AdamW: allocated (zeros) at creation; torch allocates them lazily at the first
  // step with the same zeros, so the arithmetic is identical.
  std::vector<at::Tensor> exp_avg_;
  std::vector<at::Tensor> exp_avg_sq_;
  // SGD: undefined until the first step with momentum != 0 (torch seeds it with the gradient).
  std::vector<at::Tensor> momentum_buffer_;
  int64_t step_ = 0;
};

}  // namespace twinkle::engine
