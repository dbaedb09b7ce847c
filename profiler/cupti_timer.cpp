// CUPTI activity timing, with libcupti found at run time (dlopen): the library loads on machines without
// CUDA, and never links libcupti at build time. Kernel, memcpy and memset records are attributed to the op
// that launched them through external correlation ids pushed and popped around each op.
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include <cuda_runtime_api.h>
#include <cupti.h>
#include <fmt/format.h>

#include "gpucast/device_timer.h"

// Kernel, memcpy and memset record layouts of the CUPTI this is compiled against.
// CUDA 13.0's CUPTI: cupti_version.h:126 (CUPTI_API_VERSION 130001); its kernel records are
// CUpti_ActivityKernel10 (cupti_activity.h:212).
#if CUPTI_API_VERSION >= 130000
using KernelRecord = CUpti_ActivityKernel10;
#else
using KernelRecord = CUpti_ActivityKernel9;
#endif
using MemcpyRecord = CUpti_ActivityMemcpy6;
using MemsetRecord = CUpti_ActivityMemset4;

namespace gpucast {
namespace {

struct CuptiApi {
  void* lib = nullptr;
  decltype(&cuptiSubscribe) subscribe = nullptr;
  decltype(&cuptiUnsubscribe) unsubscribe = nullptr;
  decltype(&cuptiActivityEnable) enable = nullptr;
  decltype(&cuptiActivityDisable) disable = nullptr;
  decltype(&cuptiActivityRegisterCallbacks) register_callbacks = nullptr;
  decltype(&cuptiActivityFlushAll) flush_all = nullptr;
  decltype(&cuptiActivityGetNextRecord) next_record = nullptr;
  decltype(&cuptiActivityPushExternalCorrelationId) push = nullptr;
  decltype(&cuptiActivityPopExternalCorrelationId) pop = nullptr;
  decltype(&cuptiGetResultString) result_string = nullptr;
  std::string path;             // the file it came from
  bool already_loaded = false;  // torch had loaded it

  static const CuptiApi* load() {
    static const CuptiApi* api = [] () -> const CuptiApi* {
      auto* a = new CuptiApi();
      // The copy torch already loaded (libtorch_cpu needs libcupti.so.N) first: a second copy from another
      // directory (the CUDA toolkit's) would be a second CUPTI in the process, which records nothing.
      constexpr const char* kNames[] = {"libcupti.so.13", "libcupti.so.12", "libcupti.so"};
      for (int flags : {RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD, RTLD_NOW | RTLD_LOCAL}) {
        for (const char* name : kNames) {
          a->lib = dlopen(name, flags);
          if (a->lib != nullptr) {
            a->already_loaded = (flags & RTLD_NOLOAD) != 0;
            break;
          }
        }
        if (a->lib != nullptr) break;
      }
      if (a->lib == nullptr) return nullptr;
      auto sym = [&](auto& fn, const char* name) { fn = reinterpret_cast<std::decay_t<decltype(fn)>>(dlsym(a->lib, name)); };
      sym(a->subscribe, "cuptiSubscribe");
      sym(a->unsubscribe, "cuptiUnsubscribe");
      sym(a->enable, "cuptiActivityEnable");
      sym(a->disable, "cuptiActivityDisable");
      sym(a->register_callbacks, "cuptiActivityRegisterCallbacks");
      sym(a->flush_all, "cuptiActivityFlushAll");
      sym(a->next_record, "cuptiActivityGetNextRecord");
      sym(a->push, "cuptiActivityPushExternalCorrelationId");
      sym(a->pop, "cuptiActivityPopExternalCorrelationId");
      sym(a->result_string, "cuptiGetResultString");
      Dl_info info{};
      if (a->subscribe != nullptr && dladdr(reinterpret_cast<void*>(a->subscribe), &info) != 0 &&
          info.dli_fname != nullptr) {
        a->path = info.dli_fname;
      }
      const bool complete = a->subscribe && a->unsubscribe && a->enable && a->disable && a->register_callbacks &&
                            a->flush_all && a->next_record && a->push && a->pop && a->result_string;
      return complete ? a : nullptr;
    }();
    return api;
  }

