// gpucast/trace_exporters.h: a recorded trace in the formats other tools read.
#pragma once

#include <string>

#include "gpucast/trace.h"

namespace gpucast {

// PyTorch's memory-snapshot format (torch.cuda.memory._snapshot()), as JSON: "device_traces" (one list per
// device: CUDA devices by index, then the CPU) with alloc / free_requested / free_completed entries (frames:
// module path and op), and "segments" describing the blocks held when the trace stopped. Blocks held at the
// start are listed as allocations at the head of each device's trace. Load it with pickle after json.loads to
// use torch.cuda._memory_viz (trace_plot, segment_plot, segsum).
std::string trace_to_memory_snapshot_json(const Trace& trace);

// Bytes held by category after each memory event of `device` (baseline included):
// {"device", "categories": [...], "time_ns": [...], "event": [...], "bytes": [[per category]...]}.
std::string memory_series_json(const Trace& trace, const std::string& device);

}  // namespace gpucast
