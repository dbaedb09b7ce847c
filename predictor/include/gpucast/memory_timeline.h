// gpucast/memory_timeline.h: bytes held over a recorded iteration, recomputed from the trace alone.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "gpucast/trace.h"

namespace gpucast {

struct DeviceMemory {
  std::string device;
  int64_t baseline_bytes = 0;      // held at the trace's start (as far as the allocator can tell)
  bool baseline_known = false;
  int64_t peak_bytes = 0;          // window peak: most bytes held at once, counted from the start
  int64_t absolute_peak_bytes = 0; // baseline + window peak
  int64_t peak_event = -1;         // index in Trace::events where the peak is first reached
  int64_t peak_op = -1;            // op running then
  int64_t end_bytes = 0;           // window total when the trace stopped
  int64_t events = 0;
  // Absolute bytes held at the peak by category (baseline blocks included).
  std::array<int64_t, kNumCategories> at_peak{};
  // Live bytes by category when the trace stopped.
  std::array<int64_t, kNumCategories> at_end{};
};

// One entry per device seen in the trace's events or baseline, in device-name order.
std::vector<DeviceMemory> analyze_memory(const Trace& trace);
// Window peak of one device in allocator bytes; 0 for a device with no events.
int64_t window_peak_bytes(const Trace& trace, const std::string& device);
// Bytes of the blocks held on `device` by category (category names as the trace writes them): at the end of the
// trace, or (at_peak) at the event where the window's held bytes first reach their peak (before any event when
// nothing is held).
std::map<std::string, int64_t> bytes_by_category(const Trace& trace, const std::string& device, bool at_peak);

struct LayerStat {
  std::string module;
  int64_t bytes_at_peak = 0;  // bytes allocated by the layer's ops and held at the device's peak
  int64_t time_ns = 0;        // time of its outermost ops, forward plus linked backward (host clocks)
  int64_t ops = 0;
  int64_t device_ns = -1;     // device time of those ops that have one (CUPTI, CUDA events); -1: none has
};
// Per module path, for one device's peak; ops outside modules under "<optimizer step>" (the optimizer phase:
// its step and zero_grad) or "<no module>" (the rest: the loss, the autograd engine's own work).
std::vector<LayerStat> layer_stats(const Trace& trace, const std::string& device);

}  // namespace gpucast
