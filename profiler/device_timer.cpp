#include "gpucast/device_timer.h"

#include <chrono>
#include <mutex>
#include <unordered_map>

#include <fmt/format.h>

namespace gpucast {
namespace {

class CpuSpanTimer final : public DeviceTimer {
 public:
  std::string name() const override { return "cpu_spans"; }
  TimerStart start() override { return {}; }
  void op_begin(uint64_t key) noexcept override {
    try {
      const int64_t t = now();
      std::lock_guard<std::mutex> g(mu_);
      open_[key] = t;
    } catch (...) {  // out of memory: that op goes untimed
    }
  }
  void op_end(uint64_t key) noexcept override {
    try {
      const int64_t t = now();
      std::lock_guard<std::mutex> g(mu_);
      auto it = open_.find(key);
      if (it == open_.end()) return;
      spans_.push_back(DeviceSpan{key, it->second, t});
      open_.erase(it);
    } catch (...) {
    }
  }
  std::vector<DeviceSpan> stop() override {
    std::lock_guard<std::mutex> g(mu_);
    open_.clear();
    return std::move(spans_);
  }

 private:
  static int64_t now() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  std::mutex mu_;
  std::unordered_map<uint64_t, int64_t> open_;
  std::vector<DeviceSpan> spans_;
};

}  // namespace

std::unique_ptr<DeviceTimer> make_cpu_span_timer() { return std::make_unique<CpuSpanTimer>(); }

TimerChoice choose_device_timer(bool cuda_present, bool other_holder, std::unique_ptr<DeviceTimer> cupti,
                                std::unique_ptr<DeviceTimer> events, const std::string& cupti_set_aside) {
  TimerChoice c;
  c.source = "cpu_clock";
  if (!cuda_present) return c;
  // Why CUPTI is not used: a note's code (docs/design.md) and its text.
  std::string code, why;
  if (other_holder) {
    code = "cupti-busy";
    why = "CUPTI is held by another client (torch.profiler)";
  } else if (!cupti_set_aside.empty()) {
    code = "cupti-set-aside";
    why = cupti_set_aside;
  } else if (!cupti) {
    code = "cupti-unavailable";
    why = "CUPTI is not available (libcupti not found)";
  } else {
    const TimerStart s = cupti->start();
    if (s.status == TimerStart::Status::Ok) {
      c.timer = std::move(cupti);
      c.source = "cupti";
      return c;
    }
    code = s.status == TimerStart::Status::Busy ? "cupti-busy" : "cupti-start-failed";
    why = s.status == TimerStart::Status::Busy
              ? fmt::format("CUPTI is held by another client ({})", s.detail)
              : fmt::format("CUPTI could not start ({})", s.detail);
  }
  // The note's code says why; the choice's source says what timed instead (cuda_events, or cpu_clock).
  if (events) {
    const TimerStart s = events->start();
    if (s.status == TimerStart::Status::Ok) {
      c.timer = std::move(events);
      c.source = "cuda_events";
      c.notes.push_back(Note{code, why + ": device time measured with CUDA events"});
      return c;
    }
    why += fmt::format("; CUDA events could not start either ({})", s.detail);
  }
  c.notes.push_back(Note{code, why + ": no device time, CPU clocks only"});
  return c;
}

std::vector<int64_t> inclusive_device_times(const std::vector<int32_t>& parent, std::vector<int64_t> own) {
  for (size_t i = own.size(); i-- > 0;) {
    const int32_t p = i < parent.size() ? parent[i] : -1;
    if (p >= 0 && static_cast<size_t>(p) < i && own[i] > 0 && own[static_cast<size_t>(p)] >= 0) {
      own[static_cast<size_t>(p)] += own[i];
    }
  }
  return own;
}

bool BufferBudget::take(size_t bytes) noexcept {
  size_t now = held_.load(std::memory_order_relaxed);
  do {
    if (bytes > limit_ || now > limit_ - bytes) {
      refused_.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
  } while (!held_.compare_exchange_weak(now, now + bytes, std::memory_order_relaxed));
  return true;
}

void BufferBudget::give(size_t bytes) noexcept {
  size_t now = held_.load(std::memory_order_relaxed);
  while (!held_.compare_exchange_weak(now, now >= bytes ? now - bytes : 0, std::memory_order_relaxed)) {
  }
}

std::unordered_map<uint64_t, int64_t> device_time_by_op(const std::vector<DeviceSpan>& spans) {
  std::unordered_map<uint64_t, int64_t> out;
  for (const DeviceSpan& s : spans) out[s.op_key] += std::max<int64_t>(0, s.end_ns - s.start_ns);
  return out;
}

}  // namespace gpucast
