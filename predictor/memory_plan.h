// memory_plan.h (internal): the memory forecast's allocation stream, as fitted to one batch size and rewritten by
// the parallel rules before it is replayed. Shared by memory_forecast.cpp and the strategies' rewrites
// (fsdp_memory.cpp); not part of the public interface.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "gpucast/trace.h"

namespace gpucast::detail {

constexpr int64_t kNone = -1;

// One allocation or free of a probe, in order. Allocations are numbered by position; a free names the
// position it frees (initial blocks are numbered -2, -3, ...). 32 bytes: a forecast holds a few copies of every
// probe's memory events, so the layout bounds its memory (bench/large_trace.py).
struct Entry {
  int64_t ref = 0;          // alloc: own position; free: position of the freed allocation
  int64_t bytes = 0;
  int32_t op = kNone;       // op in the probe's trace (extract() refuses traces of 2^31 ops or more)
  int32_t iteration = 1;
  Category category = Category::Other;
  Phase phase = Phase::Forward;
  bool alloc = true;
  bool conv_call = false;   // a marker (no bytes): a convolution call, where cuDNN would take its workspace
  bool probe_block = false; // alloc: a block the probe allocated, its address in Stream::ptr_of[position]

  static Entry made(bool alloc, int64_t ref, int64_t bytes, Category c, Phase ph, int32_t op, int32_t iteration) {
    return Entry{.ref = ref, .bytes = bytes, .op = op, .iteration = iteration, .category = c, .phase = ph,
                 .alloc = alloc};
  }
};
static_assert(sizeof(Entry) == 32, "Entry's layout bounds a forecast's memory");

// Refs of the second iteration synthesized from a one-iteration trace: the first iteration's plus this (2^40: a
// chosen offset, far above any position a trace reaches).
constexpr int64_t kSecondIterationRef = int64_t{1} << 40;

// Inserts `adds` (the index of the entry each goes before, in order of that index) into `entries` in place: a
// stream of millions of entries is not copied for a few additions (at most one reallocation, to the exact size).
inline void insert_before(std::vector<Entry>& entries, const std::vector<std::pair<size_t, Entry>>& adds) {
  if (adds.empty()) return;
  const size_t n = entries.size();
  entries.reserve(n + adds.size());
  entries.resize(n + adds.size());
  size_t to = entries.size();  // entries at [to, end) are final
  size_t from = n;             // entries [0, from) are still to move
  for (size_t k = adds.size(); k-- > 0;) {
    const size_t before = std::min(adds[k].first, n);
    while (from > before) entries[--to] = entries[--from];
    entries[--to] = adds[k].second;
  }
}

inline int64_t initial_ref(size_t i) { return -2 - static_cast<int64_t>(i); }

// The stream at one batch size, after parallel rules and target additions, ready to replay.
struct Planned {
  std::vector<int64_t> initial;
  std::vector<Category> initial_category;
  std::vector<Entry> entries;  // refs renumbered so that -2-i are initial blocks
};

}  // namespace gpucast::detail
