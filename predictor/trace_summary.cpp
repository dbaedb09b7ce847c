#include "gpucast/trace_summary.h"

#include <algorithm>
#include <array>
#include <cstdlib>

#include <fmt/format.h>

#include "gpucast/memory_timeline.h"

namespace gpucast {

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(std::llabs(bytes));
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  const char* sign = bytes < 0 ? "-" : "";
  if (u == 0) return fmt::format("{}{} B", sign, static_cast<int64_t>(v));
  return fmt::format("{}{:.2f} {}", sign, v, units[u]);
}

std::string summarize_trace(const Trace& trace, int top_layers) {
  std::string out;
  auto line = [&out](const std::string& s) { out += s + "\n"; };
  std::array<int64_t, 3> by_phase{};
  int64_t aten = 0;
  for (const OpRecord& op : trace.ops) {
    ++by_phase[static_cast<size_t>(op.phase)];
    if (op.scope == Scope::Function && op.name.rfind("aten::", 0) == 0) ++aten;
  }
  line(fmt::format("gpucast trace: {} ops ({} aten) - forward {}, backward {}, optimizer {} - on {} thread(s), {:.1f} ms",
                   trace.ops.size(), aten, by_phase[0], by_phase[1], by_phase[2], trace.counters.threads,
                   static_cast<double>(trace.end_ns - trace.start_ns) / 1e6));
  line(fmt::format("  backward nodes: {} linked to their forward op, {} unlinked (no sequence number or no match)",
                   trace.counters.linked_backward, trace.counters.unlinked_backward));
  line(fmt::format("  device timing: {}{}", trace.timing_source == "cpu_clock" ? "none (CPU clocks only)" : trace.timing_source,
                   trace.timed_layers.empty() ? ""
                                              : fmt::format("; sparse: {} chosen layer(s) timed, the rest predicted",
                                                            trace.timed_layers.size())));
  line(fmt::format("  memory events: {}; dropped: {} ops, {} events; unmatched frees: {}; callback errors: {}",
                   trace.events.size(), trace.counters.dropped_ops, trace.counters.dropped_events,
                   trace.counters.unmatched_frees, trace.counters.callback_errors));
  for (const DeviceMemory& d : analyze_memory(trace)) {
    std::string where = "start";
    if (d.peak_op >= 0) {
      const OpRecord& op = trace.ops[d.peak_op];
      where = fmt::format("op #{} {} ({}{}{})", op.id, op.name, to_string(op.phase), op.module.empty() ? "" : ", ",
                          op.module);
    }
    line(fmt::format("{} memory: baseline {}{}, window peak {} (absolute {}) at {}", d.device,
                     format_bytes(d.baseline_bytes), d.baseline_known ? "" : " (unknown)", format_bytes(d.peak_bytes),
                     format_bytes(d.absolute_peak_bytes), where));
    line("  held at the peak by category (absolute: baseline blocks included):");
    for (int c = 0; c < kNumCategories; ++c) {
      if (d.at_peak[c] == 0) continue;
      line(fmt::format("    {:<16} {:>12}", to_string(static_cast<Category>(c)), format_bytes(d.at_peak[c])));
    }
    std::vector<LayerStat> layers = layer_stats(trace, d.device);
    std::sort(layers.begin(), layers.end(),
              [](const LayerStat& a, const LayerStat& b) { return a.bytes_at_peak > b.bytes_at_peak; });
    line(fmt::format("  top layers by memory held at the peak ({}):", d.device));
    for (int i = 0; i < top_layers && i < static_cast<int>(layers.size()) && layers[i].bytes_at_peak > 0; ++i) {
      line(fmt::format("    {:<48} {:>12}", layers[i].module, format_bytes(layers[i].bytes_at_peak)));
    }
  }
  std::vector<LayerStat> layers = layer_stats(trace, "");
  // With a device timer, the layers' device time (their kernels, copies and fills), where it was recorded.
  const auto timed = std::count_if(layers.begin(), layers.end(), [](const LayerStat& l) { return l.device_ns >= 0; });
  const bool device = timed > 0;
  auto time_of = [device](const LayerStat& l) { return device ? l.device_ns : l.time_ns; };
  std::sort(layers.begin(), layers.end(), [&](const LayerStat& a, const LayerStat& b) { return time_of(a) > time_of(b); });
  line(device ? fmt::format("top layers by device time (forward + linked backward; {} of {} with a device time):",
                            timed, layers.size())
              : std::string("top layers by time (forward + linked backward):"));
  for (int i = 0; i < top_layers && i < static_cast<int>(layers.size()) && time_of(layers[i]) >= 0; ++i) {
    line(fmt::format("    {:<48} {:>9.3f} ms  {:>6} ops", layers[i].module,
                     static_cast<double>(time_of(layers[i])) / 1e6, layers[i].ops));
  }
  for (const Note& n : trace.notes) line("note: " + n.text);
  return out;
}

}  // namespace gpucast
