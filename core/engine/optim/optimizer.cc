#include "core/engine/optim/optimizer.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cctype>
#include <cmath>
#include <exception>
#include <limits>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace twinkle::engine {
namespace {

std::string ShapeString(at::IntArrayRef sizes) {
  return absl::StrCat("[", absl::StrJoin(sizes, ", "), "]");
}

// The IPC dtype names (what a checkpoint or a client calls them), not c10's "Float".
std::string DtypeName(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return "float32";
    case at::kDouble:
      return "float64";
    case at::kBFloat16:
      return "bfloat16";
    case at::kHalf:
      return "float16";
    case at::kLong:
      return "int64";
    case at::kInt:
      return "int32";
    default:
      return std::string(c10::toString(type));
  }
}

std::string TypeAndShape(const at::Tensor& t) {
  return absl::StrCat(DtypeName(t.scalar_type()), ShapeString(t.sizes()));
}

std::string Describe(const at::Tensor& t) {
  return absl::StrCat(TypeAndShape(t), " on ", t.device().str());
}

// Checks one hyperparameter; `ok` is the field's valid range, `range` says it in words.
absl::Status CheckField(absl::string_view name, double value, bool ok, absl::string_view range) {
  if (std::isfinite(value) && ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("optimizer hyperparameter ", name,
                                                 " must be finite and ", range, ", got ", value));
}

// torch.nn.utils.get_total_norm over non-empty `tensors`: per-tensor norms (what
// _foreach_norm computes on CPU), then the norm of their stack.
at::Tensor TotalNorm(const std::vector<at::Tensor>& tensors, GradNormType type) {
  const double ord = type == GradNormType::kL2 ? 2.0 : std::numeric_limits<double>::infinity();
  std::vector<at::Tensor> norms;
  norms.reserve(tensors.size());
  for (const at::Tensor& t : tensors) norms.push_back(at::linalg_vector_norm(t, ord));
  return at::linalg_vector_norm(at::stack(norms), ord);
}

// torch.nn.utils.clip_grads_with_norm_'s factor, min(1, max_norm / (total + 1e-6)), with the
// same tensor arithmetic (a float divided by a tensor is reciprocal * float in torch), so the
// scaled gradients match torch's bit for bit.
at::Tensor ClipCoefficient(const at::Tensor& total, double max_norm) {
  return (at::reciprocal(total + 1e-6) * max_norm).clamp_max(1.0);
}

}  // namespace

absl::StatusOr<GradNormType> ParseGradNormType(double norm_type) {
  if (norm_type == 2.0) return GradNormType::kL2;
  if (std::isinf(norm_type) && norm_type > 0) return GradNormType::kInf;
  return absl::InvalidArgumentError(
      absl::StrCat("norm_type must be 2 or inf, got ", norm_type));
}

Optimizer::Optimizer(Kind kind, std::vector<at::Tensor> params)
    : kind_(kind), params_(std::move(params)) {
  if (kind_ == Kind::kSgd) {
    momentum_buffer_.resize(params_.size());
    return;
  }
  for (const at::Tensor& p : params_) {
    exp_avg_.push_back(at::zeros_like(p, at::MemoryFormat::Preserve));
    exp_avg_sq_.push_back(at::zeros_like(p, at::MemoryFormat::Preserve));
  }
}

absl::StatusOr<std::unique_ptr<Optimizer>> Optimizer::Create(const std::string& kind,
                                                             std::vector<at::Tensor> params) {
  std::string lower = kind;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  Kind k;
  if (lower == "adamw") {
    k = Kind::kAdamW;
  } else if (lower == "adam") {
    k = Kind::kAdam;
  } else if (lower == "sgd") {
    k = Kind::kSgd;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown optimizer '", kind, "' (accepted: adamw, adam, sgd)"));
  }
  if (params.empty()) {
    return absl::InvalidArgumentError("optimizer got an empty parameter list");
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].defined() || !at::isFloatingType(params[i].scalar_type())) {
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer param ", i, " must be a defined floating-point tensor"));
    }
  }
  try {
    return std::unique_ptr<Optimizer>(new Optimizer(k, std::move(params)));
  } catch (const std::exception& e) {  // allocation of the moments (e.g. out of memory)
    return absl::ResourceExhaustedError(absl::StrCat("optimizer state: ", e.what()));
  }
}

