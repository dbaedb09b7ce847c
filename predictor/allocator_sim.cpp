#include "gpucast/allocator_sim.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <map>
#include <set>
#include <stdexcept>
#include <unordered_map>

#include "gpucast/config.h"
#include "gpucast/error.h"

namespace gpucast {

// ---------------------------------------------------------------------------------------------------
// Configuration

namespace {

// 2^20 MB (1 TiB): a chosen bound on a size setting, above any device's memory.
constexpr long long kMaxSizeMb = 1 << 20;

int64_t parse_size_mb(std::string_view what, std::string_view key, std::string_view raw, int64_t min_mb) {
  std::string s(raw);
  char* end = nullptr;
  errno = 0;
  const long long v = s.empty() ? -1 : std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || end != s.c_str() + s.size() || errno != 0 || v < min_mb) {
    GPUCAST_USER_ERROR("{}: option '{}' expects an integer number of MiB >= {}, got '{}'", what, key, min_mb, raw);
  }
  // PyTorch caps these at SIZE_MAX / 1 MiB; gpucast at 1 TiB (2^20 MiB), beyond any device, so that sizes in
  // bytes and their sums stay far from int64_t's range.
  if (v > kMaxSizeMb) {
    GPUCAST_USER_ERROR("{}: option '{}' expects at most {} MiB, got '{}'", what, key, kMaxSizeMb, raw);
  }
  return static_cast<int64_t>(v) * kMiB;
}

bool parse_bool(std::string_view what, std::string_view key, std::string_view raw) {
  if (raw == "True" || raw == "true") return true;
  if (raw == "False" || raw == "false") return false;
  GPUCAST_USER_ERROR("{}: option '{}' expects True or False, got '{}'", what, key, raw);
}

int64_t parse_divisions(std::string_view what, std::string_view raw) {
  std::string s(raw);
  char* end = nullptr;
  const long long v = s.empty() ? -1 : std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || end != s.c_str() + s.size() || v < 0 || (v > 1 && !std::has_single_bit(static_cast<uint64_t>(v)))) {
    GPUCAST_USER_ERROR("{}: option 'roundup_power2_divisions' expects a power of two (or 0/1), got '{}'", what, raw);
  }
  return v;
}

}  // namespace

