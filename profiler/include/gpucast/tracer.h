// gpucast/tracer.h: record one or more training iterations at the dispatcher.
//
// start_trace installs global at::RecordFunction callbacks (FUNCTION, BACKWARD_FUNCTION, USER_SCOPE);
// stop_recording removes them and returns the records, assembled into a Trace on first use. Records go to per-thread buffers; inside a
// callback gpucast takes no GIL, dispatches nothing, allocates nothing through torch and lets no
// exception escape.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpucast/trace.h"

namespace gpucast {

struct TraceOptions {
  bool record_shapes = true;
  bool memory = true;
  // false: ops nested in another op are counted in it (OpRecord::nested), not recorded, unless autograd may link
  // a backward node to them (a sequence number); the outermost ops of each call, backward node and optimizer step
  // are. For timing traces, whose cost is then about that of the outermost ops.
  bool nested_ops = true;
  // Chosen bounds (as the max_ops / max_events keys' defaults in plugin/config_keys.cpp), not measured.
  int64_t max_ops = 2000000;
  int64_t max_events = 4000000;
  bool device_timing = true;       // time device work where a CUDA device is present
  bool external_profiler = false;  // another client (torch.profiler) records CUDA activity: leave CUPTI alone
  // Sparse device timing (timed_layers.h): device timers only around these layers' ops (module paths, or
  // "(outside modules)"), their backward and the optimizer step; empty: every op. CPU clocks time every op.
  std::vector<std::string> timed_layers;
};

// A stopped trace whose records are not assembled yet: stopping only hands the per-thread buffers over,
// and the Trace is assembled (ordered, linked, categorized) on first use, outside the training step.
class RecordedTrace {
 public:
  RecordedTrace();
  ~RecordedTrace();
  RecordedTrace(RecordedTrace&&) noexcept;
  RecordedTrace& operator=(RecordedTrace&&) noexcept;
  // Assembles on the first call (thread-safe); later calls return the same Trace.
  const Trace& trace();

 private:
  friend RecordedTrace stop_recording();
  struct Raw;
  std::unique_ptr<Raw> raw_;
};

// Throws UserError if a trace is already running.
void start_trace(const TraceOptions& options);
// Throws UserError if no trace is running.
RecordedTrace stop_recording();
bool trace_active();
// Tests and rehearsals: later traces with device_timing on use make_cpu_span_timer() (device_timer.h) in place of
// CUPTI and CUDA events, with or without a GPU, so that the device-timing path runs on any machine.
void use_stand_in_device_timer(bool on);
// Number of RecordFunction callbacks gpucast has installed right now (0 outside a trace).
int installed_callbacks();

// Module scopes, pushed and popped by the Python layer's global module hooks on the calling thread.
void push_module(const std::string& path);
void pop_module();
// The same in two halves, for hooks that call once per module and trace: the module's code in the running trace
// (its id times two, plus one where it is a timed layer), -1 when no trace runs; then pushes of that code.
int64_t module_code(const std::string& path);
void push_module_code(int64_t code);
// Record that the blocks at `ptrs` on `device` belong to `category` now (resolved when the trace stops).
void tag_blocks(const std::vector<int64_t>& ptrs, const std::string& device, Category category);

// Allocator hooks: installed once, pass-through outside a trace.
// The CPU allocator wrapper is installed when the library loads; returns false (and says why in
// `why`) when another allocator with a higher priority holds the CPU slot.
bool install_cpu_allocator_hook(std::string* why);
bool cpu_allocator_hook_installed();
// CPU bytes held through the wrapper (allocated since gpucast was loaded) and the peak since the last reset.
std::pair<int64_t, int64_t> cpu_memory_stats(bool reset_peak);
// Attaches to the CUDA caching allocator when CUDA is compiled in and a device is present.
bool install_cuda_allocator_hook(std::string* why);
bool cuda_device_present();

TraceContext current_context();

}  // namespace gpucast