absl::Status Optimizer::ValidateHyper(const OptimizerHyper& h) const {
  absl::Status s = CheckField("learning_rate", h.learning_rate, h.learning_rate >= 0, ">= 0");
  if (s.ok()) s = CheckField("weight_decay", h.weight_decay, h.weight_decay >= 0, ">= 0");
  if (s.ok()) s = CheckField("grad_clip_norm", h.grad_clip_norm, h.grad_clip_norm >= 0, ">= 0");
  if (!s.ok()) return s;
  if (kind_ == Kind::kSgd) {
    s = CheckField("momentum", h.momentum, h.momentum >= 0, ">= 0");
    if (s.ok()) s = CheckField("dampening", h.dampening, true, "a number");
    if (s.ok() && h.nesterov && (h.momentum <= 0 || h.dampening != 0)) {
      s = absl::InvalidArgumentError(
          "optimizer hyperparameter nesterov requires momentum > 0 and dampening == 0");
    }
    return s;
  }
  s = CheckField("beta1", h.beta1, h.beta1 >= 0 && h.beta1 < 1, "in [0, 1)");
  if (s.ok()) s = CheckField("beta2", h.beta2, h.beta2 >= 0 && h.beta2 < 1, "in [0, 1)");
  if (s.ok()) s = CheckField("eps", h.eps, h.eps > 0, "> 0");
  return s;
}

const char* Optimizer::kind_name() const {
  switch (kind_) {
    case Kind::kAdamW:
      return "adamw";
    case Kind::kAdam:
      return "adam";
    case Kind::kSgd:
      return "sgd";
  }
  return "?";
}

absl::Status Optimizer::ValidateGrads() const {
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    const at::Tensor& g = p.grad();
    if (g.defined() && (g.sizes() != p.sizes() || g.scalar_type() != p.scalar_type() ||
                        g.device() != p.device())) {
      return absl::InvalidArgumentError(absl::StrCat("gradient of optimizer param ", i, " is ",
                                                     Describe(g), ", expected ", Describe(p)));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<StepResult> Optimizer::Step(const OptimizerHyper& hyper) {
  if (absl::Status s = ValidateHyper(hyper); !s.ok()) return s;
  // Gradient shapes are checked before anything is touched, so a mismatch changes nothing.
  if (absl::Status s = ValidateGrads(); !s.ok()) return s;
  try {
    c10::NoGradGuard no_grad;
    // Undefined gradients become zeros so that the no-gradient step equals torch's step with
    // zero gradients, norm reduction included.
    std::vector<at::Tensor> grads;
    grads.reserve(params_.size());
    for (const at::Tensor& p : params_) {
      grads.push_back(p.grad().defined() ? p.grad().detach()
                                         : at::zeros_like(p, at::MemoryFormat::Preserve));
    }
    // Always computed: it is the reported grad_norm and the guard against NaN/Inf.
    const at::Tensor total = TotalNorm(grads, GradNormType::kL2);
    const double total_norm = total.item<double>();
    if (!std::isfinite(total_norm)) {
      return absl::FailedPreconditionError(
          absl::StrCat("gradient norm is ", total_norm, "; step ", step_ + 1,
                       " not applied (weights and optimizer state unchanged)"));
    }
    if (hyper.grad_clip_norm > 0) {
      // The caller's .grad() is left as accumulated; torch scales it in place, which no later
      // computation here reads (ClipGradNorm is the in-place form).
      const at::Tensor coef = ClipCoefficient(total, hyper.grad_clip_norm);
      if (coef.item<double>() < 1.0) {
        for (at::Tensor& g : grads) g = g * coef;
      }
    }
    if (kind_ == Kind::kSgd) {
      SgdStep(hyper, grads);
    } else {
      AdamStep(hyper, grads);
    }
    ++step_;
    return StepResult{total_norm, hyper.learning_rate, step_};
  } catch (const std::exception& e) {
    // Only device errors (e.g. out of memory) get here; the update may be partial.
    return absl::InternalError(absl::StrCat("optimizer step ", step_ + 1, ": ", e.what()));
  }
}

// torch.optim.adam._single_tensor_adam (capturable=False, amsgrad=False, maximize=False),
// which AdamW also runs with decoupled_weight_decay=True. Scalars are computed in double
// exactly as Python does before they reach the kernels.
void Optimizer::AdamStep(const OptimizerHyper& h, const std::vector<at::Tensor>& grads) {
  const double lr = h.learning_rate;
  const double step = static_cast<double>(step_ + 1);
  const double bias_correction1 = 1 - std::pow(h.beta1, step);
  const double bias_correction2 = 1 - std::pow(h.beta2, step);
  const double step_size = lr / bias_correction1;
  const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);  // Python's ** 0.5
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& param = params_[i];
    at::Tensor grad = grads[i];
    if (h.weight_decay != 0) {
      if (kind_ == Kind::kAdamW) {
        param.mul_(1 - lr * h.weight_decay);
      } else {
        grad = grad.add(param, h.weight_decay);
      }
    }
    exp_avg_[i].lerp_(grad, 1 - h.beta1);
    exp_avg_sq_[i].mul_(h.beta2).addcmul_(grad, grad, 1 - h.beta2);
    const at::Tensor denom = (exp_avg_sq_[i].sqrt() / bias_correction2_sqrt).add_(h.eps);
    param.addcdiv_(exp_avg_[i], denom, -step_size);
  }
}

