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

namespace at {
class RecordFunction;
}

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
  // Untagged blocks an optimizer step allocated and still held at the end are optimizer state (auto mode, which has
  // no optimizer hooks to tag them; trace_assembly.h).
  bool optimizer_state_from_phase = false;
};

// Sees the ops of an armed trace (auto mode): whether recording begins at an op, and each op recorded. Its methods
// run inside RecordFunction callbacks on the op's thread, outside the tracer's locks: they take no GIL, dispatch
// nothing, block on nothing a training thread holds, and let no exception escape. ended() may stop the trace
// (stop_recording) or start it afresh (restart_recording).
class TraceObserver {
 public:
  virtual ~TraceObserver() = default;
  // Armed, not recording: whether recording begins with this op (which is then recorded).
  virtual bool begins_at(const at::RecordFunction& fn) noexcept = 0;
  // Recording, before this op is recorded: whether what was recorded is dropped and recording starts afresh here.
  virtual bool restarts_at(const at::RecordFunction& fn) noexcept = 0;
  // Recording: this op's start was recorded.
  virtual void started(const at::RecordFunction& fn) noexcept = 0;
  // Recording: this op's end was recorded; `unwinding` when an exception was leaving it.
  virtual void ended(const at::RecordFunction& fn, bool unwinding) noexcept = 0;
  // Another trace (start_trace) took the tracer before recording began: the observer is disarmed.
  virtual void preempted() noexcept = 0;
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

// Throws UserError if a trace is already running. `observer` (optional) sees each recorded op (started, ended;
// never begins_at) until the trace stops, and must outlive the process's ops.
void start_trace(const TraceOptions& options, TraceObserver* observer = nullptr);
// Throws UserError if no trace is running.
RecordedTrace stop_recording();
bool trace_active();
// Installs the tracer's callbacks with recording off; recording begins (as start_trace) at the first op for which
// `observer` says so. Throws UserError if a trace is running or armed. `observer` must outlive the process's ops
// (auto mode's is never destroyed).
void arm_trace(const TraceOptions& options, TraceObserver* observer);
// Removes an armed trace's callbacks where recording has not begun; a no-op otherwise.
void disarm_trace();
// Recording: drops what was recorded and starts afresh (baselines taken now), from the next op on.
void restart_recording();
// Ops recorded so far in the running trace (dropped ones included).
int64_t recorded_ops();
// After fork, in the child: recording and arming end without a lock (another thread of the parent may have held
// one); the callbacks are removed at the child's next op.
void abandon_trace_after_fork() noexcept;
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
// The meta allocator wrapper (meta_allocator_hook.cpp), installed when the library loads: each meta storage gets a
// token that identifies it, and its allocation and free are memory events on device "meta" during a trace.
bool install_meta_allocator_hook(std::string* why);
bool meta_allocator_hook_installed();
// Whether the operator ("aten::_safe_softmax", overload "") has a meta kernel in Python while the CPU and CUDA run its
// CompositeExplicitAutograd kernel: meta probes run that composite on meta too, as those devices do, and the trace
// keeps the ops inside it (meta_kernels.cpp). False for what is not an operator.
bool meta_runs_composite(const std::string& name, const std::string& overload);
// The calling thread's next allocation, through the CPU allocator wrapper or on the CUDA caching allocator, throws
// a c10::Error with `message` (once): how auto mode stops a job (on_risk:raise) where no Python hook can raise
// (gpucast/allocation_refusal.h). Cleared by an empty message.
void refuse_next_allocation(const std::string& message);
// CPU bytes held through the wrapper (allocated since gpucast was loaded) and the peak since the last reset.
std::pair<int64_t, int64_t> cpu_memory_stats(bool reset_peak);
// Attaches to the CUDA caching allocator when CUDA is compiled in and a device is present.
bool install_cuda_allocator_hook(std::string* why);
bool cuda_device_present();

TraceContext current_context();

}  // namespace gpucast
