#pragma once
// The sampler's paged KV cache: one pool of fixed-size blocks per worker, allocated once at
// load_model. Per layer K and V are [num_blocks, block_size, kv_heads, head_dim] tensors in
// the model's dtype on its device (DecoderModel::PagedKv); a sequence holds a block table
// (its blocks in token order). Blocks are reference counted so that the samples of one
// request can share the blocks that hold only prompt tokens; a block returns to the free
// list when its last holder lets go.

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

class KvBlockPool {
 public:
  // num_blocks / block_size 0 = the defaults above. InvalidArgument for negative or absurd
  // sizes; the allocation itself may throw (out of memory), which the caller reports.
  static absl::StatusOr<std::unique_ptr<KvBlockPool>> Create(const ModelConfig& config,
                                                             int64_t num_blocks, int64_t block_size,
                                                             at::ScalarType dtype,
                                                             c10::Device device);

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

 private:
  KvBlockPool() = default;

  DecoderModel::PagedKv kv_;
  std::vector<int64_t> free_;  // a stack: the most recently freed block is reused first
  std::vector<int32_t> refs_;  // per block; 0 = free
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
