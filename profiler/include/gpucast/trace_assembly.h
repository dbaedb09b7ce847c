// gpucast/trace_assembly.h: from per-thread raw records to a Trace.
//
// The tracer appends to one RawThread per thread without locks shared between threads; when the
// trace stops, assemble_trace merges them in global order, links backward nodes to forward ops,
// pairs allocations with frees and assigns memory categories. Plain C++, tested without torch.
#pragma once

#include <cstdint>
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
};

Trace assemble_trace(AssemblyInput input);

namespace detail {
// Exposed for tests: the rules that assign categories to untagged allocations.
void link_backward(Trace& trace);
void build_allocations(Trace& trace, const std::vector<BaselineBlock>& baseline_blocks);
void assign_categories(Trace& trace, const std::vector<Tag>& tags, bool optimizer_state_from_phase = false);
}  // namespace detail

}  // namespace gpucast
