#pragma once
// Activation memory of one forward_backward, as the engine estimates it (issue 17 item 5).
//
// The engine works out three coefficients when it loads the model (ActivationCostOf,
// core/engine/model/activation_memory.h: the one place that knows what a step keeps) and
// reports them in its load_model reply; the coordinator evaluates them per request with
// EstimateActivationBytes, without torch, to admit or refuse work before any device memory
// is spent (engine.activation_memory_mib, docs/architecture.md "Training memory").
//
//   bytes(request) = fixed + chunk_row · min(chunk_rows, Σ L_i) + token · Σ L_i + seq_sq · Σ L_i²
//
// over the request's sequences. fixed: what a step takes whatever its length (the runtime's
// workspaces and allocator slack); chunk_row · min(...): one chunk of lm_head logits and its
// gradient (chunks never straddle a request, so a short one has a short chunk);
// token: what each token keeps until backward plus the backward's working set, per token;
// seq_sq: a sequence's attention scores where the attention kernel materialises them (0
// where it runs a flash kernel: CPU, and CUDA in half precision).
// A fused step is estimated as the sum of its ops' estimates (each op counted with its own
// fixed and chunk terms, though the step runs one chunk at a time: an over-estimate, on the
// safe side).

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace twinkle {

struct ActivationCost {
  int64_t fixed_bytes = 0;
  int64_t token_bytes = 0;
  int64_t seq_sq_bytes = 0;
  int64_t chunk_rows = 0;       // rows per chunk of logits (the engine's LogitChunkRows)
  int64_t chunk_row_bytes = 0;  // bytes per row of a chunk
  // False when the engine reported nothing (an older engine, a fake): no estimate.
  bool known() const { return token_bytes > 0; }
};

// The estimate for one request of sequences `lengths`; 0 when the cost is not known.
// Saturates at INT64_MAX instead of overflowing.
inline int64_t EstimateActivationBytes(const ActivationCost& cost, const std::vector<int64_t>& lengths) {
  if (!cost.known()) return 0;
  constexpr double kMax = static_cast<double>(std::numeric_limits<int64_t>::max());
  double tokens = 0, squares = 0;
  for (int64_t len : lengths) {
    tokens += static_cast<double>(len);
    squares += static_cast<double>(len) * static_cast<double>(len);
  }
  const double chunk = std::min(static_cast<double>(cost.chunk_rows), tokens);
  const double bytes = static_cast<double>(cost.fixed_bytes) + static_cast<double>(cost.chunk_row_bytes) * chunk +
                       static_cast<double>(cost.token_bytes) * tokens + static_cast<double>(cost.seq_sq_bytes) * squares;
  return bytes >= kMax ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(bytes);
}

}  // namespace twinkle