AllocatorConfig AllocatorConfig::parse(std::string_view text, std::string_view what) {
  AllocatorConfig c;
  c.source = std::string(text);
  for (const auto& [key, raw] : split_config(text, what)) {
    if (key == "max_split_size_mb" || key == "max_non_split_rounding_mb") {
      // torch 2.14.1 asks both >= large_segment_size_mb as parsed so far, left to right (20 by default):
      // c10/core/AllocatorConfig.cpp, parseMaxSplitSize and parseMaxNonSplitRoundingSize.
      const int64_t bytes = parse_size_mb(what, key, raw, c.large_segment_size / kMiB);
      (key == "max_split_size_mb" ? c.max_split_size : c.max_non_split_rounding) = bytes;
    } else if (key == "large_segment_size_mb") {
      // torch 2.14.1 asks > 10 (kMinLargeAlloc / kMB): c10/core/AllocatorConfig.cpp, parseLargeSegmentSize.
      c.large_segment_size = parse_size_mb(what, key, raw, kMinLargeAlloc / kMiB + 1);
    } else if (key == "garbage_collection_threshold") {
      std::string s(raw);
      char* end = nullptr;
      const double v = s.empty() ? NAN : std::strtod(s.c_str(), &end);
      if (s.empty() || end != s.c_str() + s.size() || !(v > 0.0 && v < 1.0)) {
        GPUCAST_USER_ERROR("{}: option 'garbage_collection_threshold' expects a number in (0, 1), got '{}'", what, raw);
      }
      c.garbage_collection_threshold = v;
    } else if (key == "expandable_segments") {
      c.expandable_segments = parse_bool(what, key, raw);
    } else if (key == "backend") {
      if (raw == "native") c.native_backend = true;
      else if (raw == "cudaMallocAsync") c.native_backend = false;
      else GPUCAST_USER_ERROR("{}: option 'backend' expects native or cudaMallocAsync, got '{}'", what, raw);
    } else if (key == "roundup_power2_divisions") {
      if (!raw.empty() && raw.front() == '[') {
        if (raw.back() != ']') {
          GPUCAST_USER_ERROR("{}: option 'roundup_power2_divisions' expects [size_mb:divisions,...,>:divisions], got '{}'", what, raw);
        }
        // Entries "<power-of-two MiB>:<divisions>" set the interval starting there and all later ones,
        // ">:<divisions>" the rest, as PyTorch does.
        // A view of `raw` itself (raw.substr would be a temporary string that dies with this statement).
        std::string_view body = std::string_view(raw).substr(1, raw.size() - 2);
        size_t last_index = 0;
        bool first = true;
        while (!body.empty()) {
          size_t comma = body.find(',');
          std::string_view item = body.substr(0, comma);
          body = comma == std::string_view::npos ? std::string_view() : body.substr(comma + 1);
          size_t colon = item.find(':');
          if (colon == std::string_view::npos) {
            GPUCAST_USER_ERROR("{}: option 'roundup_power2_divisions' expects [size_mb:divisions,...,>:divisions], got '{}'", what, raw);
          }
          std::string_view lhs = item.substr(0, colon);
          const int64_t div = parse_divisions(what, item.substr(colon + 1));
          if (lhs == ">") {
            for (size_t i = first ? 0 : last_index + 1; i < c.roundup_power2_divisions.size(); ++i) {
              c.roundup_power2_divisions[i] = div;
            }
            break;
          }
          std::string ls(lhs);
          char* end = nullptr;
          const long long mb = ls.empty() ? -1 : std::strtoll(ls.c_str(), &end, 10);
          if (ls.empty() || end != ls.c_str() + ls.size() || mb < 1 || !std::has_single_bit(static_cast<uint64_t>(mb))) {
            GPUCAST_USER_ERROR("{}: option 'roundup_power2_divisions' expects interval sizes that are powers of two in MiB, got '{}'", what, lhs);
          }
          const size_t index = std::min<size_t>(std::bit_width(static_cast<uint64_t>(mb)) - 1, kRoundupIntervals - 1);
          for (size_t i = first ? 0 : last_index + 1; i <= index; ++i) c.roundup_power2_divisions[i] = div;
          last_index = index;
          first = false;
        }
      } else {
        const int64_t div = parse_divisions(what, raw);
        c.roundup_power2_divisions.fill(div);
      }
    } else if (key.rfind("pinned_", 0) == 0 || key == "release_lock_on_cudamalloc" || key == "per_process_memory_fraction") {
      // Accepted by PyTorch; no effect on what the device allocator reserves, or handled through SimOptions.
    } else {
      GPUCAST_USER_ERROR(
          "{}: unknown option '{}'; valid options: max_split_size_mb, max_non_split_rounding_mb, large_segment_size_mb, "
          "roundup_power2_divisions, garbage_collection_threshold, expandable_segments, backend",
          what, key);
    }
  }
  return c;
}

AllocatorConfig AllocatorConfig::from_environment() {
  if (const char* v = std::getenv("PYTORCH_ALLOC_CONF"); v != nullptr && *v) return parse(v, "PYTORCH_ALLOC_CONF");
  if (const char* v = std::getenv("PYTORCH_CUDA_ALLOC_CONF"); v != nullptr && *v) {
    return parse(v, "PYTORCH_CUDA_ALLOC_CONF");
  }
  return {};
}

int64_t AllocatorConfig::divisions_for(int64_t size) const {
  // Intervals are powers of two from 1 MiB: [0, 2 MiB) is index 0, [2, 4) index 1, ..., clamped at 15.
  const int log_size = std::bit_width(static_cast<uint64_t>(size)) - 1;
  const int start = std::bit_width(static_cast<uint64_t>(kMiB)) - 1;
  const int index = std::clamp(log_size - start, 0, kRoundupIntervals - 1);
  return roundup_power2_divisions[static_cast<size_t>(index)];
}

int64_t AllocatorConfig::round_size(int64_t size) const {
  // c10/core/AllocatorConfig.h:19 kMinBlockSize; the rounding is c10/cuda/CUDACachingAllocator.cpp's round_size().
  constexpr int64_t kMinBlock = 512;
  if (size < kMinBlock) return kMinBlock;
  const int64_t divisions = divisions_for(size);
  if (divisions > 1 && size > kMinBlock * divisions) {
    if (std::has_single_bit(static_cast<uint64_t>(size))) return size;
    const auto floor = static_cast<int64_t>(std::bit_floor(static_cast<uint64_t>(size)));
    const int64_t step = floor / divisions;
    if (step == 0) return floor << 1;
    const int64_t base = size & ~(step - 1);
    return base == size ? size : base + step;
  }
  return kMinBlock * ((size + kMinBlock - 1) / kMinBlock);
}

