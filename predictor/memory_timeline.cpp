#include "gpucast/memory_timeline.h"

#include "gpucast/checked.h"

#include <map>
#include <set>

namespace gpucast {
namespace {

// Is the allocation held just after event `at` (inclusive)?
bool held_at(const Allocation& a, int64_t at) {
  const bool allocated = a.alloc_event < 0 || a.alloc_event <= at;
  const bool freed = a.free_event >= 0 && a.free_event <= at;
  return allocated && !freed;
}

}  // namespace

std::vector<DeviceMemory> analyze_memory(const Trace& trace) {
  std::map<std::string, DeviceMemory> by_device;
  for (const auto& [dev, b] : trace.baseline) {
    DeviceMemory& d = by_device[dev];
    d.device = dev;
    d.baseline_bytes = b.bytes;
    d.baseline_known = b.known;
  }
  for (size_t i = 0; i < trace.events.size(); ++i) {
    const MemEvent& e = trace.events[i];
    DeviceMemory& d = by_device[e.device];
    d.device = e.device;
    ++d.events;
    // Blocks are bounded (kMaxTraceBlockBytes) but a file may hold any number of them: a sum past int64_t is a
    // bad trace, not a number.
    d.end_bytes = checked_add(d.end_bytes, e.block_bytes, "trace: bytes held");
    if (d.end_bytes > d.peak_bytes) {
      d.peak_bytes = d.end_bytes;
      d.peak_event = static_cast<int64_t>(i);
      d.peak_op = e.op;
    }
  }
  std::vector<DeviceMemory> out;
  for (auto& [dev, d] : by_device) {
    d.absolute_peak_bytes = d.baseline_bytes + d.peak_bytes;
    const int64_t last = static_cast<int64_t>(trace.events.size()) - 1;
    for (const Allocation& a : trace.allocations) {
      if (a.device != dev) continue;
      const auto c = static_cast<size_t>(a.category);
      // Without any event the peak is the start: only baseline blocks count.
      if (d.peak_event < 0 ? a.baseline : held_at(a, d.peak_event)) d.at_peak[c] += a.block_bytes;
      if (held_at(a, last)) d.at_end[c] += a.block_bytes;
    }
    out.push_back(std::move(d));
  }
  return out;
}

namespace {

// The most bytes held at once on `device`, counted from the trace's start, and the event where they were first
// reached (-1: nothing was ever held).
struct WindowPeak {
  int64_t bytes = 0;
  int64_t event = -1;
};
WindowPeak window_peak(const Trace& trace, const std::string& device) {
  WindowPeak p;
  int64_t held = 0;
  for (size_t i = 0; i < trace.events.size(); ++i) {
    if (trace.events[i].device != device) continue;
    held = checked_add(held, trace.events[i].block_bytes, "trace: bytes held");
    if (held > p.bytes) p = {held, static_cast<int64_t>(i)};
  }
  return p;
}

}  // namespace

int64_t window_peak_bytes(const Trace& trace, const std::string& device) { return window_peak(trace, device).bytes; }

std::vector<LayerStat> layer_stats(const Trace& trace, const std::string& device) {
  std::map<std::string, LayerStat> by_module;
  auto key = [](const std::string& m, Phase phase) {
    return !m.empty() ? m : phase == Phase::Optimizer ? std::string("<optimizer step>") : std::string("<no module>");
  };
  for (const OpRecord& op : trace.ops) {
    // Outermost work: no enclosing op, or the enclosing op is a scope/engine wrapper, not an op.
    bool outermost = op.parent < 0;
    if (!outermost) {
      const OpRecord& p = trace.ops[op.parent];
      outermost = p.scope == Scope::UserScope ||
                  (p.scope == Scope::Function && p.name.rfind("autograd::engine::", 0) == 0);
    }
    if (op.scope == Scope::UserScope || op.name.rfind("autograd::engine::", 0) == 0) continue;
    // The engine's own work for a node (a bias's gradient summed after it) is the node's layer's.
    const int64_t node = op.module.empty() ? engine_work_node(trace, op) : -1;
    const std::string module = key(node >= 0 ? trace.ops[static_cast<size_t>(node)].module : op.module, op.phase);
    LayerStat& s = by_module[module];
    s.module = module;
    ++s.ops;
    if (outermost) {
      s.time_ns += std::max<int64_t>(op.end_ns - op.start_ns, 0);
      if (op.device_ns >= 0) s.device_ns = std::max<int64_t>(s.device_ns, 0) + op.device_ns;
    }
  }
  for (const DeviceMemory& d : analyze_memory(trace)) {
    if (d.device != device || d.peak_event < 0) continue;
    for (const Allocation& a : trace.allocations) {
      if (a.device != device || a.alloc_op < 0 || !held_at(a, d.peak_event)) continue;
      const OpRecord& op = trace.ops[a.alloc_op];
      const std::string module = key(op.module, op.phase);
      LayerStat& s = by_module[module];
      s.module = module;
      s.bytes_at_peak += a.block_bytes;
    }
  }
  std::vector<LayerStat> out;
  for (auto& [m, s] : by_module) out.push_back(std::move(s));
  return out;
}

std::map<std::string, int64_t> bytes_by_category(const Trace& trace, const std::string& device, bool at_peak) {
  const int64_t at = at_peak ? window_peak(trace, device).event : static_cast<int64_t>(trace.events.size()) - 1;
  std::map<std::string, int64_t> out;
  for (const Allocation& a : trace.allocations) {
    if (a.device != device) continue;
    const bool allocated = a.alloc_event < 0 || a.alloc_event <= at;
    const bool freed = a.free_event >= 0 && a.free_event <= at;
    if (allocated && !freed) {
      int64_t& sum = out[std::string(to_string(a.category))];
      sum = checked_add(sum, a.block_bytes, "trace: bytes by category");
    }
  }
  return out;
}

}  // namespace gpucast
