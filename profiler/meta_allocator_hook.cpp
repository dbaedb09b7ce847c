// The meta allocator wrapper: a meta tensor holds no memory (c10's meta allocator hands out nullptr for every
// request: torch 2.14.1 aten/src/ATen/EmptyTensor.cpp, MetaAllocator, REGISTER_ALLOCATOR(kMeta, ...), which
// empty_meta and empty_strided_meta read through GetAllocator(kMeta)), but the bytes it stands for are what the same
// tensor takes on the CPU or a GPU. This wrapper gives each meta storage a token of its own: the DataPtr's context
// (its data stays nullptr, as c10's gives it), freed by this file's deleter when the storage dies. The token's
// address is the storage's identity in a trace, as a CPU block's data pointer is (tracer.cpp reads it for meta
// tensors), and each allocation and free is a memory event on device "meta" while a trace runs, so that probes on
// the meta device are traced as CPU probes are.
//
// Invariants: every token handed out is in the table until its deleter runs; the deleter runs once per token.
#include <array>
#include <atomic>
#include <mutex>
#include <string>

#include <c10/core/Allocator.h>
#include <c10/util/flat_hash_map.h>

#include "gpucast/tracer.h"
#include "memory_sink.h"

namespace gpucast {
namespace {

// 16: as the CPU wrapper's shards (lock contention against memory), not measured.
constexpr size_t kMetaShards = 16;

struct Token {
  size_t bytes;
  uint64_t order;  // allocation order, so that baselines list blocks oldest first
};

struct MetaShard {
  std::mutex mu;
  ska::flat_hash_map<Token*, char> live;  // the tokens handed out and not yet freed
};

class MetaAllocatorHook final : public c10::Allocator {
 public:
  explicit MetaAllocatorHook(c10::Allocator* wrapped) : wrapped_(wrapped) {}

  c10::DataPtr allocate(size_t n) override {
    if (n == 0) return wrapped_->allocate(0);  // holds nothing: no token, no event
    auto* token = new Token{n, next_order_.fetch_add(1, std::memory_order_relaxed)};
    {
      MetaShard& sh = shard(token);
      std::lock_guard<std::mutex> g(sh.mu);
      sh.live.emplace(token, 0);
    }
    if (detail::memory_recording()) {
      detail::record_memory_event(token, static_cast<int64_t>(n), static_cast<int64_t>(n), c10::Device(c10::kMeta));
    }
    return {nullptr, token, &release, c10::Device(c10::kMeta)};
  }

  // No raw allocations of bytes (c10's meta allocator allows them, handing out nullptr for both data and context):
  // a raw block's context must be its data, and a token is not. The wrapped deleter serves zero-byte ones.
  c10::DeleterFnPtr raw_deleter() const override { return wrapped_->raw_deleter(); }

  // A token's DataPtr is simple (one storage, no view into another's memory), though its context is not its data:
  // copy-on-write clones of meta tensors (torch._lazy_clone) wrap it as they wrap c10's own meta DataPtr.
  bool is_simple_data_ptr(const c10::DataPtr& data_ptr) const override {
    return data_ptr.get_deleter() == &release || data_ptr.get() == data_ptr.get_context();
  }

  void copy_data(void* /*dest*/, const void* /*src*/, std::size_t /*count*/) const override {}

  static void release(void* ctx) {
    auto* token = static_cast<Token*>(ctx);
    {
      MetaShard& sh = shard(token);
      std::lock_guard<std::mutex> g(sh.mu);
      sh.live.erase(token);
    }
    if (detail::memory_recording()) {
      detail::record_memory_event(token, -static_cast<int64_t>(token->bytes), -static_cast<int64_t>(token->bytes),
                                  c10::Device(c10::kMeta));
    }
    delete token;
  }

  static std::vector<BaselineBlock> live_blocks() {
    std::vector<std::pair<uint64_t, BaselineBlock>> ordered;
    for (MetaShard& sh : shards()) {
      std::lock_guard<std::mutex> g(sh.mu);
      for (const auto& [token, unused] : sh.live) {
        ordered.emplace_back(token->order, BaselineBlock{reinterpret_cast<uint64_t>(token),
                                                         static_cast<int64_t>(token->bytes),
                                                         static_cast<int64_t>(token->bytes), "meta"});
      }
    }
    return detail::oldest_first(std::move(ordered));
  }

 private:
  static std::array<MetaShard, kMetaShards>& shards() {
    static auto* s = new std::array<MetaShard, kMetaShards>();  // outlives every tensor, even at exit
    return *s;
  }
  static MetaShard& shard(const void* p) { return shards()[(reinterpret_cast<uintptr_t>(p) >> 4) % kMetaShards]; }

  c10::Allocator* wrapped_;
  static inline std::atomic<uint64_t> next_order_{0};
};

std::mutex g_meta_install_mu;
MetaAllocatorHook* g_meta_hook = nullptr;

}  // namespace

bool install_meta_allocator_hook(std::string* why) {
  return detail::install_allocator_hook<MetaAllocatorHook>(
      g_meta_install_mu, g_meta_hook, [] { return c10::GetAllocator(c10::kMeta); },
      [](c10::Allocator* a, uint8_t priority) { c10::SetAllocator(c10::kMeta, a, priority); },
      "another meta allocator was registered with a higher priority; gpucast records no meta memory events", why);
}

bool meta_allocator_hook_installed() {
  std::lock_guard<std::mutex> g(g_meta_install_mu);
  return g_meta_hook != nullptr && c10::GetAllocator(c10::kMeta) == g_meta_hook;
}

namespace detail {
std::vector<BaselineBlock> meta_live_blocks() { return MetaAllocatorHook::live_blocks(); }
}  // namespace detail

}  // namespace gpucast