int64_t AllocatorConfig::allocation_size(int64_t size) const {
  if (size <= kSmallSize) return kSmallBuffer;
  if (size < kMinLargeAlloc) return large_segment_size;
  return kRoundLarge * ((size + kRoundLarge - 1) / kRoundLarge);
}

int64_t AllocatorConfig::largest_request_in_segment(int64_t bytes) const {
  // The largest multiple of 512 in [lo, hi] for which `fits` holds (fits is monotonic there), else 0.
  // 512: kMinBlockSize (c10/core/AllocatorConfig.h:19).
  auto largest = [](int64_t lo, int64_t hi, auto fits) -> int64_t {
    lo = (lo + 511) / 512;
    hi /= 512;
    if (hi < lo || !fits(lo * 512)) return 0;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo + 1) / 2;
      if (fits(mid * 512)) lo = mid;
      else hi = mid - 1;
    }
    return lo * 512;
  };
  int64_t best = 0;
  if (bytes >= kSmallBuffer) best = kSmallSize;  // the small pool's 2 MiB segment (or page)
  if (expandable_segments) {
    // Large requests map pages of large_segment_size at the end of the stream's segment.
    return std::max(best, bytes / large_segment_size * large_segment_size);
  }
  if (bytes >= large_segment_size) {
    // Requests above 1 MiB whose rounded size stays below 10 MiB take a large_segment_size segment.
    best = std::max(best, largest(kSmallSize + 1, kMinLargeAlloc - 1,
                                  [&](int64_t w) { return round_size(w) < kMinLargeAlloc; }));
  }
  return std::max(best, largest(kMinLargeAlloc, bytes, [&](int64_t w) {
                    const int64_t r = round_size(w);
                    return r >= kMinLargeAlloc && allocation_size(r) <= bytes;
                  }));
}

// ---------------------------------------------------------------------------------------------------
// Simulation

namespace {

struct Pool;

struct Block {
  int64_t ptr = 0;
  int64_t size = 0;
  int64_t requested = 0;
  int stream = 0;
  bool allocated = false;
  Pool* pool = nullptr;
  Block* prev = nullptr;
  Block* next = nullptr;
  int64_t gc_base = 0;
  bool expandable = false;
  bool is_split() const { return prev != nullptr || next != nullptr; }
};

struct BySize {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    if (a->size != b->size) return a->size < b->size;
    return a->ptr < b->ptr;
  }
};

struct Pool {
  bool small = false;
  std::set<Block*, BySize> blocks;
  int64_t free_block_calls = 0;  // get_free_block calls, for garbage collection ages
};

// An expandable segment: one address range per (stream, pool) that grows by mapping pages at its end.
struct Expandable {
  int64_t base = 0;
  int64_t mapped = 0;
  int64_t page = 0;
  Block* last = nullptr;  // block ending at base + mapped (free or not)
};

}  // namespace

struct AllocatorSim::Impl {
  AllocatorConfig cfg;
  SimOptions opt;
  SimStats st;
  Pool small{true, {}, 0};
  Pool large{false, {}, 0};
  std::unordered_map<int64_t, Block*> live;
  std::map<std::pair<int, bool>, Expandable> expandable;
  // 2^40: a chosen start of the simulated addresses (any value works; they only order blocks).
  int64_t next_address = int64_t{1} << 40;

  ~Impl() {
    std::set<Block*> all;
    for (auto& [id, b] : live) all.insert(b);
    for (Block* b : small.blocks) all.insert(b);
    for (Block* b : large.blocks) all.insert(b);
    for (Block* b : all) delete b;
  }

  int64_t limit() const {
    if (opt.memory_fraction > 0.0 && opt.capacity_bytes != kUnlimited) {
      return static_cast<int64_t>(opt.memory_fraction * static_cast<double>(opt.capacity_bytes));
    }
    return opt.capacity_bytes;
  }
  bool fraction_set() const { return opt.memory_fraction > 0.0; }

  void insert(Block* b) {
    b->gc_base = b->pool->free_block_calls;
    b->pool->blocks.insert(b);
  }

