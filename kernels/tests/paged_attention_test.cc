// kernels::PagedDecodeAttention (the CPU fp32 kernel) and PagedDecodeAttentionGather (the
// path other devices and dtypes take) against a plain ATen reference: each sequence's keys
// and values laid out contiguously, softmax(q·kᵀ/√d)·v per head, GQA by repeating kv heads.
// Random block tables (shuffled, shared and unused blocks), several block sizes, lengths
// and head layouts; a sequence's output must not depend on the others in the batch.
// Tiny harness (no GoogleTest) as in lora_ops_test.cc. Exit status 0 = pass.

#include "kernels/paged_attention.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace twinkle::kernels {
namespace {

int g_failures = 0;

void ExpectClose(const std::string& what, const at::Tensor& got, const at::Tensor& want,
                 double tol) {
  const at::Tensor g = got.to(at::kDouble), w = want.to(at::kDouble);
  const double err = (g - w).abs().max().item<double>();
  if (!(err <= tol) || got.sizes() != want.sizes()) {
    ++g_failures;
    std::printf("FAIL %s: max |err| %.3g > %.1g\n", what.c_str(), err, tol);
  }
}

struct Case {
  int64_t block_size, heads, kv_heads, d;
  std::vector<int64_t> lengths;
};

void Run(const Case& c, std::mt19937& rng) {
  const int64_t total_blocks = 64;
  at::manual_seed(static_cast<uint64_t>(rng()));
  const at::Tensor k_cache = at::randn({total_blocks, c.block_size, c.kv_heads, c.d});
  const at::Tensor v_cache = at::randn({total_blocks, c.block_size, c.kv_heads, c.d});
  const int64_t s = static_cast<int64_t>(c.lengths.size());
  const at::Tensor q = at::randn({s, c.heads, c.d});
  std::vector<int64_t> order(total_blocks);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<std::vector<int64_t>> tables;
  std::vector<PagedSequenceView> views;
  size_t next = 0;
  for (int64_t len : c.lengths) {
    const int64_t n = (len + c.block_size - 1) / c.block_size;
    std::vector<int64_t> table;
    for (int64_t b = 0; b < n; ++b) table.push_back(order[next++ % order.size()]);
    table.push_back(order[next++ % order.size()]);  // a spare block past the length: unread
    tables.push_back(std::move(table));
  }
  for (size_t i = 0; i < tables.size(); ++i) views.push_back({tables[i].data(), c.lengths[i]});

  std::vector<at::Tensor> want;
  for (int64_t i = 0; i < s; ++i) {
    const int64_t len = c.lengths[i];
    const int64_t n = (len + c.block_size - 1) / c.block_size;
    const at::Tensor index =
        at::tensor(std::vector<int64_t>(tables[i].begin(), tables[i].begin() + n));
    auto seq = [&](const at::Tensor& cache) {
      return cache.index_select(0, index)
          .reshape({n * c.block_size, c.kv_heads, c.d})
          .narrow(0, 0, len)
          .to(at::kDouble)
          .repeat_interleave(c.heads / c.kv_heads, 1);  // [len, heads, d]
    };
    const at::Tensor k = seq(k_cache), v = seq(v_cache);
    const at::Tensor qi = q.select(0, i).to(at::kDouble);  // [heads, d]
    const at::Tensor scores =
        at::einsum("hd,thd->ht", {qi, k}) / std::sqrt(static_cast<double>(c.d));
    want.push_back(at::einsum("ht,thd->hd", {scores.softmax(-1), v}));
  }
  const at::Tensor reference = at::stack(want, 0);
  const std::string name = "B=" + std::to_string(c.block_size) +
                           " heads=" + std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) +
                           " d=" + std::to_string(c.d) + " S=" + std::to_string(s);
  const at::Tensor kernel = PagedDecodeAttention(q, k_cache, v_cache, views);
  ExpectClose(name + " kernel", kernel, reference, 2e-5);
  ExpectClose(name + " gather", PagedDecodeAttentionGather(q, k_cache, v_cache, views), reference,
              2e-5);
  ExpectClose(name + " gather bf16",
              PagedDecodeAttentionGather(q.to(at::kBFloat16), k_cache.to(at::kBFloat16),
                                         v_cache.to(at::kBFloat16), views)
                  .to(at::kFloat),
              reference, 0.1);
  // Each sequence alone gives bit for bit what it gets in the batch.
  for (int64_t i = 0; i < s; ++i) {
    const at::Tensor alone = PagedDecodeAttention(q.narrow(0, i, 1), k_cache, v_cache, {views[i]});
    if (!at::equal(alone, kernel.narrow(0, i, 1))) {
      ++g_failures;
      std::printf("FAIL %s: sequence %lld alone differs from the batch\n", name.c_str(),
                  static_cast<long long>(i));
    }
  }
}

}  // namespace
}  // namespace twinkle::kernels

int main() {
  using twinkle::kernels::Case;
  std::mt19937 rng(7);
  const std::vector<Case> cases = {
      {16, 4, 2, 16, {1, 5, 16, 17, 40}}, {3, 8, 8, 64, {1, 2, 3, 4, 30, 31}}, {1, 2, 1, 8, {1, 9}},
      {8, 6, 2, 12, {7, 8, 9, 50}},  // head_dim not a multiple of 8
      {16, 16, 4, 128, {100, 33}},
  };
  for (const Case& c : cases) twinkle::kernels::Run(c, rng);
  std::printf("%s\n", twinkle::kernels::g_failures == 0 ? "PASS" : "FAILED");
  return twinkle::kernels::g_failures == 0 ? 0 : 1;
}
