// gpucast/trace_assembly.h: from per-thread raw records to a Trace.
//
// The tracer appends to one RawThread per thread without locks shared between threads; when the
// trace stops, assemble_trace merges them in global order, links backward nodes to forward ops,
// pairs allocations with frees and assigns memory categories. Plain C++, tested without torch.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "gpucast/trace.h"

namespace gpucast {

// A statement made from outside the allocator about the block at `ptr` at time `seq`,
// e.g. "this storage is a parameter" (from Python hooks).
struct Tag {
  uint64_t ptr = 0;
  std::string device;
  Category category = Category::Other;
  uint64_t seq = 0;
};

struct RawThread {
  uint64_t thread = 0;
  // OpRecord::parent and OpRecord::bwd_node hold indices into this vector; MemEvent::op too.
  std::vector<OpRecord> ops;
  std::vector<MemEvent> events;
  std::vector<Tag> tags;
};

struct BaselineBlock {
  uint64_t ptr = 0;
  int64_t bytes = 0;
  int64_t block_bytes = 0;
  std::string device;
};

struct AssemblyInput {
  std::vector<RawThread> threads;
  std::vector<BaselineBlock> baseline_blocks;
  std::map<std::string, DeviceBaseline> baseline;
  TraceContext context;
  TraceCounters counters;  // counters gathered while recording (dropped, callback errors)
  std::vector<Note> notes;
  std::string timing_source = "cpu_clock";
  std::vector<std::string> timed_layers;
  int64_t start_ns = 0;
  int64_t end_ns = 0;
  // TraceOptions::optimizer_state_from_phase: untagged blocks an optimizer step allocated and the window never
  // freed are optimizer state.
  bool optimizer_state_from_phase = false;
  // Whether an op's meta kernel is one of PyTorch's Python meta kernels (profiler/meta_kernels.cpp asks the
  // dispatcher); empty: no op is folded (fold_meta_kernels below).
  std::function<bool(const OpRecord&)> meta_kernel_in_python;
};

Trace assemble_trace(AssemblyInput input);

namespace detail {
// Exposed for tests: the rules that assign categories to untagged allocations.
void link_backward(Trace& trace);
void build_allocations(Trace& trace, const std::vector<BaselineBlock>& baseline_blocks);
void assign_categories(Trace& trace, const std::vector<Tag>& tags, bool optimizer_state_from_phase = false);

// What folding did to one thread (fold_meta_kernels).
struct MetaFold {
  int64_t kernels = 0;      // ops folded into, each now a leaf
  int64_t ops = 0;          // ops dropped from inside them
  int64_t temporaries = 0;  // blocks allocated and freed inside one of them, dropped with both events
};

// On the meta device, PyTorch runs many ops through meta kernels written in Python (torch/_meta_registrations.py
// activate_meta() registers them, and the decompositions of torch/_decomp, over the C++ ones): aten::addmm runs as
// mm, mul and add, each allocating; aten::relu as le, scalar_tensor and where. The CPU and the GPU run each such op
// as one kernel that allocates its outputs. Folding makes a meta trace what those devices record: an op that
// touches a meta tensor (or a meta block is allocated inside it) and whose meta kernel is in Python
// (`in_python`), outermost first, keeps the memory events made inside it as its own; the ops inside it are
// dropped; a block allocated and freed inside it is a temporary of the Python kernel and is dropped with both
// its events. Indices (parent, bwd_node, MemEvent::op) are renumbered. Invariant relied on: an op's parent comes
// before it (ops are recorded at their start); an op whose parent does not is taken as outside any folded op.
MetaFold fold_meta_kernels(RawThread& thread, const std::function<bool(const OpRecord&)>& in_python);
}  // namespace detail

}  // namespace gpucast
