// gpucast/device_timer.h: device-side time of ops, behind a small interface.
//
// Only one client can hold CUPTI's activity API in a process. gpucast holds it only during its own timing
// window (the trace), detects another holder (torch.profiler, Nsight) and then times with CUDA events, and
// says which source it used in the trace. Without a CUDA device, ops carry CPU clock times only.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "gpucast/note.h"

namespace gpucast {

// Device activity attributed to the op (key) that launched it.
struct DeviceSpan {
  uint64_t op_key = 0;
  int64_t start_ns = 0;
  int64_t end_ns = 0;
};

struct TimerStart {
  enum class Status { Ok, Busy, Unavailable };
  Status status = Status::Ok;
  std::string detail;  // why not, for Busy and Unavailable
};

class DeviceTimer {
 public:
  virtual ~DeviceTimer() = default;
  virtual std::string name() const = 0;
  // Takes the timing resource for the trace window.
  virtual TimerStart start() = 0;
  // Called inside RecordFunction callbacks: no exception, no allocation through torch, no dispatch.
  virtual void op_begin(uint64_t op_key) noexcept = 0;
  virtual void op_end(uint64_t op_key) noexcept = 0;
  // Releases the resource; returns what was measured.
  virtual std::vector<DeviceSpan> stop() = 0;
  // True where a span is device work the op launched itself (CUPTI: a kernel counts for the innermost op open
  // at its launch), false where it spans the op's whole time, the ops inside it included (CUDA events, the
  // stand-in). An op's device time is the latter: per-launch times are summed up the op tree.
  virtual bool per_launch() const { return false; }
  // After stop: one line for the trace's notes on what the window recorded (empty: nothing to say).
  virtual std::string report() const { return {}; }
  // After stop: device work was recorded but none of it could be attributed to an op (CUPTI without external
  // correlation records). The tracer then sets this timer aside for the rest of the process.
  virtual bool attributed_none() const { return false; }
};

struct TimerChoice {
  std::unique_ptr<DeviceTimer> timer;  // null: CPU clocks only
  std::string source;                  // "cupti", "cuda_events" or "cpu_clock"
  std::vector<Note> notes;             // why a fallback was taken
};

// cupti / events: the available timers (null when not built or not loadable). other_holder: another CUPTI
// client is known to be active (torch.profiler recording CUDA activity). cupti_set_aside: why CUPTI is not to be
// used in this process (an earlier trace's CUPTI attributed nothing to ops); empty: it may be.
TimerChoice choose_device_timer(bool cuda_present, bool other_holder, std::unique_ptr<DeviceTimer> cupti,
                                std::unique_ptr<DeviceTimer> events, const std::string& cupti_set_aside = "");

// A bound on the memory a device-timing backend holds for its records while a trace runs (CUPTI asks for record
// buffers as it fills them, for every kernel and API call of the window, also past the tracer's op bound): take()
// says whether one more buffer fits, and counts the ones refused (CUPTI then drops those records). Thread-safe
// and lock-free: CUPTI asks from its own threads and from the launching ones.
class BufferBudget {
 public:
  explicit BufferBudget(size_t limit_bytes) : limit_(limit_bytes) {}
  bool take(size_t bytes) noexcept;
  void give(size_t bytes) noexcept;
  size_t held() const noexcept { return held_.load(std::memory_order_relaxed); }
  size_t refused() const noexcept { return refused_.load(std::memory_order_relaxed); }
  size_t limit() const noexcept { return limit_; }
  void clear_refused() noexcept { refused_.store(0, std::memory_order_relaxed); }

 private:
  const size_t limit_;
  std::atomic<size_t> held_{0};
  std::atomic<size_t> refused_{0};
};

// Device nanoseconds per op key (sum of its spans).
std::unordered_map<uint64_t, int64_t> device_time_by_op(const std::vector<DeviceSpan>& spans);

// One thread's ops in start order: parent[i] < i the enclosing op (-1: none), own[i] its per-launch device time
// (-1: no timer around it). Returns each op's time with that of the ops inside it.
std::vector<int64_t> inclusive_device_times(const std::vector<int32_t>& parent, std::vector<int64_t> own);

// A stand-in with the device timers' interface that takes CPU clock spans (steady_clock) from op_begin to op_end:
// lets tests and rehearsals run the tracer's device-timing path (which ops get timers, how spans come back to
// their ops) on a machine without a GPU. Thread-safe; source name "cpu_spans".
std::unique_ptr<DeviceTimer> make_cpu_span_timer();

// Factories for the real timers; null where CUDA (or CUPTI) is not compiled in or cannot be loaded.
std::unique_ptr<DeviceTimer> make_cupti_timer();
std::unique_ptr<DeviceTimer> make_cuda_event_timer();

}  // namespace gpucast
