// gpucast/trace_summary.h: the readable summary of a recorded iteration.
#pragma once

#include <string>

#include "gpucast/trace.h"

namespace gpucast {

// Op counts by phase, backward links, memory per device (baseline, window and absolute peak, bytes by
// category at the peak), the top layers by memory and by time, and what was dropped or unavailable.
std::string summarize_trace(const Trace& trace, int top_layers = 5);

// "1.50 MiB", "812 B": binary units, three significant digits.
std::string format_bytes(int64_t bytes);

}  // namespace gpucast