// torch.optim.sgd._single_tensor_sgd (maximize=False).
void Optimizer::SgdStep(const OptimizerHyper& h, const std::vector<at::Tensor>& grads) {
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& param = params_[i];
    at::Tensor grad = grads[i];
    if (h.weight_decay != 0) grad = grad.add(param, h.weight_decay);
    if (h.momentum != 0) {
      at::Tensor& buf = momentum_buffer_[i];
      if (!buf.defined()) {
        buf = grad.detach().clone();  // torch seeds the buffer with the first gradient
      } else {
        buf.mul_(h.momentum).add_(grad, 1 - h.dampening);
      }
      grad = h.nesterov ? grad.add(buf, h.momentum) : buf;
    }
    param.add_(grad, -h.learning_rate);
  }
}

absl::StatusOr<double> Optimizer::ClipGradNorm(double max_norm, GradNormType norm_type) {
  if (!(max_norm >= 0)) {  // also refuses NaN; +inf is allowed (measure without clipping)
    return absl::InvalidArgumentError(absl::StrCat("max_norm must be >= 0, got ", max_norm));
  }
  if (absl::Status s = ValidateGrads(); !s.ok()) return s;
  try {
    c10::NoGradGuard no_grad;
    // As torch: parameters without a gradient take no part (a missing gradient is not a zero
    // one here, since nothing is scaled for it).
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : params_) {
      if (p.grad().defined()) grads.push_back(p.grad());
    }
    if (grads.empty()) return 0.0;
    const at::Tensor total = TotalNorm(grads, norm_type);
    const double total_norm = total.item<double>();
    if (!std::isfinite(total_norm)) return total_norm;
    const at::Tensor coef = ClipCoefficient(total, max_norm);
    for (at::Tensor& g : grads) g.mul_(coef);  // g shares its storage with .grad()
    return total_norm;
  } catch (const std::exception& e) {
    // Only device errors (e.g. out of memory) get here; some gradients may be scaled.
    return absl::InternalError(absl::StrCat("clip_grad_norm: ", e.what()));
  }
}

void Optimizer::ZeroGrad() {
  for (at::Tensor& p : params_) {
    if (p.grad().defined()) p.mutable_grad() = at::Tensor();
  }
}

