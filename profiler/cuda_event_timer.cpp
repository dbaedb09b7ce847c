// Device time from CUDA events recorded on the current stream around each op: the fallback when CUPTI is
// held by another client. Events come from a pool; elapsed times are read when the trace stops.
#include <cuda_runtime_api.h>

#include <mutex>
#include <unordered_map>
#include <vector>

#include <c10/cuda/CUDAStream.h>

#include "gpucast/device_timer.h"

namespace gpucast {
namespace {

class CudaEventTimer final : public DeviceTimer {
 public:
  std::string name() const override { return "cuda_events"; }
  TimerStart start() override {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return {TimerStart::Status::Unavailable, "no CUDA device"};
    return {};
  }

  void op_begin(uint64_t key) noexcept override {
    cudaEvent_t e = take();
    if (e == nullptr) return;
    cudaEventRecord(e, c10::cuda::getCurrentCUDAStream().stream());
    std::lock_guard<std::mutex> g(mu_);
    open_[key] = e;
  }

  void op_end(uint64_t key) noexcept override {
    cudaEvent_t begin = nullptr;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = open_.find(key);
      if (it == open_.end()) return;
      begin = it->second;
      open_.erase(it);
    }
    cudaEvent_t end = take();
    if (end == nullptr) return;
    cudaEventRecord(end, c10::cuda::getCurrentCUDAStream().stream());
    std::lock_guard<std::mutex> g(mu_);
    done_.push_back({key, begin, end});
  }

  std::vector<DeviceSpan> stop() override {
    std::vector<DeviceSpan> out;
    std::lock_guard<std::mutex> g(mu_);
    for (const Done& d : done_) {
      float ms = 0.f;
      if (cudaEventSynchronize(d.end) == cudaSuccess && cudaEventElapsedTime(&ms, d.begin, d.end) == cudaSuccess) {
        out.push_back(DeviceSpan{d.key, 0, static_cast<int64_t>(static_cast<double>(ms) * 1e6)});
      }
      pool_.push_back(d.begin);
      pool_.push_back(d.end);
    }
    done_.clear();
    for (auto& [key, e] : open_) pool_.push_back(e);
    open_.clear();
    return out;
  }

  ~CudaEventTimer() override {
    for (cudaEvent_t e : pool_) cudaEventDestroy(e);
  }

 private:
  struct Done { uint64_t key; cudaEvent_t begin, end; };

  cudaEvent_t take() noexcept {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (!pool_.empty()) {
        cudaEvent_t e = pool_.back();
        pool_.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    return cudaEventCreate(&e) == cudaSuccess ? e : nullptr;
  }

  std::mutex mu_;
  std::vector<cudaEvent_t> pool_;
  std::unordered_map<uint64_t, cudaEvent_t> open_;
  std::vector<Done> done_;
};

}  // namespace

std::unique_ptr<DeviceTimer> make_cuda_event_timer() { return std::make_unique<CudaEventTimer>(); }

}  // namespace gpucast
