#pragma once
// splitmix64 (Steele, Lea, Flood 2014): one step of the finaliser. Neighbouring inputs (an
// adapter's seed, step, micro-batch, layer; a sample's seed and index) get unrelated outputs,
// which the engine uses to seed independent random streams.

#include <cstdint>

namespace twinkle {

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace twinkle