std::vector<std::pair<std::string, at::Tensor>> Optimizer::StateTensors() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  out.emplace_back("step", at::scalar_tensor(step_, at::TensorOptions().dtype(at::kLong)));
  for (size_t i = 0; i < params_.size(); ++i) {
    if (kind_ == Kind::kSgd) {
      if (momentum_buffer_[i].defined()) {
        out.emplace_back(absl::StrCat("momentum_buffer.", i), momentum_buffer_[i]);
      }
    } else {
      out.emplace_back(absl::StrCat("exp_avg.", i), exp_avg_[i]);
      out.emplace_back(absl::StrCat("exp_avg_sq.", i), exp_avg_sq_[i]);
    }
  }
  return out;
}

absl::Status Optimizer::LoadState(const std::vector<std::pair<std::string, at::Tensor>>& state) {
  std::map<std::string, at::Tensor> by_name;
  for (const auto& [name, tensor] : state) {
    if (!tensor.defined()) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer state '", name, "' is undefined"));
    }
    if (!by_name.emplace(name, tensor).second) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer state '", name, "' appears twice"));
    }
  }
  std::set<std::string> used;
  // Returns the tensor stored under `name` after checking it against param i; an undefined
  // tensor when it is absent and `required` is false.
  auto take = [&](const std::string& name, size_t i, bool required) -> absl::StatusOr<at::Tensor> {
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      if (required) {
        return absl::InvalidArgumentError(absl::StrCat("optimizer state '", name, "' is missing"));
      }
      return at::Tensor();
    }
    const at::Tensor& p = params_[i];
    if (it->second.sizes() != p.sizes() || it->second.scalar_type() != p.scalar_type()) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer state '", name, "' is ",
                                                     TypeAndShape(it->second), ", expected ",
                                                     TypeAndShape(p)));
    }
    used.insert(name);
    return it->second;
  };

  auto step_it = by_name.find("step");
  if (step_it == by_name.end()) {
    return absl::InvalidArgumentError("optimizer state 'step' is missing");
  }
  const at::Tensor& step_tensor = step_it->second;
  if (step_tensor.dim() != 0 || step_tensor.scalar_type() != at::kLong) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer state 'step' must be a 0-d int64 ",
                                                   "tensor, got ", Describe(step_tensor)));
  }
  const int64_t step = step_tensor.item<int64_t>();
  if (step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer state 'step' is negative: ", step));
  }
  used.insert("step");

  std::vector<at::Tensor> first, second;  // exp_avg/exp_avg_sq or momentum buffers
  for (size_t i = 0; i < params_.size(); ++i) {
    const bool sgd = kind_ == Kind::kSgd;
    absl::StatusOr<at::Tensor> a =
        take(absl::StrCat(sgd ? "momentum_buffer." : "exp_avg.", i), i, /*required=*/!sgd);
    if (!a.ok()) return a.status();
    first.push_back(*a);
    if (sgd) continue;
    absl::StatusOr<at::Tensor> b = take(absl::StrCat("exp_avg_sq.", i), i, /*required=*/true);
    if (!b.ok()) return b.status();
    second.push_back(*b);
  }
  for (const auto& [name, tensor] : by_name) {
    if (used.count(name) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown optimizer state '", name, "' (expected step and, for each of the ",
          params_.size(), " params, ",
          kind_ == Kind::kSgd ? "momentum_buffer.N" : "exp_avg.N and exp_avg_sq.N", ")"));
    }
  }

  // Copies into fresh tensors laid out like the parameter (on its device), so the caller's
  // tensors are never aliased; swapped in only once every copy succeeded.
  std::vector<at::Tensor> new_first(params_.size()), new_second(second.size());
  try {
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& p = params_[i];
      if (first[i].defined()) {
        new_first[i] = at::empty_like(p, at::MemoryFormat::Preserve).copy_(first[i]);
      }
      if (i < second.size()) {
        new_second[i] = at::empty_like(p, at::MemoryFormat::Preserve).copy_(second[i]);
      }
    }
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("loading optimizer state: ", e.what()));
  }
  if (kind_ == Kind::kSgd) {
    momentum_buffer_ = std::move(new_first);
  } else {
    exp_avg_ = std::move(new_first);
    exp_avg_sq_ = std::move(new_second);
  }
  step_ = step;
  return absl::OkStatus();
}

}  // namespace twinkle::engine
