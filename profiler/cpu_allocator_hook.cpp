// The CPU allocator wrapper: every CPU allocation and free made through c10's CPU allocator, including
// oneDNN's raw allocations, passes through here. It keeps the size of each live block (so that frees
// of blocks allocated before a trace are seen with their size) and forwards events to the tracer only
// while a trace runs. The DataPtr it returns has context == data, as raw_allocate requires.
#include <array>
#include <atomic>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include <c10/util/Exception.h>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/flat_hash_map.h>

#include "gpucast/allocation_refusal.h"
#include "gpucast/tracer.h"
#include "memory_sink.h"

namespace gpucast {
namespace {

// 16: a chosen shard count (lock contention against memory), not measured.
constexpr size_t kShards = 16;

struct Block {
  size_t bytes;
  uint64_t order;         // allocation order, so that baselines list blocks oldest first
  c10::DataPtr original;  // owns the memory; destroying it frees through the wrapped allocator
};

struct Shard {
  std::mutex mu;
  ska::flat_hash_map<void*, Block> blocks;  // open addressing: no allocation per block
};

class CpuAllocatorHook final : public c10::Allocator {
 public:
  explicit CpuAllocatorHook(c10::Allocator* wrapped) : wrapped_(wrapped) {}

  c10::DataPtr allocate(size_t n) override {
    if (AllocationRefusal::instance().pending()) refuse_if_asked();
    c10::DataPtr original = wrapped_->allocate(n);
    void* data = original.get();
    if (data == nullptr) return original;  // zero-byte allocations hold nothing
    {
      Shard& sh = shard(data);
      std::lock_guard<std::mutex> g(sh.mu);
      sh.blocks.insert_or_assign(data, Block{n, next_order_.fetch_add(1, std::memory_order_relaxed), std::move(original)});
    }
    const int64_t now = held_.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed) + static_cast<int64_t>(n);
    int64_t peak = peak_.load(std::memory_order_relaxed);
    while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
    if (detail::memory_recording()) {
      detail::record_memory_event(data, static_cast<int64_t>(n), static_cast<int64_t>(n), c10::Device(c10::kCPU));
    }
    return {data, data, &release, c10::Device(c10::kCPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    wrapped_->copy_data(dest, src, count);
  }

  static void release(void* data) {
    Block block{0, 0, c10::DataPtr()};
    {
      Shard& sh = shard(data);
      std::lock_guard<std::mutex> g(sh.mu);
      auto it = sh.blocks.find(data);
      if (it == sh.blocks.end()) return;  // cannot happen: every pointer we hand out is in the table
      block = std::move(it->second);
      sh.blocks.erase(it);
    }
    held_.fetch_sub(static_cast<int64_t>(block.bytes), std::memory_order_relaxed);
    if (detail::memory_recording()) {
      detail::record_memory_event(data, -static_cast<int64_t>(block.bytes), -static_cast<int64_t>(block.bytes),
                                  c10::Device(c10::kCPU));
    }
    // `block.original` goes out of scope here and frees through the wrapped allocator.
  }

  // The refusal armed by refuse_next_allocation for this thread, before anything is allocated: the op that asked
  // fails as on any allocation error, and nothing leaks. Not a c10::OutOfMemoryError: helpers that catch
  // out-of-memory errors and retry must not retry this one.
  static void refuse_if_asked() {
    if (std::optional<std::string> message = AllocationRefusal::instance().take(std::this_thread::get_id())) {
      TORCH_CHECK(false, *message);
    }
  }

  static std::vector<BaselineBlock> live_blocks() {
    std::vector<std::pair<uint64_t, BaselineBlock>> ordered;
    for (Shard& sh : shards()) {
      std::lock_guard<std::mutex> g(sh.mu);
      for (const auto& [ptr, b] : sh.blocks) {
        ordered.emplace_back(b.order, BaselineBlock{reinterpret_cast<uint64_t>(ptr), static_cast<int64_t>(b.bytes),
                                                    static_cast<int64_t>(b.bytes), "cpu"});
      }
    }
    return detail::oldest_first(std::move(ordered));
  }

 private:
  static std::array<Shard, kShards>& shards() {
    static auto* s = new std::array<Shard, kShards>();  // outlives every tensor, even at exit
    return *s;
  }
  static Shard& shard(const void* p) { return shards()[(reinterpret_cast<uintptr_t>(p) >> 6) % kShards]; }

  c10::Allocator* wrapped_;
  static inline std::atomic<uint64_t> next_order_{0};

 public:
  // Bytes held through the wrapper now, and the most held since the last reset (like max_memory_allocated).
  static inline std::atomic<int64_t> held_{0};
  static inline std::atomic<int64_t> peak_{0};
};

std::mutex g_install_mu;
CpuAllocatorHook* g_hook = nullptr;

}  // namespace

bool install_cpu_allocator_hook(std::string* why) {
  return detail::install_allocator_hook<CpuAllocatorHook>(
      g_install_mu, g_hook, [] { return c10::GetCPUAllocator(); },
      [](c10::Allocator* a, uint8_t priority) { c10::SetCPUAllocator(a, priority); },
      "another CPU allocator was registered with a higher priority; gpucast records no CPU memory events", why);
}

bool cpu_allocator_hook_installed() {
  std::lock_guard<std::mutex> g(g_install_mu);
  return g_hook != nullptr && c10::GetCPUAllocator() == g_hook;
}

namespace detail {
std::vector<BaselineBlock> cpu_live_blocks() { return CpuAllocatorHook::live_blocks(); }
}  // namespace detail

void refuse_next_allocation(const std::string& message) {
  AllocationRefusal::instance().arm(std::this_thread::get_id(), message);
}

std::pair<int64_t, int64_t> cpu_memory_stats(bool reset_peak) {
  const int64_t held = CpuAllocatorHook::held_.load();
  const int64_t peak = CpuAllocatorHook::peak_.load();
  if (reset_peak) CpuAllocatorHook::peak_.store(held);
  return {held, peak};
}

}  // namespace gpucast
