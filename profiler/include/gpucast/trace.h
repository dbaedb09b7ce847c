// gpucast/trace.h: the recorded iteration, a plain C++ value.
//
// The profiler produces a Trace, the predictor consumes it; neither side needs torch to read it.
// A Trace round-trips through JSON (trace_json.h) so that recorded traces under tests/data/ can be
// replayed without running a model.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "gpucast/note.h"

namespace gpucast {

// 2: notes are {"code", "text"} (version 1 wrote them as text; read as code "unclassified").
// 3: scalars are {"type", "value"}, ints exact and complex values [real, imaginary] (version 2 wrote a double, and
//    complex values as "other"); strings that are not UTF-8 are {"escaped": text}, baseline keys escaped text
//    (trace_json.cpp says how).
inline constexpr int kTraceSchemaVersion = 3;
inline constexpr int kOldestTraceSchemaVersion = 1;

enum class Phase : uint8_t { Forward = 0, Backward = 1, Optimizer = 2 };
enum class Scope : uint8_t { Function = 0, BackwardFunction = 1, UserScope = 2 };
enum class Category : uint8_t {
  Parameter = 0,
  Gradient = 1,
  OptimizerState = 2,
  Activation = 3,  // allocated in forward, released during backward (saved for backward)
  Temporary = 4,   // released before the op that allocated it ended
  Input = 5,       // tensors handed to the outermost module
  Other = 6,
};
inline constexpr int kNumCategories = 7;

std::string_view to_string(Phase p);
std::string_view to_string(Scope s);
std::string_view to_string(Category c);
// Parse the names produced by to_string; throw std::invalid_argument naming the value otherwise.
Phase phase_from_string(std::string_view s);
Scope scope_from_string(std::string_view s);
Category category_from_string(std::string_view s);

struct TensorMeta {
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // empty for non-strided layouts
  std::string dtype;             // "float32", "int64", ...
  std::string device;            // "cpu", "cuda:0"
  uint64_t storage = 0;          // storage identity: data pointer of the storage, 0 if none
  bool operator==(const TensorMeta&) const = default;
};

// One argument or result of an op.
struct Value {
  enum class Kind : uint8_t { None = 0, Tensor = 1, TensorList = 2, Scalar = 3, Other = 4 };
  // A scalar argument's type, as c10::IValue held it.
  enum class ScalarType : uint8_t { Float = 0, Int = 1, Bool = 2, Complex = 3 };
  Kind kind = Kind::None;
  std::vector<TensorMeta> tensors;  // one for Tensor, n for TensorList (undefined: empty shape, dtype "")
  // Scalar: its value as a double, whatever its type (Int: the nearest double, inexact above 2^53; Bool: 0 or 1;
  // Complex: the real part), which is what consumers comparing or summing values read.
  double scalar = 0.0;
  ScalarType scalar_type = ScalarType::Float;
  int64_t integer = 0;  // Int: the exact value; Bool: 0 or 1; otherwise 0
  double imag = 0.0;    // Complex: the imaginary part; otherwise 0
  bool operator==(const Value&) const = default;
};
std::string_view to_string(Value::Kind k);
Value::Kind value_kind_from_string(std::string_view s);
std::string_view to_string(Value::ScalarType t);
Value::ScalarType scalar_type_from_string(std::string_view s);
// Scalar values with their fields consistent (the invariants above).
Value float_scalar(double x);
Value int_scalar(int64_t x);
Value bool_scalar(bool x);
Value complex_scalar(double re, double im);

struct OpRecord {
  int64_t id = -1;        // index in Trace::ops (ordered by start)
  std::string name;       // "aten::addmm", "AddmmBackward0", "Optimizer.step#AdamW.step"
  std::string overload;   // "out", "" for the default overload
  Scope scope = Scope::Function;
  Phase phase = Phase::Forward;
  uint64_t thread = 0;    // logical thread id (RecordFunction::currentThreadId)
  int64_t seq_nr = -1;    // autograd sequence number, -1 if none
  uint64_t fwd_thread = 0;  // backward nodes: thread id of the forward op
  int64_t parent = -1;    // enclosing op on the same thread
  int32_t depth = 0;      // nesting depth on its thread
  int64_t start_ns = 0;
  int64_t end_ns = 0;
  uint64_t start_seq = 0;  // global order of starts, ends and memory events
  uint64_t end_seq = 0;
  bool complete = true;    // false when the trace stopped before the op ended
  std::string module;      // module path ("" outside any module)
  int64_t fwd_op = -1;     // backward: the linked forward op (node's own link, inherited inside it)
  int64_t bwd_node = -1;   // ops inside a backward node: that node
  int64_t device_ns = -1;  // device time of the work it launched (CUPTI or CUDA events); -1 if not timed
  int64_t nested = 0;      // ops inside it that were counted, not recorded (a trace without nested_ops)
  std::vector<Value> inputs;
  std::vector<Value> outputs;
};

struct MemEvent {
  uint64_t seq = 0;        // global order shared with OpRecord::start_seq/end_seq
  uint64_t ptr = 0;
  int64_t bytes = 0;       // + allocation, - free; requested bytes
  int64_t block_bytes = 0; // + / - bytes the allocator counts (CUDA: rounded block; CPU: == bytes)
  std::string device;
  uint64_t thread = 0;
  int64_t op = -1;         // innermost op open on that thread, -1 if none
  Phase phase = Phase::Forward;  // phase of that thread when it happened
  int64_t time_ns = 0;
  int64_t allocation = -1; // index in Trace::allocations
};

// One block's life as seen from the window: allocated in it or held at its start (baseline).
struct Allocation {
  uint64_t ptr = 0;
  int64_t bytes = 0;
  int64_t block_bytes = 0;
  std::string device;
  bool baseline = false;     // held when the trace started
  int64_t alloc_event = -1;  // index in Trace::events, -1 for baseline blocks
  int64_t free_event = -1;   // -1 if still held when the trace stopped
  int64_t alloc_op = -1;
  int64_t free_op = -1;
  Category category = Category::Other;
};

struct TraceContext {
  std::string gpucast_version;
  std::string torch_version;
  std::string device;      // host description, e.g. "cpu" or "cuda:0 NVIDIA H200"
  std::string build_type;  // "Release", "Debug"
  bool cuda_build = false;
};

struct DeviceBaseline {
  int64_t bytes = 0;       // held at the start, as far as the allocator can tell
  bool known = false;      // false when the allocator could not tell
};

struct TraceCounters {
  int64_t dropped_ops = 0;           // over the max_ops bound
  int64_t dropped_events = 0;        // over the max_events bound
  int64_t unlinked_backward = 0;     // backward nodes without a valid sequence number or match
  int64_t linked_backward = 0;
  int64_t unmatched_frees = 0;       // frees of blocks the allocator hook did not see allocated
  int64_t callback_errors = 0;       // internal errors swallowed inside callbacks
  int64_t threads = 0;
};

struct Trace {
  int schema_version = kTraceSchemaVersion;
  TraceContext context;
  int64_t start_ns = 0;
  int64_t end_ns = 0;
  std::vector<OpRecord> ops;
  std::vector<MemEvent> events;
  std::vector<Allocation> allocations;
  std::map<std::string, DeviceBaseline> baseline;  // by device
  TraceCounters counters;
  std::string timing_source = "cpu_clock";  // device time from "cupti", "cuda_events", or none ("cpu_clock")
  // Sparse timing (timed_layers.h): the layers the trace was asked to time, the only ones whose ops device
  // timers covered (CPU clocks time every op) and whose times the step-time forecast uses; empty: every layer.
  std::vector<std::string> timed_layers;
  std::vector<Note> notes;  // backends unavailable, fallbacks taken (codes: docs/design.md)
};

// A top-level optimizer step: the user scope "Optimizer.step#<class>.step" at depth 0.
bool is_optimizer_step(const OpRecord& op);

// The user scope gpucast.forecast records after each call of the training step inside its traces (depth 0, no
// ops inside): where an iteration ends, whatever optimizers the step runs.
inline constexpr std::string_view kIterationEndMarker = "gpucast.iteration_end";
bool is_iteration_end_marker(const OpRecord& op);

// Where each training iteration of a trace ends (OpRecord::end_seq), in order. A trace with iteration-end markers
// (kIterationEndMarker) ends one at each. Otherwise at the optimizer steps: steps with no backward op between
// them end one iteration together, at the last of them, so that several optimizers stepping one after the other
// (one for some parameters, another for the rest) are one iteration's optimizer, not an iteration each;
// optimizers that step in turn with a backward pass before each (a GAN's discriminator, then its generator) end
// an iteration each there. Empty: neither markers nor optimizer steps.
std::vector<uint64_t> iteration_ends(const Trace& t);

// The backward node whose gradient an op in backward allocated: the node it runs in, where that node is linked to
// a forward op. Otherwise (autograd's engine reduces a broadcast bias's gradient, or sums a shared weight's two
// contributions, outside any node, right after the node that produced it; AccumulateGrad is linked to no forward
// op) the latest linked node that ran before it on its thread, among the 256 ops before it while backward lasts.
// -1 where there is none; an op outside backward keeps its own node (or -1).
int64_t gradient_node(const Trace& t, const OpRecord& op);

// The autograd engine's own work for a node: an op directly inside the engine's record around a node
// ("autograd::engine::evaluate_function: ..."), outside and after that node (a broadcast bias's gradient reduced
// to the bias's shape, a second gradient of a tensor added to the first). Returns that node where it is linked to
// a forward op, else -1 (not such an op; or AccumulateGrad's record, where DDP's reducer runs as a post hook).
// Per-layer times and summaries count such work in the node's layer.
int64_t engine_work_node(const Trace& t, const OpRecord& op);

}  // namespace gpucast
