// trace_holder.h (plugin, private): torch.classes.gpucast.Trace, a recorded or loaded trace held for Python and
// for the ops that take one (ops.cpp registers the class; ops_workspace.cpp reads traces through it).
#pragma once

#include <torch/custom_class.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpucast/error.h"
#include "gpucast/files.h"
#include "gpucast/memory_timeline.h"
#include "gpucast/step_time.h"
#include "gpucast/trace_exporters.h"
#include "gpucast/trace_json.h"
#include "gpucast/trace_summary.h"
#include "gpucast/tracer.h"
#include "translate.h"

namespace gpucast {

struct TraceHolder : torch::CustomClassHolder {
  // A trace from the tracer is assembled on first use; one loaded from a file already is.
  mutable RecordedTrace recorded;
  std::optional<Trace> loaded;
  explicit TraceHolder(RecordedTrace r) : recorded(std::move(r)) {}
  explicit TraceHolder(Trace t) : loaded(std::move(t)) {}
  const Trace& get() const { return loaded ? *loaded : recorded.trace(); }

  // Views of a trace: a trace loaded from a file passed its parser's checks; what is still wrong with it (a sum
  // that overflows) is the trace's fault (code "trace-file").
  std::string summary(int64_t top) const {
    return translate("trace-file", [&] { return summarize_trace(get(), static_cast<int>(top)); });
  }
  std::string to_json() const { return translate("trace-file", [&] { return trace_to_json(get()); }); }
  std::string ops_json(const std::vector<std::string>& names) const {
    return translate("trace-file", [&] { return ops_to_json(get(), names); });
  }
  void save(const std::string& path) const {
    translate("file-write", [&] {
      write_file_atomically(path, [&](std::ostream& out) { write_trace_json(get(), out); });
    });
  }
  void save_chrome(const std::string& path) const {
    translate("file-write", [&] { write_file_atomically(path, trace_to_chrome_json(get())); });
  }
  int64_t peak_bytes(const std::string& device) const {
    return translate("trace-file", [&] { return window_peak_bytes(get(), device); });
  }
  int64_t baseline_bytes(const std::string& device) const {
    const Trace& t = get();
    auto it = t.baseline.find(device);
    return it == t.baseline.end() ? 0 : it->second.bytes;
  }
  std::string memory_snapshot_json() const {
    return translate("trace-file", [&] { return trace_to_memory_snapshot_json(get()); });
  }
  std::string memory_series(const std::string& device) const {
    return translate("trace-file", [&] { return memory_series_json(get(), device); });
  }
  int64_t num_ops() const { return static_cast<int64_t>(get().ops.size()); }
  std::string iteration_timing(int64_t batch) const {
    return translate("trace-file", [&] { return iteration_timing_to_json(gpucast::iteration_timing(get(), batch)); });
  }
  // Bytes of the activation blocks (saved for backward) each module allocated: what gpucast.describe() needs,
  // without building the whole trace document.
  std::string activation_bytes_by_module() const {
    const Trace& t = get();
    std::map<std::string, int64_t> by;
    for (const Allocation& a : t.allocations) {
      if (a.category == Category::Activation && a.alloc_op >= 0 && a.alloc_op < static_cast<int64_t>(t.ops.size())) {
        by[t.ops[a.alloc_op].module] += a.block_bytes;
      }
    }
    return nlohmann::json(by).dump();
  }
  int64_t num_events() const { return static_cast<int64_t>(get().events.size()); }
  int64_t num_allocations() const { return static_cast<int64_t>(get().allocations.size()); }
  // What Python's lazy views read: the header (counters, notes, context), records by chunk, and the bytes held by
  // category computed here (never the whole document in Python).
  std::string header_json() const { return translate("trace-file", [&] { return trace_header_json(get()); }); }
  std::string records_json(const std::string& kind, int64_t first, int64_t count) const {
    return translate("argument", [&] {
      if (first < 0 || count < 0) GPUCAST_USER_ERROR("records_json: first and count should be >= 0");
      return trace_records_json(get(), kind, static_cast<size_t>(first), static_cast<size_t>(count));
    });
  }
  std::string bytes_by_category(const std::string& device, bool at_peak) const {
    return translate("trace-file",
                     [&] { return nlohmann::json(gpucast::bytes_by_category(get(), device, at_peak)).dump(); });
  }
};

}  // namespace gpucast
