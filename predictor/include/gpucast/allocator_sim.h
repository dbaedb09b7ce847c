// gpucast/allocator_sim.h: a model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp),
// replaying an allocation stream to get what memory_allocated() and memory_reserved() would report.
//
// Modelled: 512-byte rounding (and roundup_power2_divisions); the small pool (requests <= 1 MiB, 2 MiB
// segments) and the large pool (20 MiB segments for requests below 10 MiB, else the request rounded up to
// 2 MiB); best fit by (stream, size, address); splitting (small: remainder >= 512 B; large: remainder
// > 1 MiB and request below max_split_size); coalescing of free neighbours within a segment; oversize
// blocks (max_split_size, max_non_split_rounding_mb); per-stream reuse; when the device is full, release
// cached oversize blocks, then all unsplit cached blocks, and retry, else out of memory; garbage collection
// (only with a memory fraction set); expandable segments. Not modelled: backend:cudaMallocAsync (the
// result says so), CUDA graphs' private pools, events that delay frees across streams.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace gpucast {

inline constexpr int64_t kMiB = 1024 * 1024;
// PyTorch's (torch 2.14.1): c10/core/AllocatorConfig.h:17 kSmallBuffer, :21 kSmallSize, :23 kMinLargeAlloc,
// :25 kRoundLarge; c10/core/AllocatorConfig.cpp: kRoundUpPowerOfTwoIntervals 16, kRoundUpPowerOfTwoStart 1 MiB.
inline constexpr int64_t kSmallSize = 1 * kMiB;       // largest request served by the small pool
inline constexpr int64_t kSmallBuffer = 2 * kMiB;     // small-pool segment
inline constexpr int64_t kMinLargeAlloc = 10 * kMiB;  // below this, large requests get a large segment
inline constexpr int64_t kRoundLarge = 2 * kMiB;      // large segments are multiples of this
inline constexpr int64_t kUnlimited = std::numeric_limits<int64_t>::max();
inline constexpr int kRoundupIntervals = 16;          // roundup_power2_divisions intervals from 1 MiB up

struct AllocatorConfig {
  // Defaults as torch 2.14.1's (c10/core/AllocatorConfig.h): large_segment_size_ 20 MiB :340, max_split_size_
  // unlimited :342, max_non_split_rounding 20 MiB :185-186.
  int64_t max_split_size = kUnlimited;            // max_split_size_mb
  int64_t max_non_split_rounding = 20 * kMiB;     // max_non_split_rounding_mb
  std::array<int64_t, kRoundupIntervals> roundup_power2_divisions{};  // 0: plain 512-byte rounding
  int64_t large_segment_size = 20 * kMiB;         // large_segment_size_mb
  double garbage_collection_threshold = 0.0;      // acts only with a memory fraction set
  bool expandable_segments = false;
  bool native_backend = true;                     // false for backend:cudaMallocAsync
  std::string source;                             // the text it was parsed from

  // PyTorch's grammar: "max_split_size_mb:128,roundup_power2_divisions:[256:1,512:2,>:4],...". Keys PyTorch
  // accepts that do not change what is reserved (pinned_*, release_lock_on_cudamalloc, ...) are accepted
  // and ignored. Throws UserError naming `what`, the key, the expected form and the value.
  static AllocatorConfig parse(std::string_view text, std::string_view what = "PYTORCH_ALLOC_CONF");
  // PYTORCH_ALLOC_CONF, else PYTORCH_CUDA_ALLOC_CONF (as PyTorch reads them), else defaults.
  static AllocatorConfig from_environment();

  int64_t divisions_for(int64_t size) const;
  int64_t round_size(int64_t size) const;         // block bytes of a request
  int64_t allocation_size(int64_t size) const;    // segment bytes for a rounded request
  // The largest request a new segment (or, with expandable segments, newly mapped pages) of at most `bytes`
  // could serve: what can be allocated while memory_reserved() grows by `bytes` at most.
  int64_t largest_request_in_segment(int64_t bytes) const;
};

struct SimOptions {
  int64_t capacity_bytes = kUnlimited;  // device memory the allocator may take (total minus context etc.)
  double memory_fraction = 0.0;         // torch.cuda.set_per_process_memory_fraction; 0 = not set
};

struct SimStats {
  int64_t allocated = 0;  // memory_allocated(): bytes of live blocks
  int64_t reserved = 0;   // memory_reserved(): bytes of segments
  int64_t requested = 0;  // bytes asked for by live allocations
  int64_t peak_allocated = 0;
  int64_t peak_reserved = 0;
  int64_t peak_requested = 0;
  int64_t segments = 0;
  int64_t peak_segments = 0;
  int64_t allocations = 0;
  int64_t alloc_retries = 0;  // mallocs that needed cached blocks released first
  int64_t ooms = 0;
  int64_t oversize_allocations = 0;
  int64_t released_segments = 0;  // segments given back by retries and garbage collection
};

class AllocatorSim {
 public:
  explicit AllocatorSim(AllocatorConfig config = {}, SimOptions options = {});
  ~AllocatorSim();
  AllocatorSim(AllocatorSim&&) noexcept;
  AllocatorSim& operator=(AllocatorSim&&) noexcept;

  // Allocates `bytes` for allocation `id` (ids are the caller's; unique among live allocations).
  // Returns false, counting an OOM and changing nothing, when the device cannot hold it.
  bool malloc(int64_t id, int64_t bytes, int stream = 0);
  // Frees allocation `id`; throws std::logic_error for an unknown id.
  void free(int64_t id);
  // torch.cuda.empty_cache(): releases every cached segment with no live block.
  void empty_cache();

  const SimStats& stats() const;
  const AllocatorConfig& config() const;
  // Block size the allocator would count for a live allocation (for tests and reports).
  int64_t block_bytes(int64_t id) const;
  // Address of a live allocation in the simulated address space (segments are laid out in order).
  int64_t address(int64_t id) const;
  // The largest request a cached free block on `stream` could serve now, without a new segment (small-pool
  // blocks serve requests up to 1 MiB).
  int64_t largest_cached_request(int stream = 0) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// One step of an allocation stream.
struct SimRequest {
  int64_t id = 0;
  int64_t bytes = 0;  // > 0 allocate `bytes` as allocation `id`; 0 free allocation `id`
  int stream = 0;
};

struct SimResult {
  SimStats stats;
  int64_t peak_allocated_index = -1;  // request at which peak_allocated is first reached
  int64_t peak_reserved_index = -1;
  int64_t oom_index = -1;             // first request that did not fit, -1 if all did
  double fragmentation = 0.0;         // 1 - allocated / reserved at the reserved peak
  bool reserved_modelled = true;      // false for backend:cudaMallocAsync
};

// Replays `requests`. An allocation that does not fit is counted (oom_index) and skipped, as is its free.
SimResult simulate(const std::vector<SimRequest>& requests, const AllocatorConfig& config = {},
                   const SimOptions& options = {});

}  // namespace gpucast
