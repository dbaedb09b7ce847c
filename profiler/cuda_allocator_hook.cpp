// CUDA memory events from the caching allocator's trace tracker (compiled when torch has CUDA).
// The tracker cannot be detached; outside a trace, with no refusal pending, it returns after two atomic loads.
#include <mutex>
#include <thread>

#include <ATen/Context.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <c10/cuda/CUDAFunctions.h>

#include "gpucast/allocation_refusal.h"
#include "gpucast/cuda_block.h"
#include "gpucast/tracer.h"
#include "memory_sink.h"

namespace gpucast {
namespace {
std::mutex g_mu;
bool g_attached = false;
}  // namespace

bool install_cuda_allocator_hook(std::string* why) {
  std::lock_guard<std::mutex> g(g_mu);
  if (g_attached) return true;
  if (c10::cuda::device_count() == 0) return false;  // CUDA build without a GPU: nothing to observe
  at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
  namespace cca = c10::cuda::CUDACachingAllocator;
  if (!cca::get()->initialized()) {
    if (why) *why = "CUDA caching allocator not initialized (another backend?): CUDA memory events not recorded";
    return false;
  }
  // A refusal (allocation_refusal.h) is thrown from here, for an "alloc" only: the allocator calls its trackers
  // under its lock, released as the exception leaves (std::unique_lock), after the block is taken; a free is never
  // refused (it runs in destructors).
  cca::attachAllocatorTraceTracker([](const cca::TraceEntry& te) {
    const char* action = te.action_ == cca::TraceEntry::ALLOC            ? "alloc"
                         : te.action_ == cca::TraceEntry::FREE_REQUESTED ? "free_requested"
                                                                          : nullptr;
    if (action == nullptr) return;
    const bool recording = detail::memory_recording();
    if (!recording && !AllocationRefusal::instance().pending()) return;
    const CudaEntryOutcome out = cuda_trace_entry_outcome(action, static_cast<int64_t>(te.size_), recording,
                                                          AllocationRefusal::instance(), std::this_thread::get_id());
    if (out.delta) {
      detail::record_memory_event(reinterpret_cast<const void*>(te.addr_), out.delta->bytes,
                                  out.delta->block_bytes, c10::Device(c10::kCUDA, te.device_));
    }
    TORCH_CHECK(!out.refusal, out.refusal.value_or(""));
  });
  g_attached = true;
  return true;
}

bool cuda_device_present() { return c10::cuda::device_count() > 0; }

namespace detail {
void cuda_baseline(std::map<std::string, DeviceBaseline>& out, std::vector<BaselineBlock>& blocks,
                   std::vector<Note>& notes) {
  namespace cca = c10::cuda::CUDACachingAllocator;
  const int n = c10::cuda::device_count();
  for (int d = 0; d < n; ++d) {
    const auto stats = cca::getDeviceStats(static_cast<c10::DeviceIndex>(d));
    out["cuda:" + std::to_string(d)] = DeviceBaseline{stats.allocated_bytes[0].current, true};
  }
  // The blocks held at the start, one by one: parameters and buffers can then be tagged by address, and a
  // forecast places them in segments as the allocator did instead of as one block.
  const cca::SnapshotInfo snap = cca::snapshot(/*mempool_id=*/{0, 0}, /*include_traces=*/false);
  for (const auto& seg : snap.segments) {
    const std::string device = "cuda:" + std::to_string(seg.device);
    uint64_t addr = seg.address;
    for (const auto& b : seg.blocks) {
      if (b.allocated) {
        blocks.push_back(BaselineBlock{addr, static_cast<int64_t>(b.requested_size), static_cast<int64_t>(b.size), device});
      }
      addr += b.size;
    }
  }
  notes.push_back(Note{"cuda-block-bytes-derived",
                       "CUDA block bytes are derived from requested sizes with the allocator's 512-byte rounding"});
}
}  // namespace detail

}  // namespace gpucast