  Block* get_free_block(Pool& pool, int stream, int64_t size) {
    if (fraction_set() && cfg.garbage_collection_threshold > 0.0) ++pool.free_block_calls;
    Block key;
    key.stream = stream;
    key.size = size;
    key.ptr = 0;
    auto it = pool.blocks.lower_bound(&key);
    if (it == pool.blocks.end() || (*it)->stream != stream) return nullptr;
    Block* b = *it;
    if (!b->expandable) {
      // Do not hand an oversize block to a small request, nor a much larger one to an oversize request.
      if (size < cfg.max_split_size && b->size >= cfg.max_split_size) return nullptr;
      if (size >= cfg.max_split_size && b->size >= size + cfg.max_non_split_rounding) return nullptr;
    }
    pool.blocks.erase(it);
    return b;
  }

  bool alloc_block(Pool& pool, int stream, int64_t size, int64_t alloc_size, bool retry, Block** out) {
    if (retry) ++st.alloc_retries;
    if (cfg.expandable_segments) return alloc_expandable(pool, stream, size, out);
    if (alloc_size > limit() - st.reserved) return false;
    auto* b = new Block();
    b->ptr = next_address;
    next_address += alloc_size;
    b->size = alloc_size;
    b->stream = stream;
    b->pool = &pool;
    st.reserved += alloc_size;
    ++st.segments;
    st.peak_reserved = std::max(st.peak_reserved, st.reserved);
    st.peak_segments = std::max(st.peak_segments, st.segments);
    *out = b;
    return true;
  }

  bool alloc_expandable(Pool& pool, int stream, int64_t size, Block** out) {
    Expandable& seg = expandable[{stream, pool.small}];
    if (seg.page == 0) {
      seg.page = pool.small ? kSmallBuffer : cfg.large_segment_size;
      seg.base = next_address;
      // 2^40: a chosen range, larger than any device's memory.
      next_address += int64_t{1} << 40;  // a large virtual range per segment
      ++st.segments;
      st.peak_segments = std::max(st.peak_segments, st.segments);
    }
    // Grow at the end: a free tail block is extended, otherwise a new block starts there.
    Block* tail = seg.last != nullptr && !seg.last->allocated ? seg.last : nullptr;
    const int64_t have = tail != nullptr ? tail->size : 0;
    const int64_t grow = (size - have + seg.page - 1) / seg.page * seg.page;
    if (grow > limit() - st.reserved) return false;
    st.reserved += grow;
    st.peak_reserved = std::max(st.peak_reserved, st.reserved);
    if (tail != nullptr) {
      pool.blocks.erase(tail);
      tail->size += grow;
    } else {
      tail = new Block();
      tail->ptr = seg.base + seg.mapped;
      tail->size = grow;
      tail->stream = stream;
      tail->pool = &pool;
      tail->expandable = true;
      tail->prev = seg.last;
      if (seg.last != nullptr) seg.last->next = tail;
      seg.last = tail;
    }
    seg.mapped += grow;
    *out = tail;
    return true;
  }

  void release_block(Block* b) {
    // Only whole cached segments (no neighbours) are given back.
    b->pool->blocks.erase(b);
    st.reserved -= b->size;
    --st.segments;
    ++st.released_segments;
    delete b;
  }

  bool release_available_cached_blocks(Pool& pool, int stream, int64_t size) {
    if (cfg.max_split_size == kUnlimited || cfg.expandable_segments) return false;
    Block key;
    key.stream = stream;
    key.size = std::max(size, cfg.max_split_size);
    key.ptr = 0;
    auto it = pool.blocks.lower_bound(&key);
    if (it == pool.blocks.end() || (*it)->stream != stream) {
      // No single oversize block is large enough: free oversize blocks, largest first.
      if (it == pool.blocks.begin()) return false;
      int64_t released = 0;
      --it;
      while (released < key.size && (*it)->size >= cfg.max_split_size && (*it)->stream == stream) {
        auto cur = it;
        const bool is_first = cur == pool.blocks.begin();
        if (!is_first) --it;
        Block* b = *cur;
        if (!b->is_split()) {
          released += b->size;
          release_block(b);
        }
        if (is_first) break;
      }
      return released >= key.size;
    }
    if ((*it)->is_split()) return false;
    release_block(*it);
    return true;
  }

  bool release_cached_blocks() {
    for (Pool* pool : {&large, &small}) {
      std::vector<Block*> whole;
      for (Block* b : pool->blocks) {
        if (!b->is_split() && !b->expandable) whole.push_back(b);
      }
      for (Block* b : whole) release_block(b);
    }
    release_expandable_tails();
    return true;
  }

