#include "core/training/inputs.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace twinkle::training {
namespace {

absl::Status CheckFinite(const std::vector<float>& values, const std::string& field) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "]: not a finite number"));
    }
  }
  return absl::OkStatus();
}

// Puts per-trained-token values (old/ref log-probs) onto the positions that have a label.
absl::StatusOr<std::vector<float>> Scatter(const std::vector<float>& values,
                                           const std::vector<float>& mask, const std::string& field) {
  int64_t trained = 0;
  for (float m : mask) trained += m != 0;
  if (static_cast<int64_t>(values.size()) != trained) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", values.size(),
                                                   " values for ", trained, " trained tokens (one per label != -100)"));
  }
  if (absl::Status s = CheckFinite(values, field); !s.ok()) return s;
  std::vector<float> out(mask.size(), 0.f);
  size_t k = 0;
  for (size_t i = 0; i < mask.size(); ++i) {
    if (mask[i] != 0) out[i] = values[k++];
  }
  return out;
}

}  // namespace

namespace {

// Tinker datums: targets and loss inputs are given per position, as they are.
absl::StatusOr<PackedOp> PackDatums(const ForwardArgs& args, int64_t vocab_size, int64_t max_tokens) {
  PackedOp op;
  if (!args.inputs.empty()) return absl::InvalidArgumentError("inputs and datums: give one of them, not both");
  for (size_t s = 0; s < args.datums.size(); ++s) {
    const TokenDatum& d = args.datums[s];
    const std::string where = absl::StrCat("data[", s, "]");
    const int64_t len = static_cast<int64_t>(d.input_tokens.size());
    if (len == 0) return absl::InvalidArgumentError(absl::StrCat(where, ".model_input: empty sequence"));
    for (const auto* tokens : {&d.input_tokens, &d.target_tokens}) {
      const char* field = tokens == &d.input_tokens ? "model_input" : "loss_fn_inputs.target_tokens";
      for (size_t i = 0; i < tokens->size(); ++i) {
        const int64_t t = (*tokens)[i];
        if (t < 0 || t >= vocab_size) {
          return absl::InvalidArgumentError(absl::StrCat(where, ".", field, "[", i, "]: token id ", t,
                                                         " outside [0, ", vocab_size, ")"));
        }
      }
    }
    const int64_t width = d.target_width;  // soft targets: [len, width]
    if (width < 0 || static_cast<int64_t>(d.target_tokens.size()) != len * std::max<int64_t>(width, 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".loss_fn_inputs.target_tokens: length ", d.target_tokens.size(),
                       " differs from the model_input length ", len, width > 0 ? absl::StrCat(" times ", width) : ""));
    }
    op.tokens += len;
    if (op.tokens > max_tokens) {
      return absl::InvalidArgumentError(absl::StrCat("data: the request holds more than ", max_tokens,
                                                     " tokens (limits.max_tokens_per_request)"));
    }
    ipc::DatumMsg datum;
    datum.input_tokens = ipc::AppendVectorFrame(d.input_tokens, op.buffers);
    datum.target_tokens = ipc::AppendVectorFrame(d.target_tokens, op.buffers);
    if (width > 0) datum.target_tokens.shape = {len, width};
    for (const auto& [name, values] : d.inputs) {
      const std::string field = absl::StrCat(where, ".loss_fn_inputs.", name);
      const bool per_target = width > 0 && static_cast<int64_t>(values.size()) == len * width;
      if (static_cast<int64_t>(values.size()) != len && !per_target) {
        return absl::InvalidArgumentError(absl::StrCat(field, ": length ", values.size(),
                                                       " differs from the model_input length ", len));
      }
      if (absl::Status st = CheckFinite(values, field); !st.ok()) return st;
      datum.inputs[name] = ipc::AppendVectorFrame(values, op.buffers);
      if (per_target) datum.inputs[name].shape = {len, width};
    }
    op.trained_tokens += len;
    op.msg.datums.push_back(std::move(datum));
    op.lengths.push_back(len);
  }
  if (args.loss) op.msg.loss = ipc::LossSpecMsg{args.loss->name, args.loss->config, args.loss->string_config};
  op.explicit_targets = true;
  return op;
}

}  // namespace

