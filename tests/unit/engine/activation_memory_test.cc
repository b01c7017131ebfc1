// The activation-memory estimate's shape (core/engine/model/activation_memory.h): what each
// setting changes, and how a request's lengths are evaluated (core/common/activation_memory.h).
// Its figures against measured memory: tests/engine/test_memory_estimate.py.
#include "core/engine/model/activation_memory.h"

#include <cstdint>
#include <limits>

#include <gtest/gtest.h>

namespace twinkle::engine {
namespace {

ModelConfig Dense() {
  ModelConfig c;
  c.vocab_size = 8000;
  c.hidden_size = 128;
  c.intermediate_size = 384;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 64;
  c.qk_norm = true;
  return c;
}

TEST(ActivationMemoryTest, SettingsMoveTheTermsTheyShould) {
  const ActivationSetup fp32{.itemsize = 4, .checkpointing = false, .logit_chunk_rows = 100,
                             .flash_attention = true, .max_lora_rank = 8};
  const ActivationCost plain = ActivationCostOf(Dense(), fp32);
  EXPECT_TRUE(plain.known());
  EXPECT_EQ(plain.chunk_rows, 100);
  EXPECT_EQ(plain.chunk_row_bytes, 8000 * (2 * 4 + 4));  // dtype product, two float32 copies
  EXPECT_EQ(plain.seq_sq_bytes, 0);                       // flash: no [L, L] scores

  ActivationSetup checkpointed = fp32;
  checkpointed.checkpointing = true;
  EXPECT_LT(ActivationCostOf(Dense(), checkpointed).token_bytes, plain.token_bytes);

  ActivationSetup bf16 = fp32;
  bf16.itemsize = 2;
  EXPECT_LT(ActivationCostOf(Dense(), bf16).token_bytes, plain.token_bytes);

  ModelConfig deeper = Dense();
  deeper.num_hidden_layers = 8;
  EXPECT_GT(ActivationCostOf(deeper, fp32).token_bytes, plain.token_bytes);
  EXPECT_EQ(ActivationCostOf(deeper, checkpointed).token_bytes - ActivationCostOf(Dense(), checkpointed).token_bytes,
            4 * 128 * 4);  // checkpointed: one [hidden] input more per layer

  ActivationSetup math = fp32;
  math.flash_attention = false;
  const int64_t all_layers = ActivationCostOf(Dense(), math).seq_sq_bytes;
  math.checkpointing = true;
  const int64_t one_layer = ActivationCostOf(Dense(), math).seq_sq_bytes;
  EXPECT_EQ(all_layers, (4 + 3) * 2 * 4);  // softmax per layer + scores, mask, gradient
  EXPECT_EQ(one_layer, (1 + 3) * 2 * 4);
}

TEST(ActivationMemoryTest, ARequestIsEvaluatedOverItsLengths) {
  const ActivationCost cost{.fixed_bytes = 1000, .token_bytes = 10, .seq_sq_bytes = 1, .chunk_rows = 50,
                            .chunk_row_bytes = 100};
  // 1000 + 100 · min(50, 30) + 10 · 30 + (10² + 20²)
  EXPECT_EQ(EstimateActivationBytes(cost, {10, 20}), 1000 + 3000 + 300 + 500);
  // the chunk stops growing at 50 rows
  EXPECT_EQ(EstimateActivationBytes(cost, {100}), 1000 + 5000 + 1000 + 10000);
  EXPECT_EQ(EstimateActivationBytes(ActivationCost{}, {100}), 0);  // unknown: no estimate
  EXPECT_EQ(EstimateActivationBytes(cost, {int64_t{1} << 40, int64_t{1} << 40}),
            std::numeric_limits<int64_t>::max());  // saturates
}

}  // namespace
}  // namespace twinkle::engine