  // Unmaps the free pages at the end of each expandable segment.
  void release_expandable_tails() {
    for (auto& [key, seg] : expandable) {
      Block* tail = seg.last;
      if (tail == nullptr || tail->allocated) continue;
      const int64_t pages = tail->size / seg.page * seg.page;
      if (pages == 0) continue;
      tail->pool->blocks.erase(tail);
      tail->size -= pages;
      seg.mapped -= pages;
      st.reserved -= pages;
      if (tail->size == 0) {
        seg.last = tail->prev;
        if (seg.last != nullptr) seg.last->next = nullptr;
        delete tail;
      } else {
        insert(tail);
      }
    }
  }

  void garbage_collect() {
    const auto threshold =
        static_cast<int64_t>(cfg.garbage_collection_threshold * static_cast<double>(limit()));
    if (st.reserved <= threshold) return;
    const int64_t target = st.reserved - threshold;
    int64_t total_age = 0, freeable = 0;
    for (Block* b : large.blocks) {
      if (!b->is_split() && !b->expandable) {
        total_age += large.free_block_calls - b->gc_base;
        ++freeable;
      }
    }
    if (freeable == 0) return;
    int64_t reclaimed = 0;
    bool freed = true;
    while (reclaimed < target && freed && freeable > 0) {
      const double age_threshold = static_cast<double>(total_age) / static_cast<double>(freeable);
      freed = false;
      std::vector<Block*> victims;
      for (Block* b : large.blocks) {
        const int64_t age = large.free_block_calls - b->gc_base;
        if (!b->is_split() && !b->expandable && static_cast<double>(age) >= age_threshold) victims.push_back(b);
      }
      for (Block* b : victims) {
        freed = true;
        reclaimed += b->size;
        total_age -= large.free_block_calls - b->gc_base;
        --freeable;
        release_block(b);
      }
    }
  }

  bool should_split(const Block* b, int64_t size) const {
    const int64_t remaining = b->size - size;
    // c10/cuda/CUDACachingAllocator.cpp, should_split(): 512 is kMinBlockSize (c10/core/AllocatorConfig.h:19).
    if (b->pool->small || cfg.expandable_segments) return remaining >= 512;
    return size < cfg.max_split_size && remaining > kSmallSize;
  }

  bool malloc(int64_t id, int64_t bytes, int stream) {
    if (live.count(id) != 0) throw std::logic_error("allocator simulation: allocation id already live");
    const int64_t size = cfg.round_size(bytes);
    Pool& pool = size <= kSmallSize ? small : large;
    const int64_t alloc_size = cfg.allocation_size(size);
    Block* b = get_free_block(pool, stream, size);
    if (b == nullptr) {
      if (fraction_set() && cfg.garbage_collection_threshold > 0.0) garbage_collect();
      const bool ok = alloc_block(pool, stream, size, alloc_size, false, &b) ||
                      (release_available_cached_blocks(pool, stream, size) &&
                       alloc_block(pool, stream, size, alloc_size, false, &b)) ||
                      (release_cached_blocks() && alloc_block(pool, stream, size, alloc_size, true, &b));
      if (!ok) {
        ++st.ooms;
        return false;
      }
    }
    if (should_split(b, size)) {
      // The front part is handed out; the remainder stays cached in the pool.
      auto* rest = new Block();
      rest->ptr = b->ptr + size;
      rest->size = b->size - size;
      rest->stream = b->stream;
      rest->pool = b->pool;
      rest->expandable = b->expandable;
      rest->prev = b;
      rest->next = b->next;
      if (rest->next != nullptr) rest->next->prev = rest;
      b->next = rest;
      b->size = size;
      if (b->expandable) {
        Expandable& seg = expandable[{b->stream, b->pool->small}];
        if (seg.last == b) seg.last = rest;
      }
      insert(rest);
    }
    b->allocated = true;
    b->requested = bytes;
    live[id] = b;
    ++st.allocations;
    if (b->size >= cfg.max_split_size) ++st.oversize_allocations;
    st.allocated += b->size;
    st.requested += bytes;
    st.peak_allocated = std::max(st.peak_allocated, st.allocated);
    st.peak_requested = std::max(st.peak_requested, st.requested);
    return true;
  }

