#pragma once
// The sampler's paged KV cache: one pool of fixed-size blocks per worker, allocated once at
// load_model. Per layer K and V are [num_blocks, block_size, kv_heads, head_dim] tensors in
// the model's dtype on its device (DecoderModel::PagedKv); a sequence holds a block table
// (its blocks in token order). Blocks are reference counted so that the samples of one
// request can share the blocks that hold only prompt tokens; a block returns to the free
// list when its last holder lets go.
//
// Hybrid models (Qwen3.5) have no K/V in their Gated DeltaNet layers but a fixed-size state
// per sequence instead: a conv state and a delta-rule state per DeltaNet layer
// (DecoderModel::PagedKv::conv/recurrent). The pool holds a fixed number of such state
// slots; every running sequence holds one (StateSlot) from admission to its end.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "core/engine/model/decoder.h"

namespace twinkle::engine {

inline constexpr int64_t kDefaultKvCacheBlocks = 2048;
inline constexpr int64_t kDefaultKvBlockSize = 16;
// Recurrent state slots of a hybrid model: the most sequences that run at once. A slot of
// Qwen3.5-4B holds ~50 MB of float32 state, so this is far below the block count.
inline constexpr int64_t kDefaultStateSlots = 64;

// The sampler cache's sizes, as load_model asks for them; 0 = the defaults above (state
// slots only for hybrid models: a dense model gets none).
struct KvCacheSize {
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  int64_t state_slots = 0;
};

class KvBlockPool {
 public:
  // InvalidArgument for negative or absurd sizes; the allocation itself may throw (out of
  // memory), which the caller reports.
  static absl::StatusOr<std::unique_ptr<KvBlockPool>> Create(const ModelConfig& config, KvCacheSize size,
                                                             at::ScalarType dtype, c10::Device device);

  int64_t total() const { return static_cast<int64_t>(refs_.size()); }
  int64_t free() const { return static_cast<int64_t>(free_.size()); }
  int64_t in_use() const { return total() - free(); }
  int64_t block_size() const { return kv_.block_size; }
  DecoderModel::PagedKv& kv() { return kv_; }

  // n free blocks (the caller checked free() >= n), each with one reference.
  std::vector<int64_t> Take(int64_t n);
  void Retain(int64_t block);
  // Drops one reference (false, and nothing changes, for a block that is free: a bug).
  bool Release(int64_t block);
  // Copies the first `tokens` slots of block `from` into block `to`, every layer, K and V.
  void CopySlots(int64_t from, int64_t to, int64_t tokens);

  // Recurrent state slots (0 of them for a dense model).
  int64_t states_total() const { return static_cast<int64_t>(state_used_.size()); }
  int64_t states_free() const { return static_cast<int64_t>(free_states_.size()); }
  // A free slot (the caller checked states_free() > 0); its contents are whatever the last
  // holder left: a prefill overwrites them.
  int64_t TakeState();
  // false, and nothing changes, for a slot that is not taken (a bug).
  bool ReleaseState(int64_t slot);
  // Copies slot `from`'s conv and recurrent states into slot `to`, every DeltaNet layer.
  void CopyState(int64_t from, int64_t to);

 private:
  KvBlockPool() = default;

  DecoderModel::PagedKv kv_;
  std::vector<int64_t> free_;  // a stack: the most recently freed block is reused first
  std::vector<int32_t> refs_;  // per block; 0 = free
  std::vector<int64_t> free_states_;  // a stack, like free_
  std::vector<bool> state_used_;      // per state slot
};

// A sequence's recurrent state slot; released when reset or destroyed.
class StateSlot {
 public:
  StateSlot() = default;
  StateSlot(KvBlockPool* pool, int64_t slot) : pool_(pool), slot_(slot) {}
  StateSlot(StateSlot&& other) noexcept : pool_(other.pool_), slot_(other.slot_) {
    other.slot_ = -1;
  }
  StateSlot& operator=(StateSlot&& other) noexcept {
    if (this != &other) {
      Reset();
      pool_ = other.pool_;
      slot_ = other.slot_;
      other.slot_ = -1;
    }
    return *this;
  }
  StateSlot(const StateSlot&) = delete;
  StateSlot& operator=(const StateSlot&) = delete;
  ~StateSlot() { Reset(); }

  void Reset() {
    if (slot_ >= 0) pool_->ReleaseState(slot_);
    slot_ = -1;
  }
  int64_t slot() const { return slot_; }  // -1: none

 private:
  KvBlockPool* pool_ = nullptr;
  int64_t slot_ = -1;
};

// A sequence's block table; every block it holds is released when it is cleared or dies.
class BlockTable {
 public:
  explicit BlockTable(KvBlockPool* pool = nullptr) : pool_(pool) {}
  BlockTable(BlockTable&& other) noexcept;
  BlockTable& operator=(BlockTable&& other) noexcept;
  BlockTable(const BlockTable&) = delete;
  BlockTable& operator=(const BlockTable&) = delete;
  ~BlockTable() { Clear(); }

  // Adds a block this table now holds one reference of.
  void Append(int64_t block) { blocks_.push_back(block); }
  void Clear();
  const std::vector<int64_t>& blocks() const { return blocks_; }

 private:
  KvBlockPool* pool_ = nullptr;
  std::vector<int64_t> blocks_;
};

}  // namespace twinkle::engine
