#include "core/engine/sampler/kv_cache.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"

namespace twinkle::engine {

absl::StatusOr<std::unique_ptr<KvBlockPool>> KvBlockPool::Create(const ModelConfig& config,
                                                                 KvCacheSize size,
                                                                 at::ScalarType dtype,
                                                                 c10::Device device) {
  int64_t num_blocks = size.num_blocks, block_size = size.block_size, state_slots = size.state_slots;
  if (state_slots < 0 || state_slots > (int64_t{1} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("recurrent state slots (", state_slots, ") must be in [0, 2^20] (0 = default)"));
  }
  if (num_blocks < 0 || block_size < 0) {
    return absl::InvalidArgumentError(absl::StrCat("kv_cache_blocks (", num_blocks,
                                                   ") and kv_block_size (", block_size,
                                                   ") must be >= 0 (0 = default)"));
  }
  if (num_blocks == 0) num_blocks = kDefaultKvCacheBlocks;
  if (block_size == 0) block_size = kDefaultKvBlockSize;
  if (block_size > 4096 || num_blocks > (int64_t{1} << 31) / block_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV cache of ", num_blocks, " blocks x ", block_size,
                     " tokens is too large (at most 4096 tokens a block and 2^31 tokens in all)"));
  }
  std::unique_ptr<KvBlockPool> pool(new KvBlockPool());
  pool->kv_.block_size = block_size;
  const at::TensorOptions options = at::TensorOptions().dtype(dtype).device(device);
  if (config.hybrid() && state_slots == 0) state_slots = kDefaultStateSlots;
  if (!config.hybrid()) state_slots = 0;
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    if (config.hybrid()) {
      pool->kv_.conv.emplace_back();
      pool->kv_.recurrent.emplace_back();
    }
    if (config.is_linear_layer(l)) {
      // A DeltaNet layer keeps no K/V, only its per-sequence states (prefill writes them
      // whole before a decode step reads them). The delta-rule state stays float32, as
      // transformers keeps it.
      pool->kv_.k.emplace_back();
      pool->kv_.v.emplace_back();
      pool->kv_.conv.back() = at::zeros(
          {state_slots, config.linear_conv_dim(), config.linear_conv_kernel - 1}, options);
      pool->kv_.recurrent.back() =
          at::zeros({state_slots, config.linear_num_value_heads, config.linear_key_head_dim,
                     config.linear_value_head_dim},
                    options.dtype(at::kFloat));
      continue;
    }
    // Uninitialised: every slot is written before it is read. On CPU the pages are only
    // committed as blocks are first used.
    pool->kv_.k.push_back(
        at::empty({num_blocks, block_size, config.num_key_value_heads, config.head_dim}, options));
    pool->kv_.v.push_back(
        at::empty({num_blocks, block_size, config.num_key_value_heads, config.head_dim}, options));
  }
  pool->state_used_.assign(state_slots, false);
  pool->free_states_.reserve(state_slots);
  for (int64_t s = state_slots - 1; s >= 0; --s) pool->free_states_.push_back(s);
  pool->refs_.assign(num_blocks, 0);
  pool->free_.reserve(num_blocks);
  for (int64_t b = num_blocks - 1; b >= 0; --b) pool->free_.push_back(b);  // block 0 first
  return pool;
}

std::vector<int64_t> KvBlockPool::Take(int64_t n) {
  TORCH_CHECK(n >= 0 && n <= free(), "KvBlockPool: ", n, " blocks asked, ", free(), " free");
  std::vector<int64_t> out;
  out.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    out.push_back(free_.back());
    free_.pop_back();
    refs_[out.back()] = 1;
  }
  return out;
}

void KvBlockPool::Retain(int64_t block) {
  TORCH_CHECK(refs_.at(block) > 0, "KvBlockPool: retain of free block ", block);
  ++refs_[block];
}

bool KvBlockPool::Release(int64_t block) {
  if (block < 0 || block >= total() || refs_[block] <= 0) return false;
  if (--refs_[block] == 0) free_.push_back(block);
  return true;
}

int64_t KvBlockPool::TakeState() {
  TORCH_CHECK(!free_states_.empty(), "KvBlockPool: no free recurrent state slot");
  const int64_t slot = free_states_.back();
  free_states_.pop_back();
  state_used_[slot] = true;
  return slot;
}

bool KvBlockPool::ReleaseState(int64_t slot) {
  if (slot < 0 || slot >= states_total() || !state_used_[slot]) return false;
  state_used_[slot] = false;
  free_states_.push_back(slot);
  return true;
}

void KvBlockPool::CopyState(int64_t from, int64_t to) {
  for (size_t l = 0; l < kv_.conv.size(); ++l) {
    if (!kv_.conv[l].defined()) continue;
    kv_.conv[l].select(0, to).copy_(kv_.conv[l].select(0, from));
    kv_.recurrent[l].select(0, to).copy_(kv_.recurrent[l].select(0, from));
  }
}

void KvBlockPool::CopySlots(int64_t from, int64_t to, int64_t tokens) {
  for (size_t l = 0; l < kv_.k.size(); ++l) {
    if (!kv_.k[l].defined()) continue;  // a DeltaNet layer
    kv_.k[l]
        .select(0, to)
        .narrow(0, 0, tokens)
        .copy_(kv_.k[l].select(0, from).narrow(0, 0, tokens));
    kv_.v[l]
        .select(0, to)
        .narrow(0, 0, tokens)
        .copy_(kv_.v[l].select(0, from).narrow(0, 0, tokens));
  }
}

BlockTable::BlockTable(BlockTable&& other) noexcept
    : pool_(other.pool_), blocks_(std::move(other.blocks_)) {
  other.blocks_.clear();
}

BlockTable& BlockTable::operator=(BlockTable&& other) noexcept {
  if (this != &other) {
    Clear();
    pool_ = other.pool_;
    blocks_ = std::move(other.blocks_);
    other.blocks_.clear();
  }
  return *this;
}

void BlockTable::Clear() {
  for (int64_t b : blocks_) pool_->Release(b);
  blocks_.clear();
}

}  // namespace twinkle::engine
