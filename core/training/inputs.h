#pragma once
// Validation of a caller's sequences and their conversion into one engine op.
//
// Every check names the offending field the way the caller spelled it
// ("inputs[2].input_ids[7]: token id 151936 outside [0, 151936)"), so a bad request is
// refused with INVALID_ARGUMENT before it is queued: a fused engine step never fails because
// of one tenant's input.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/ipc/training_messages.h"
#include "core/training/types.h"

namespace twinkle::training {

inline constexpr int64_t kIgnoreIndex = -100;

struct PackedOp {
  ipc::TrainOpMsg msg;                // adapter_id and loss left for the caller to fill
  std::vector<std::string> buffers;   // frames the msg's TensorDescs refer to (0-based)
  int64_t tokens = 0;                 // sum of sequence lengths
  int64_t trained_tokens = 0;         // positions with a label
  std::vector<int64_t> lengths;
  // Tinker datums: every position has a real target (the last one too).
  bool explicit_targets = false;
};

// max_tokens: the server's hard limit on one request (sum of sequence lengths).
// Datums get input_tokens, target_tokens (labels shifted: position i targets token i+1,
// or the next input token where nothing is trained; 0 at the last position), and
//   mask        1 where labels[i+1] != -100 (Twinkle losses; RenameForLoss adapts it)
//   advantages  the sequence's advantage at every trained position (0 elsewhere), when given
//   logprobs    old_logps scattered onto the trained positions, when given
//   ref_logprobs ref_logps likewise
absl::StatusOr<PackedOp> PackForward(const ForwardArgs& args, int64_t vocab_size,
                                     int64_t max_tokens);

// Moves `op`'s frames behind `buffers`, renumbering its TensorDescs; returns the message.
ipc::TrainOpMsg AppendFrames(const PackedOp& op, std::vector<std::string>& buffers);

}  // namespace twinkle::training