absl::StatusOr<PackedOp> PackForward(const ForwardArgs& args, int64_t vocab_size, int64_t max_tokens) {
  if (!args.datums.empty()) return PackDatums(args, vocab_size, max_tokens);
  if (args.inputs.empty()) return absl::InvalidArgumentError("inputs: empty batch (no sequences)");
  const size_t n = args.inputs.size();
  if (!args.advantages.empty() && args.advantages.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("advantages: ", args.advantages.size(),
                                                   " values for ", n, " sequences (one per sequence)"));
  }
  if (absl::Status s = CheckFinite(args.advantages, "advantages"); !s.ok()) return s;
  for (const auto* lists : {&args.old_logps, &args.ref_logps}) {
    if (!lists->empty() && lists->size() != n) {
      return absl::InvalidArgumentError(absl::StrCat(lists == &args.old_logps ? "old_logps" : "ref_logps", ": ",
                                                     lists->size(), " lists for ", n, " sequences"));
    }
  }
  PackedOp op;
  for (size_t s = 0; s < n; ++s) {
    const Feature& f = args.inputs[s];
    const std::string where = absl::StrCat("inputs[", s, "]");
    const int64_t len = static_cast<int64_t>(f.input_ids.size());
    if (len == 0) return absl::InvalidArgumentError(absl::StrCat(where, ".input_ids: empty sequence"));
    for (int64_t i = 0; i < len; ++i) {
      const int64_t t = f.input_ids[i];
      if (t < 0 || t >= vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat(where, ".input_ids[", i, "]: token id ", t,
                                                       " outside [0, ", vocab_size, ")"));
      }
    }
    const bool has_labels = !f.labels.empty();
    if (has_labels && static_cast<int64_t>(f.labels.size()) != len) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".labels: length ", f.labels.size(),
                                                     " differs from input_ids length ", len));
    }
    if (has_labels) {
      for (int64_t i = 0; i < len; ++i) {
        const int64_t t = f.labels[i];
        if (t != kIgnoreIndex && (t < 0 || t >= vocab_size)) {
          return absl::InvalidArgumentError(absl::StrCat(where, ".labels[", i, "]: token id ", t,
                                                         " outside [0, ", vocab_size, ") and not -100"));
        }
      }
    }
    op.tokens += len;
    if (op.tokens > max_tokens) {
      return absl::InvalidArgumentError(absl::StrCat("inputs: the request holds more than ", max_tokens,
                                                     " tokens (limits.max_tokens_per_request)"));
    }
    std::vector<int64_t> targets(len, 0);
    std::vector<float> mask(len, 0.f);
    for (int64_t i = 0; i + 1 < len; ++i) {
      const int64_t label = has_labels ? f.labels[i + 1] : f.input_ids[i + 1];
      if (label == kIgnoreIndex) {
        targets[i] = f.input_ids[i + 1];
      } else {
        targets[i] = label;
        mask[i] = 1.f;
        ++op.trained_tokens;
      }
    }
    ipc::DatumMsg datum;
    datum.input_tokens = ipc::AppendVectorFrame(f.input_ids, op.buffers);
    datum.target_tokens = ipc::AppendVectorFrame(targets, op.buffers);
    datum.inputs["mask"] = ipc::AppendVectorFrame(mask, op.buffers);
    if (!args.advantages.empty()) {
      // Zero where nothing is trained, so losses without a mask (Tinker's) train the same tokens.
      std::vector<float> adv(len, 0.f);
      for (int64_t i = 0; i < len; ++i) adv[i] = mask[i] * args.advantages[s];
      datum.inputs["advantages"] = ipc::AppendVectorFrame(adv, op.buffers);
    }
    if (!args.old_logps.empty()) {
      absl::StatusOr<std::vector<float>> lp = Scatter(args.old_logps[s], mask, absl::StrCat("old_logps[", s, "]"));
      if (!lp.ok()) return lp.status();
      datum.inputs["logprobs"] = ipc::AppendVectorFrame(*lp, op.buffers);
    }
    if (!args.ref_logps.empty()) {
      absl::StatusOr<std::vector<float>> lp = Scatter(args.ref_logps[s], mask, absl::StrCat("ref_logps[", s, "]"));
      if (!lp.ok()) return lp.status();
      datum.inputs["ref_logprobs"] = ipc::AppendVectorFrame(*lp, op.buffers);
    }
    op.msg.datums.push_back(std::move(datum));
    op.lengths.push_back(len);
  }
  if (args.loss) op.msg.loss = ipc::LossSpecMsg{args.loss->name, args.loss->config, args.loss->string_config};
  return op;
}

ipc::TrainOpMsg AppendFrames(const PackedOp& op, std::vector<std::string>& buffers) {
  const uint32_t offset = static_cast<uint32_t>(buffers.size());
  buffers.insert(buffers.end(), op.buffers.begin(), op.buffers.end());
  ipc::TrainOpMsg msg = op.msg;
  for (ipc::DatumMsg& d : msg.datums) {
    d.input_tokens.frame += offset;
    d.target_tokens.frame += offset;
    for (auto& [name, desc] : d.inputs) desc.frame += offset;
  }
  return msg;
}

}  // namespace twinkle::training
