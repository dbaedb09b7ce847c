#include "gpucast/device_timer.h"

#include <fmt/format.h>

namespace gpucast {

TimerChoice choose_device_timer(bool cuda_present, bool other_holder, std::unique_ptr<DeviceTimer> cupti,
                                std::unique_ptr<DeviceTimer> events) {
  TimerChoice c;
  c.source = "cpu_clock";
  if (!cuda_present) return c;
  std::string why;
  if (other_holder) {
    why = "CUPTI is held by another client (torch.profiler)";
  } else if (!cupti) {
    why = "CUPTI is not available (libcupti not found)";
  } else {
    const TimerStart s = cupti->start();
    if (s.status == TimerStart::Status::Ok) {
      c.timer = std::move(cupti);
      c.source = "cupti";
      return c;
    }
    why = s.status == TimerStart::Status::Busy
              ? fmt::format("CUPTI is held by another client ({})", s.detail)
              : fmt::format("CUPTI could not start ({})", s.detail);
  }
  if (events) {
    const TimerStart s = events->start();
    if (s.status == TimerStart::Status::Ok) {
      c.timer = std::move(events);
      c.source = "cuda_events";
      c.notes.push_back(why + ": device time measured with CUDA events");
      return c;
    }
    why += fmt::format("; CUDA events could not start either ({})", s.detail);
  }
  c.notes.push_back(why + ": no device time, CPU clocks only");
  return c;
}

std::unordered_map<uint64_t, int64_t> device_time_by_op(const std::vector<DeviceSpan>& spans) {
  std::unordered_map<uint64_t, int64_t> out;
  for (const DeviceSpan& s : spans) out[s.op_key] += std::max<int64_t>(0, s.end_ns - s.start_ns);
  return out;
}

}  // namespace gpucast