  std::string error(CUptiResult r) const {
    const char* s = nullptr;
    if (result_string == nullptr || result_string(r, &s) != CUPTI_SUCCESS || s == nullptr) return std::to_string(r);
    return s;
  }
};

// 8 MiB per record buffer: a chosen size, not measured.
constexpr size_t kBufferBytes = 8 * 1024 * 1024;
// At most this much held in record buffers at once (about 900,000 kernel launches with their API and external
// correlation records): a trace window left open over many iterations must not grow the process without bound.
constexpr size_t kMaxBufferBytes = 32 * kBufferBytes;
// External correlation records come with the API records of the launches (runtime and driver): without those
// two kinds enabled, kernels were recorded in the first GPU runs but no external correlation was. The API
// records themselves are read past.
constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                         CUPTI_ACTIVITY_KIND_MEMSET,           CUPTI_ACTIVITY_KIND_RUNTIME,
                                         CUPTI_ACTIVITY_KIND_DRIVER,           CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION};

// Completed buffers, filled by CUPTI's thread.
std::mutex g_buffers_mu;
std::vector<std::pair<uint8_t*, size_t>> g_buffers;
BufferBudget g_budget(kMaxBufferBytes);

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = nullptr;  // no buffer: CUPTI drops the records
  *size = 0;
  *max_records = 0;
  if (!g_budget.take(kBufferBytes)) return;
  // 8: ACTIVITY_RECORD_ALIGNMENT (CUPTI 13.0 cupti_common.h:77).
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  if (*buffer == nullptr) {
    g_budget.give(kBufferBytes);
    return;
  }
  *size = kBufferBytes;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  if (buffer == nullptr) return;
  std::lock_guard<std::mutex> g(g_buffers_mu);
  g_buffers.emplace_back(buffer, valid);
}

void CUPTIAPI no_callback(void*, CUpti_CallbackDomain, CUpti_CallbackId, const void*) {}

class CuptiTimer final : public DeviceTimer {
 public:
  explicit CuptiTimer(const CuptiApi* api) : api_(api) {}
  std::string name() const override { return "cupti"; }

  TimerStart start() override {
    // A subscriber is the sign of another CUPTI client (Nsight, a profiler): CUPTI allows only one.
    CUptiResult r = api_->subscribe(&subscriber_, &no_callback, nullptr);
    if (r == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED) {
      return {TimerStart::Status::Busy, api_->error(r)};
    }
    if (r != CUPTI_SUCCESS) return {TimerStart::Status::Unavailable, "cuptiSubscribe: " + api_->error(r)};
    g_budget.clear_refused();
    r = api_->register_callbacks(&buffer_requested, &buffer_completed);
    for (CUpti_ActivityKind k : kKinds) {
      if (r == CUPTI_SUCCESS) r = api_->enable(k);
    }
    if (r != CUPTI_SUCCESS) {
      release();
      return {TimerStart::Status::Unavailable, "cuptiActivityEnable: " + api_->error(r)};
    }
    return {};
  }

  bool per_launch() const override { return true; }
  void op_begin(uint64_t key) noexcept override { api_->push(CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0, key); }
  void op_end(uint64_t) noexcept override {
    uint64_t last = 0;
    api_->pop(CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0, &last);
  }