  // Merges `src` into `dst` when `src` is a free neighbour; returns the bytes taken over.
  int64_t try_merge(Block* dst, Block* src) {
    if (src == nullptr || src->allocated) return 0;
    if (dst->prev == src) {
      dst->ptr = src->ptr;
      dst->prev = src->prev;
      if (dst->prev != nullptr) dst->prev->next = dst;
    } else {
      dst->next = src->next;
      if (dst->next != nullptr) dst->next->prev = dst;
    }
    if (src->expandable) {
      Expandable& seg = expandable[{src->stream, src->pool->small}];
      if (seg.last == src) seg.last = dst;
    }
    dst->size += src->size;
    src->pool->blocks.erase(src);
    const int64_t taken = src->size;
    delete src;
    return taken;
  }

  void free(int64_t id) {
    auto it = live.find(id);
    if (it == live.end()) throw std::logic_error("allocator simulation: free of an unknown allocation id");
    Block* b = it->second;
    live.erase(it);
    st.allocated -= b->size;
    st.requested -= b->requested;
    b->allocated = false;
    b->requested = 0;
    try_merge(b, b->prev);
    try_merge(b, b->next);
    insert(b);
  }
};

AllocatorSim::AllocatorSim(AllocatorConfig config, SimOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->cfg = std::move(config);
  impl_->opt = options;
}
AllocatorSim::~AllocatorSim() = default;
AllocatorSim::AllocatorSim(AllocatorSim&&) noexcept = default;
AllocatorSim& AllocatorSim::operator=(AllocatorSim&&) noexcept = default;

bool AllocatorSim::malloc(int64_t id, int64_t bytes, int stream) { return impl_->malloc(id, bytes, stream); }
void AllocatorSim::free(int64_t id) { impl_->free(id); }
void AllocatorSim::empty_cache() { impl_->release_cached_blocks(); }
const SimStats& AllocatorSim::stats() const { return impl_->st; }
const AllocatorConfig& AllocatorSim::config() const { return impl_->cfg; }

int64_t AllocatorSim::block_bytes(int64_t id) const {
  auto it = impl_->live.find(id);
  return it == impl_->live.end() ? 0 : it->second->size;
}
int64_t AllocatorSim::address(int64_t id) const {
  auto it = impl_->live.find(id);
  return it == impl_->live.end() ? 0 : it->second->ptr;
}

int64_t AllocatorSim::largest_cached_request(int stream) const {
  int64_t best = 0;
  for (const Pool* pool : {&impl_->large, &impl_->small}) {
    // Blocks are ordered by (stream, size, address): the stream's largest is the last one before the next stream.
    Block key;
    key.stream = stream + 1;
    key.size = 0;
    key.ptr = 0;
    auto it = pool->blocks.lower_bound(&key);
    if (it == pool->blocks.begin()) continue;
    const Block* b = *std::prev(it);
    if (b->stream != stream) continue;
    best = std::max(best, pool->small ? std::min(b->size, kSmallSize) : b->size);
  }
  return best;
}

SimResult simulate(const std::vector<SimRequest>& requests, const AllocatorConfig& config, const SimOptions& options) {
  AllocatorSim sim(config, options);
  SimResult r;
  r.reserved_modelled = config.native_backend;
  std::unordered_map<int64_t, bool> skipped;
  for (size_t i = 0; i < requests.size(); ++i) {
    const SimRequest& q = requests[i];
    if (q.bytes > 0) {
      const int64_t before_alloc = sim.stats().peak_allocated, before_res = sim.stats().peak_reserved;
      if (!sim.malloc(q.id, q.bytes, q.stream)) {
        if (r.oom_index < 0) r.oom_index = static_cast<int64_t>(i);
        skipped[q.id] = true;
        continue;
      }
      if (sim.stats().peak_allocated > before_alloc) {
        r.peak_allocated_index = static_cast<int64_t>(i);
      }
      if (sim.stats().peak_reserved > before_res) {
        r.peak_reserved_index = static_cast<int64_t>(i);
        r.fragmentation = sim.stats().reserved > 0
                              ? 1.0 - static_cast<double>(sim.stats().allocated) / static_cast<double>(sim.stats().reserved)
                              : 0.0;
      }
    } else {
      if (skipped.erase(q.id) != 0) continue;
      sim.free(q.id);
    }
  }
  r.stats = sim.stats();
  return r;
}

}  // namespace gpucast