  std::vector<DeviceSpan> stop() override {
    // A kernel's record is complete once it has run: wait for the work the window launched.
    const cudaError_t synced = cudaDeviceSynchronize();
    api_->flush_all(1 /* CUPTI_ACTIVITY_FLAG_FLUSH_FORCED */);
    release();
    std::vector<std::pair<uint8_t*, size_t>> buffers;
    {
      std::lock_guard<std::mutex> g(g_buffers_mu);
      buffers.swap(g_buffers);
    }
    std::unordered_map<uint32_t, uint64_t> external;  // CUPTI correlation id -> op key
    struct Pending { uint32_t correlation; int64_t start, end; };
    std::vector<Pending> pending;
    for (auto& [buf, valid] : buffers) {
      CUpti_Activity* rec = nullptr;
      while (api_->next_record(buf, valid, &rec) == CUPTI_SUCCESS) {
        switch (rec->kind) {
          case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
            ++counts_[0];
            auto* k = reinterpret_cast<const KernelRecord*>(rec);
            pending.push_back({k->correlationId, static_cast<int64_t>(k->start), static_cast<int64_t>(k->end)});
            break;
          }
          case CUPTI_ACTIVITY_KIND_MEMCPY: {
            ++counts_[1];
            auto* m = reinterpret_cast<const MemcpyRecord*>(rec);
            pending.push_back({m->correlationId, static_cast<int64_t>(m->start), static_cast<int64_t>(m->end)});
            break;
          }
          case CUPTI_ACTIVITY_KIND_MEMSET: {
            ++counts_[2];
            auto* m = reinterpret_cast<const MemsetRecord*>(rec);
            pending.push_back({m->correlationId, static_cast<int64_t>(m->start), static_cast<int64_t>(m->end)});
            break;
          }
          case CUPTI_ACTIVITY_KIND_RUNTIME:
          case CUPTI_ACTIVITY_KIND_DRIVER:
            ++api_records_;
            break;
          case CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION: {
            auto* e = reinterpret_cast<const CUpti_ActivityExternalCorrelation*>(rec);
            if (e->externalKind == CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0) external[e->correlationId] = e->externalId;
            break;
          }
          default:
            break;
        }
      }
      std::free(buf);
      g_budget.give(kBufferBytes);
    }
    std::vector<DeviceSpan> out;
    for (const Pending& p : pending) {
      auto it = external.find(p.correlation);
      if (it != external.end()) out.push_back(DeviceSpan{it->second, p.start, p.end});
    }
    attributed_ = out.size();
    report_ = fmt::format("CUPTI from {}{}: {} kernel, {} memcpy and {} memset records, {} API records, {} external "
                          "correlations, {} records attributed to ops{}",
                          api_->path.empty() ? "libcupti" : api_->path,
                          api_->already_loaded ? " (loaded by torch)" : "", counts_[0], counts_[1], counts_[2],
                          api_records_, external.size(), out.size(),
                          synced == cudaSuccess ? "" : fmt::format("; cudaDeviceSynchronize: {}",
                                                                   cudaGetErrorString(synced)));
    if (const size_t refused = g_budget.refused(); refused > 0) {
      report_ += fmt::format("; {} record buffer(s) refused at the {} MiB bound: the window's later device work "
                             "was not recorded (a shorter trace window times it all)",
                             refused, kMaxBufferBytes >> 20);
    }
    return out;
  }

  std::string report() const override { return report_; }
  bool attributed_none() const override { return counts_[0] + counts_[1] + counts_[2] > 0 && attributed_ == 0; }

 private:
  void release() {
    for (CUpti_ActivityKind k : kKinds) api_->disable(k);
    if (subscriber_ != nullptr) api_->unsubscribe(subscriber_);
    subscriber_ = nullptr;
  }

  const CuptiApi* api_;
  CUpti_SubscriberHandle subscriber_ = nullptr;
  size_t counts_[3] = {0, 0, 0};  // kernel, memcpy, memset records of the window
  size_t attributed_ = 0;         // of those, attributed to an op
  size_t api_records_ = 0;        // runtime and driver API records (they carry the external correlations)
  std::string report_;
};

}  // namespace

std::unique_ptr<DeviceTimer> make_cupti_timer() {
  const CuptiApi* api = CuptiApi::load();
  if (api == nullptr) return nullptr;
  return std::make_unique<CuptiTimer>(api);
}

}  // namespace gpucast
