#include "gpucast/tracer.h"

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <set>
#include <string_view>
#include <thread>
#include <unordered_map>

#include <ATen/record_function.h>
#include <ATen/core/ivalue.h>
#include <algorithm>
#include <tuple>

#include "gpucast/device_timer.h"
#include "gpucast/error.h"
#include "gpucast/storage_identity.h"
#include "gpucast/timed_layers.h"
#include "memory_sink.h"

namespace gpucast {
namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Compact forms kept while recording, converted to TensorMeta/Value/MemEvent when the trace stops.
// Values and dimensions live in per-thread arenas so that an op record stays small.
struct RawValue {
  Value::Kind kind = Value::Kind::None;
  bool element = false;  // an element of the preceding tensor list
  int8_t dtype = -1;     // c10::ScalarType; -1 for an undefined tensor
  c10::DeviceType device_type = c10::DeviceType::CPU;
  c10::DeviceIndex device_index = -1;
  uint8_t ndim = 0;
  bool strided = false;   // strides follow the sizes in the arena
  Value::ScalarType scalar_type = Value::ScalarType::Float;  // Scalar: which members of the unions below it set
  uint32_t dims = 0;      // offset of sizes (then strides) in ThreadState::dims
  uint32_t count = 0;     // tensor list: number of elements that follow
  // A tensor's storage and a scalar's value share the space: kind (and scalar_type) say which member was set.
  union {
    uint64_t storage = 0;  // Tensor
    double imag;           // Scalar, Complex: the imaginary part
  };
  union {
    double real = 0.0;  // Scalar, Float or Complex: the value (the real part)
    int64_t integer;    // Scalar, Int or Bool: the exact value (Bool: 0 or 1)
  };
};
static_assert(sizeof(RawValue) == 32, "one RawValue is kept per recorded argument: keep it 32 bytes");
struct RawOp {
  int32_t name = -1;  // interned in ThreadState::names
  int32_t overload = -1;
  Scope scope = Scope::Function;
  Phase phase = Phase::Forward;
  bool complete = false;
  bool device_timed = false;  // device timers were taken around it
  int64_t seq_nr = -1;
  uint64_t fwd_thread = 0;
  int32_t parent = -1;
  int32_t depth = 0;
  int32_t bwd_node = -1;
  int32_t module = -1;
  int64_t start_ns = 0, end_ns = 0;
  uint64_t start_seq = 0, end_seq = 0;
  uint32_t inputs = 0, n_inputs = 0;    // range in ThreadState::values
  uint32_t outputs = 0, n_outputs = 0;
  int64_t nested = 0;  // ops inside it counted, not recorded (TraceOptions::nested_ops false)
};
struct RawEvent {
  uint64_t seq;
  uint64_t ptr;
  int64_t bytes;
  int64_t block_bytes;
  int64_t time_ns;
  int32_t op;
  Phase phase;
  c10::DeviceType device_type;
  c10::DeviceIndex device_index;
};
// What a thread records during a trace; handed over as a whole when the trace stops.
struct ThreadRecords {
  std::vector<RawOp> ops;
  std::vector<RawValue> values;
  std::vector<int64_t> dims;
  std::vector<RawEvent> events;
  std::vector<Tag> tags;

  // Emptied for the next trace. The buffers are kept (no reallocation and no fresh pages in the next trace's
  // first iteration) up to kKeptBytes; larger ones are released, so an idle process holds little.
  // 32 MiB: a chosen bound, not measured.
  static constexpr size_t kKeptBytes = size_t{32} << 20;
  size_t capacity_bytes() const {
    return ops.capacity() * sizeof(RawOp) + values.capacity() * sizeof(RawValue) + dims.capacity() * sizeof(int64_t) +
           events.capacity() * sizeof(RawEvent) + tags.capacity() * sizeof(Tag);
  }
  void clear() {
    if (capacity_bytes() > kKeptBytes) {
      *this = ThreadRecords();
      return;
    }
    ops.clear();
    values.clear();
    dims.clear();
    events.clear();
    tags.clear();
  }
};

struct OpenOp {
  int32_t index;
  uint64_t handle;
  bool backward;   // opened a backward region
  bool optimizer;  // opened an optimizer region
  bool encloses;   // an op call, backward node or optimizer step: without nested_ops, ops inside it are counted
};

// A thread's buffer lock: taken by its own thread around each record (uncontended: one exchange and one store),
// and by stop_recording for the moment it takes the records over.
class SpinLock {
 public:
  void lock() noexcept {
    while (flag_.exchange(true, std::memory_order_acquire)) {
      while (flag_.load(std::memory_order_relaxed)) std::this_thread::yield();
    }
  }
  void unlock() noexcept { flag_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> flag_{false};
};

struct ThreadState {
  SpinLock mu;  // uncontended while recording; taken by stop_recording when draining
  bool busy = false;  // set while this thread is inside gpucast code holding `mu`
  uint64_t tid = 0;
  uint64_t slot = 0;  // position in the registry: the high half of this thread's op keys
  uint64_t generation = 0;
  ThreadRecords rec;
  std::vector<OpenOp> stack;
  std::vector<int32_t> open_bwd_nodes;
  std::vector<int32_t> modules;  // module stack (interned ids)
  std::vector<char> module_timed;  // beside it: whether that module is a timed layer
  int backward_depth = 0;
  int optimizer_depth = 0;
  // The last backward node this thread closed got device timers (reset where the engine's record around the
  // next node opens): the engine's work after it, in the same record, is that node's.
  bool last_node_timed = false;
  // Op names interned per thread, kept across traces (bounded by the number of distinct names).
  std::deque<std::string> names;
  std::unordered_map<std::string_view, int32_t> name_ids;

  // Names come mostly from operator schemas, whose text does not move: a direct-mapped cache keyed by the
  // pointer (checked against the text, since a scope's name may be a temporary) saves hashing the name.
  struct CacheEntry {
    const char* ptr = nullptr;
    const char* interned = nullptr;  // the interned copy's text (a deque's strings do not move)
    int32_t id = -1;
  };
  // 512: a chosen size, not measured.
  std::array<CacheEntry, 512> name_cache{};

  int32_t intern(const char* text) {
    if (text == nullptr) text = "";
    CacheEntry& c = name_cache[(reinterpret_cast<uintptr_t>(text) >> 3) % name_cache.size()];
    if (c.ptr == text && std::strcmp(c.interned, text) == 0) return c.id;
    const int32_t id = intern_slow(text);
    c.ptr = text;
    c.interned = names[static_cast<size_t>(id)].c_str();
    c.id = id;
    return id;
  }

  int32_t intern_slow(const char* text) {
    std::string_view v(text);
    auto it = name_ids.find(v);
    if (it != name_ids.end()) return it->second;
    names.emplace_back(v);
    const auto id = static_cast<int32_t>(names.size() - 1);
    name_ids.emplace(std::string_view(names.back()), id);
    return id;
  }

  void reset(uint64_t gen) {
    generation = gen;
    rec.clear();
    stack.clear();
    open_bwd_nodes.clear();
    modules.clear();
    module_timed.clear();
    backward_depth = optimizer_depth = 0;
    last_node_timed = false;
  }
  Phase phase() const {
    if (optimizer_depth > 0) return Phase::Optimizer;
    if (backward_depth > 0) return Phase::Backward;
    return Phase::Forward;
  }
};

struct TracerState {
  std::mutex mu;  // registry, module names, start/stop
  std::vector<std::shared_ptr<ThreadState>> threads;
  std::vector<std::string> module_names;
  std::unordered_map<std::string, int32_t> module_ids;
  std::atomic<bool> active{false};
  // Armed (arm_trace): callbacks installed, recording off until `observer` says so. The observer stays set while
  // the armed trace records, and is cleared when it stops. A trace started with an observer has it from the start.
  std::atomic<bool> armed{false};
  std::atomic<TraceObserver*> observer{nullptr};
  // Set in a child after fork: the callbacks (inherited, recording off) are removed at its next op.
  std::atomic<bool> forked{false};
  std::atomic<uint64_t> generation{0};
  std::atomic<uint64_t> seq{1};
  std::atomic<int64_t> op_count{0}, event_count{0};
  std::atomic<int64_t> dropped_ops{0}, dropped_events{0}, callback_errors{0};
  std::atomic<int> installed{0};
  at::CallbackHandle handle = 0;
  TraceOptions options;
  int64_t start_ns = 0;
  std::vector<BaselineBlock> baseline_blocks;
  std::map<std::string, DeviceBaseline> baseline;
  std::vector<Note> notes;
  // Device timer of the running trace; kept after stop until the next start, since RecordFunctions that
  // began before the stop may still end and call it.
  std::unique_ptr<DeviceTimer> timer;
  std::atomic<DeviceTimer*> active_timer{nullptr};
  std::string timing_source = "cpu_clock";
  TimedLayers timed;      // the running trace's timed layers (set at start, read-only while it runs)
  bool outside_timed = true;  // ops outside any module are a timed layer
  SeqMarks marks;         // forward sequence numbers that were timed, for their backward nodes
};

TracerState& state() {
  static auto* s = new TracerState();  // never destroyed: callbacks may run during process exit
  return *s;
}

thread_local ThreadState* tls_state = nullptr;

ThreadState* thread_state() {
  if (tls_state == nullptr) {
    auto ts = std::make_shared<ThreadState>();
    ts->tid = at::RecordFunction::currentThreadId();
    TracerState& s = state();
    std::lock_guard<std::mutex> g(s.mu);
    ts->slot = s.threads.size();
    s.threads.push_back(ts);
    tls_state = ts.get();
  }
  return tls_state;
}

// Locks a thread's buffer for the current trace generation; refuses re-entry from the same thread.
class Locked {
 public:
  explicit Locked(ThreadState* ts) : ts_(ts) {
    if (ts_->busy) {
      ts_ = nullptr;
      return;
    }
    ts_->mu.lock();
    ts_->busy = true;
    const uint64_t gen = state().generation.load(std::memory_order_acquire);
    if (ts_->generation != gen) ts_->reset(gen);
  }
  ~Locked() {
    if (ts_ == nullptr) return;
    ts_->busy = false;
    ts_->mu.unlock();
  }
  Locked(const Locked&) = delete;
  Locked& operator=(const Locked&) = delete;
  explicit operator bool() const { return ts_ != nullptr; }

 private:
  ThreadState* ts_;
};

void fill_tensor(ThreadState& ts, RawValue& r, const at::Tensor& t) {
  if (!t.defined()) return;
  r.dtype = static_cast<int8_t>(t.scalar_type());
  r.device_type = t.device().type();
  r.device_index = t.device().index();
  const auto sizes = t.sym_sizes();
  r.ndim = static_cast<uint8_t>(std::min<size_t>(sizes.size(), 255));
  r.dims = static_cast<uint32_t>(ts.rec.dims.size());
  for (size_t i = 0; i < r.ndim; ++i) {
    ts.rec.dims.push_back(sizes[i].is_heap_allocated() ? -1 : sizes[i].as_int_unchecked());
  }
  if (t.layout() == c10::kStrided && !t.is_nested()) {
    r.strided = true;
    const auto strides = t.sym_strides();
    for (size_t i = 0; i < r.ndim; ++i) {
      ts.rec.dims.push_back(strides[i].is_heap_allocated() ? -1 : strides[i].as_int_unchecked());
    }
  }
  if (t.has_storage()) r.storage = storage_identity(t.storage());
}

// Appends one value (a tensor list: its header, then its elements) to the thread's arena.
void fill_value(ThreadState& ts, const c10::IValue& iv) {
  RawValue& v = ts.rec.values.emplace_back();
  if (iv.isTensor()) {
    v.kind = Value::Kind::Tensor;
    fill_tensor(ts, v, iv.toTensor());
  } else if (iv.isTensorList()) {
    v.kind = Value::Kind::TensorList;
    const auto list = iv.toTensorList();
    const size_t header = ts.rec.values.size() - 1;
    ts.rec.values[header].count = static_cast<uint32_t>(list.size());
    for (size_t i = 0; i < list.size(); ++i) {
      RawValue& e = ts.rec.values.emplace_back();
      e.kind = Value::Kind::Tensor;
      e.element = true;
      fill_tensor(ts, e, list.get(i));
    }
  } else if (iv.isDouble()) {
    v.kind = Value::Kind::Scalar;
    v.real = iv.toDouble();
  } else if (iv.isInt()) {  // exact: a seed or a fill value above 2^53 keeps every digit
    v.kind = Value::Kind::Scalar;
    v.scalar_type = Value::ScalarType::Int;
    v.integer = iv.toInt();
  } else if (iv.isBool()) {
    v.kind = Value::Kind::Scalar;
    v.scalar_type = Value::ScalarType::Bool;
    v.integer = iv.toBool() ? 1 : 0;
  } else if (iv.isComplexDouble()) {
    v.kind = Value::Kind::Scalar;
    v.scalar_type = Value::ScalarType::Complex;
    const c10::complex<double> c = iv.toComplexDouble();
    v.real = c.real();
    v.imag = c.imag();
  } else if (iv.isNone()) {
    v.kind = Value::Kind::None;
  } else {
    v.kind = Value::Kind::Other;
  }
}

// Records a range of values; returns {first, number of top-level values}.
template <typename Range>
std::pair<uint32_t, uint32_t> fill_values(ThreadState& ts, const Range& range) {
  const auto first = static_cast<uint32_t>(ts.rec.values.size());
  uint32_t n = 0;
  for (const c10::IValue& iv : range) {
    fill_value(ts, iv);
    ++n;
  }
  return {first, n};
}

// The first character is compared inline: most names differ there, and this runs twice for every op.
bool starts_with(const char* s, const char* prefix) {
  return s[0] == prefix[0] && std::strncmp(s, prefix, std::strlen(prefix)) == 0;
}

bool begin_armed_recording();
void remove_callbacks_after_fork();
void record_start(TracerState& s, const at::RecordFunction& fn);

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  TracerState& s = state();
  if (!s.active.load(std::memory_order_acquire)) {
    if (s.forked.load(std::memory_order_relaxed)) remove_callbacks_after_fork();
    if (!s.armed.load(std::memory_order_acquire)) return nullptr;
    TraceObserver* gate = s.observer.load(std::memory_order_acquire);
    if (gate == nullptr || !gate->begins_at(fn) || !begin_armed_recording()) return nullptr;
  } else if (TraceObserver* obs = s.observer.load(std::memory_order_acquire); obs != nullptr && obs->restarts_at(fn)) {
    restart_recording();
  }
  record_start(s, fn);
  if (TraceObserver* obs = s.observer.load(std::memory_order_acquire)) {
    if (s.active.load(std::memory_order_acquire)) obs->started(fn);
  }
  return nullptr;
}

void record_start(TracerState& s, const at::RecordFunction& fn) {
  try {
    const char* name = fn.name();
    if (name == nullptr || starts_with(name, "gpucast::")) return;
    ThreadState* ts = thread_state();
    Locked lock(ts);
    if (!lock) return;
    if (!s.options.nested_ops && !ts->stack.empty() && ts->stack.back().encloses && fn.seqNr() < 0) {
      ++ts->rec.ops[ts->stack.back().index].nested;
      return;
    }
    if (s.op_count.fetch_add(1, std::memory_order_relaxed) >= s.options.max_ops) {
      s.dropped_ops.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    RawOp& op = ts->rec.ops.emplace_back();
    const auto index = static_cast<int32_t>(ts->rec.ops.size() - 1);
    op.scope = fn.scope() == at::RecordScope::BACKWARD_FUNCTION ? Scope::BackwardFunction
               : fn.scope() == at::RecordScope::USER_SCOPE   ? Scope::UserScope
                                                              : Scope::Function;
    op.name = ts->intern(name);
    op.overload = ts->intern(fn.overload_name());
    op.seq_nr = fn.seqNr();
    op.fwd_thread = fn.forwardThreadId();
    op.parent = ts->stack.empty() ? -1 : ts->stack.back().index;
    op.depth = static_cast<int32_t>(ts->stack.size());
    op.bwd_node = ts->open_bwd_nodes.empty() ? -1 : ts->open_bwd_nodes.back();
    op.module = ts->modules.empty() ? -1 : ts->modules.back();
    if (s.options.record_shapes && op.scope != Scope::UserScope) {
      std::tie(op.inputs, op.n_inputs) = fill_values(*ts, fn.inputs());
    }
    const bool backward = op.scope == Scope::BackwardFunction || starts_with(name, "autograd::engine::evaluate_function");
    const bool optimizer = op.scope == Scope::UserScope && starts_with(name, "Optimizer.");
    if (backward) ++ts->backward_depth;
    if (optimizer) ++ts->optimizer_depth;
    op.phase = ts->phase();  // a region's own record belongs to the region
    if (op.scope == Scope::BackwardFunction) ts->open_bwd_nodes.push_back(index);
    if (DeviceTimer* timer = s.active_timer.load(std::memory_order_acquire)) {
      // The engine's record around a node (not the node itself), and an op directly inside such a record outside
      // its node (none open on this thread).
      const bool engine_record = backward && op.scope != Scope::BackwardFunction;
      const bool in_engine_record = !backward && op.scope == Scope::Function && ts->open_bwd_nodes.empty() &&
                                    !ts->stack.empty() && ts->stack.back().backward;
      if (engine_record) ts->last_node_timed = false;
      const bool module_timed = ts->module_timed.empty() ? s.outside_timed : ts->module_timed.back() != 0;
      const bool parent_timed = !ts->stack.empty() && ts->rec.ops[ts->stack.back().index].device_timed;
      op.device_timed = op_device_timed(s.timed.all(), parent_timed, op.phase, op.scope, module_timed,
                                        op.scope == Scope::BackwardFunction && s.marks.marked(op.seq_nr),
                                        in_engine_record && ts->last_node_timed);
      if (op.scope == Scope::Function && op.phase == Phase::Forward) s.marks.mark(op.seq_nr, op.device_timed);
      if (op.device_timed) timer->op_begin((ts->slot << 32) | static_cast<uint64_t>(index));
    }
    // What encloses the ops inside it: an op call (but not the autograd engine's record around a backward node,
    // which holds the node), a backward node, an optimizer step.
    const bool encloses = (op.scope == Scope::Function && !backward) || op.scope == Scope::BackwardFunction || optimizer;
    ts->stack.push_back(OpenOp{index, fn.handle(), backward, optimizer, encloses});
    op.start_ns = now_ns();
    op.start_seq = s.seq.fetch_add(1, std::memory_order_relaxed);
  } catch (...) {
    s.callback_errors.fetch_add(1, std::memory_order_relaxed);
  }
}

bool record_end(TracerState& s, const at::RecordFunction& fn);

void on_end(const at::RecordFunction& fn, at::ObserverContext* /*ctx*/) {
  TracerState& s = state();
  if (!s.active.load(std::memory_order_acquire) || tls_state == nullptr) return;
  if (!record_end(s, fn)) return;
  // Outside the thread's buffer lock: the observer may stop or restart the trace.
  if (TraceObserver* obs = s.observer.load(std::memory_order_acquire)) obs->ended(fn, std::uncaught_exceptions() > 0);
}

// Records an op's end; false where the op is not in this trace.
bool record_end(TracerState& s, const at::RecordFunction& fn) {
  try {
    ThreadState* ts = tls_state;
    Locked lock(ts);
    if (!lock) return false;
    auto& stack = ts->stack;
    size_t pos = stack.size();
    while (pos > 0 && stack[pos - 1].handle != fn.handle()) --pos;
    if (pos == 0) return false;  // not ours (counted in an enclosing op, skipped, dropped, or started before this trace)
    const int64_t t = now_ns();
    const uint64_t seq = s.seq.fetch_add(1, std::memory_order_relaxed);
    // Close it and anything left open above it.
    while (stack.size() >= pos) {
      const OpenOp open = stack.back();
      stack.pop_back();
      RawOp& op = ts->rec.ops[open.index];
      DeviceTimer* timer = s.active_timer.load(std::memory_order_acquire);
      if (timer != nullptr && op.device_timed) timer->op_end((ts->slot << 32) | static_cast<uint64_t>(open.index));
      if (open.backward) --ts->backward_depth;
      if (open.optimizer) --ts->optimizer_depth;
      if (op.scope == Scope::BackwardFunction && !ts->open_bwd_nodes.empty()) {
        ts->open_bwd_nodes.pop_back();
        ts->last_node_timed = op.device_timed;
      }
      op.end_ns = t;
      op.end_seq = seq;
      if (stack.size() + 1 == pos) {
        op.complete = true;
        if (s.options.record_shapes && op.scope != Scope::UserScope) {
          std::tie(op.outputs, op.n_outputs) = fill_values(*ts, fn.outputs());
        }
      }
    }
    return true;
  } catch (...) {
    s.callback_errors.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
}

std::string device_string(c10::DeviceType type, c10::DeviceIndex index) {
  std::string s = c10::DeviceTypeName(type, /*lower_case=*/true);
  if (index >= 0) {
    s.push_back(':');
    s.append(std::to_string(index));
  }
  return s;
}

}  // namespace

namespace detail {

bool memory_recording() noexcept {
  const TracerState& s = state();
  return s.active.load(std::memory_order_acquire) && s.options.memory;
}

void record_memory_event(const void* ptr, int64_t bytes, int64_t block_bytes, c10::Device device) noexcept {
  TracerState& s = state();
  if (!s.active.load(std::memory_order_acquire) || !s.options.memory) return;
  try {
    ThreadState* ts = thread_state();
    Locked lock(ts);
    if (!lock) {
      s.callback_errors.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    if (s.event_count.fetch_add(1, std::memory_order_relaxed) >= s.options.max_events) {
      s.dropped_events.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    ts->rec.events.push_back(RawEvent{s.seq.fetch_add(1, std::memory_order_relaxed), reinterpret_cast<uint64_t>(ptr), bytes,
                                  block_bytes, now_ns(), ts->stack.empty() ? -1 : ts->stack.back().index, ts->phase(),
                                  device.type(), device.index()});
  } catch (...) {
    s.callback_errors.fetch_add(1, std::memory_order_relaxed);
  }
}

}  // namespace detail

// Why CUPTI is set aside for the rest of the process (empty: it is not); read and written under the tracer's
// lock, at start and stop.
static std::string& cupti_set_aside() {
  static std::string why;
  return why;
}

static std::atomic<bool>& stand_in_timer() {
  static std::atomic<bool> on{false};
  return on;
}

void use_stand_in_device_timer(bool on) { stand_in_timer().store(on); }

namespace {

// Under s.mu, with s.options set: counters, notes, baselines and the device timer for a recording that begins now.
void prepare_recording(TracerState& s) {
  const TraceOptions& options = s.options;
  s.op_count = 0;
  s.event_count = 0;
  s.dropped_ops = 0;
  s.dropped_events = 0;
  s.callback_errors = 0;
  s.notes.clear();
  s.baseline.clear();
  s.baseline_blocks.clear();
  s.module_names.clear();
  s.module_ids.clear();
  if (options.memory) {
    if (cpu_allocator_hook_installed()) {
      s.baseline_blocks = detail::cpu_live_blocks();
      DeviceBaseline b{0, true};
      for (const BaselineBlock& blk : s.baseline_blocks) b.bytes += blk.block_bytes;
      s.baseline["cpu"] = b;
    } else {
      s.notes.push_back(Note{"cpu-allocator-hook-unavailable", "CPU allocator hook unavailable: CPU memory events not recorded"});
    }
    if (!meta_allocator_hook_installed()) {
      s.notes.push_back(Note{"meta-allocator-hook-unavailable",
                             "meta allocator hook unavailable: meta storages not recorded"});
    } else {
      std::vector<BaselineBlock> meta = detail::meta_live_blocks();
      if (!meta.empty()) {
        DeviceBaseline b{0, true};
        for (const BaselineBlock& blk : meta) b.bytes += blk.block_bytes;
        s.baseline["meta"] = b;
        s.baseline_blocks.insert(s.baseline_blocks.end(), meta.begin(), meta.end());
      }
    }
    std::string why;
    if (install_cuda_allocator_hook(&why)) {
      detail::cuda_baseline(s.baseline, s.baseline_blocks, s.notes);
    } else if (!why.empty()) {
      s.notes.push_back(Note{"cuda-allocator-hook-unavailable", why});
    }
  }
  s.timer.reset();
  s.timing_source = "cpu_clock";
  s.timed = TimedLayers(options.timed_layers);
  s.outside_timed = s.timed.layer_timed(kOutsideModules);
  if (options.device_timing && stand_in_timer().load()) {
    s.timer = make_cpu_span_timer();
    s.timing_source = s.timer->name();
    s.notes.push_back(Note{"stand-in-timer",
                           "device timing by the stand-in timer (CPU clock spans through the device-timer interface)"});
  } else if (options.device_timing && cuda_device_present()) {
    TimerChoice choice = choose_device_timer(true, options.external_profiler, make_cupti_timer(), make_cuda_event_timer(),
                                             cupti_set_aside());
    s.timer = std::move(choice.timer);
    s.timing_source = choice.source;
    for (Note& n : choice.notes) s.notes.push_back(std::move(n));
  }
  s.active_timer.store(s.timer.get(), std::memory_order_release);
  s.generation.fetch_add(1, std::memory_order_acq_rel);  // every thread's buffers are emptied at its next record
  s.start_ns = now_ns();
}

// Under s.mu.
void install_callbacks(TracerState& s) {
  s.handle = at::addGlobalCallback(at::RecordFunctionCallback(&on_start, &on_end)
                                       .needsInputs(s.options.record_shapes)
                                       .needsOutputs(s.options.record_shapes)
                                       .needsIds(true)
                                       .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION,
                                                at::RecordScope::USER_SCOPE}));
  s.installed.fetch_add(1);
}

// Under s.mu.
void remove_callbacks(TracerState& s) {
  if (s.handle == 0) return;
  at::removeCallback(s.handle);
  s.handle = 0;
  s.installed.fetch_sub(1);
}

bool begin_armed_recording() {
  TracerState& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  if (s.active.load()) return true;  // another thread began it first
  if (!s.armed.load()) return false;
  prepare_recording(s);
  s.armed.store(false, std::memory_order_release);
  s.active.store(true, std::memory_order_release);
  return true;
}

void remove_callbacks_after_fork() {
  TracerState& s = state();
  // A parent's thread may have held the lock at the fork (it stays locked here): the callbacks then stay, inert.
  std::unique_lock<std::mutex> g(s.mu, std::try_to_lock);
  if (!s.forked.exchange(false) || !g.owns_lock()) return;
  remove_callbacks(s);
}

}  // namespace

void start_trace(const TraceOptions& options, TraceObserver* observer) {
  TracerState& s = state();
  TraceObserver* preempted = nullptr;
  {
    std::lock_guard<std::mutex> g(s.mu);
    if (s.active.load()) {
      GPUCAST_USER_ERROR("a gpucast trace is already running; stop it before starting another (traces do not nest)");
    }
    if (s.armed.load()) {  // a trace asked for now takes precedence over one waiting for its first op
      s.armed.store(false);
      preempted = s.observer.exchange(nullptr);
      remove_callbacks(s);
    }
    s.options = options;
    s.observer.store(observer, std::memory_order_release);
    prepare_recording(s);
    install_callbacks(s);
    s.active.store(true, std::memory_order_release);
  }
  if (preempted != nullptr) preempted->preempted();
}

void arm_trace(const TraceOptions& options, TraceObserver* observer) {
  TracerState& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  if (s.active.load() || s.armed.load()) {
    GPUCAST_USER_ERROR("a gpucast trace is already running or armed; stop it before arming another");
  }
  s.options = options;
  s.observer.store(observer, std::memory_order_release);
  install_callbacks(s);
  s.armed.store(true, std::memory_order_release);
}

void disarm_trace() {
  TracerState& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  if (!s.armed.load() || s.active.load()) return;
  s.armed.store(false);
  s.observer.store(nullptr);
  remove_callbacks(s);
}

void restart_recording() {
  TracerState& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  if (!s.active.load()) return;
  prepare_recording(s);
}

int64_t recorded_ops() { return state().op_count.load(std::memory_order_relaxed); }

void abandon_trace_after_fork() noexcept {
  TracerState& s = state();
  s.active.store(false);
  s.armed.store(false);
  s.observer.store(nullptr);
  s.active_timer.store(nullptr);
  s.forked.store(true);  // the callbacks go at the child's next op (remove_callbacks_after_fork)
}

namespace {

// What stop_recording takes from each thread: moved, not converted.
struct RawThreadRecords {
  uint64_t tid = 0;
  uint64_t slot = 0;
  ThreadRecords rec;
  std::vector<std::string> names;  // the thread's interned names at stop time
};

}  // namespace

struct RecordedTrace::Raw {
  std::mutex mu;
  bool assembled = false;
  Trace trace;
  std::vector<RawThreadRecords> threads;
  std::unordered_map<uint64_t, int64_t> device_ns;  // op key -> device time
  bool per_launch = false;  // device_ns holds what each op launched itself (DeviceTimer::per_launch)
  std::vector<std::string> module_names;
  AssemblyInput in;  // everything but the threads
};

RecordedTrace::RecordedTrace() : raw_(std::make_unique<Raw>()) {}
RecordedTrace::~RecordedTrace() = default;
RecordedTrace::RecordedTrace(RecordedTrace&&) noexcept = default;
RecordedTrace& RecordedTrace::operator=(RecordedTrace&&) noexcept = default;

namespace {

TensorMeta convert_tensor(const RawThreadRecords& ts, const RawValue& r) {
  TensorMeta m;
  if (r.dtype < 0) return m;
  const int64_t* d = ts.rec.dims.data() + r.dims;
  m.shape.assign(d, d + r.ndim);
  if (r.strided) m.strides.assign(d + r.ndim, d + 2 * r.ndim);
  m.dtype = std::string(c10::getDtypeNames(static_cast<c10::ScalarType>(r.dtype)).first);
  m.device = device_string(r.device_type, r.device_index);
  m.storage = r.storage;
  return m;
}

Value convert_scalar(const RawValue& r) {
  switch (r.scalar_type) {
    case Value::ScalarType::Int: return int_scalar(r.integer);
    case Value::ScalarType::Bool: return bool_scalar(r.integer != 0);
    case Value::ScalarType::Complex: return complex_scalar(r.real, r.imag);
    case Value::ScalarType::Float: break;
  }
  return float_scalar(r.real);
}

std::vector<Value> convert_values(const RawThreadRecords& ts, uint32_t first, uint32_t n) {
  std::vector<Value> out;
  out.reserve(n);
  size_t i = first;
  for (uint32_t k = 0; k < n && i < ts.rec.values.size(); ++k) {
    const RawValue& r = ts.rec.values[i++];
    Value v = r.kind == Value::Kind::Scalar ? convert_scalar(r) : Value{};
    v.kind = r.kind;
    if (r.kind == Value::Kind::Tensor) v.tensors.push_back(convert_tensor(ts, r));
    if (r.kind == Value::Kind::TensorList) {
      for (uint32_t e = 0; e < r.count && i < ts.rec.values.size(); ++e) v.tensors.push_back(convert_tensor(ts, ts.rec.values[i++]));
    }
    out.push_back(std::move(v));
  }
  return out;
}

RawThread convert_thread(const RawThreadRecords& ts, const std::vector<std::string>& module_names, int64_t end,
                         const std::unordered_map<uint64_t, int64_t>& device_ns, bool per_launch) {
  RawThread rt;
  rt.thread = ts.tid;
  rt.ops.reserve(ts.rec.ops.size());
  for (size_t i = 0; i < ts.rec.ops.size(); ++i) {
    const RawOp& r = ts.rec.ops[i];
    OpRecord op;
    if (!device_ns.empty() && r.device_timed) {  // timed ops without device work took 0; untimed ones stay -1
      auto it = device_ns.find((ts.slot << 32) | i);
      op.device_ns = it == device_ns.end() ? 0 : it->second;
    }
    op.name = ts.names[r.name];
    op.overload = ts.names[r.overload];
    op.scope = r.scope;
    op.phase = r.phase;
    op.thread = ts.tid;
    op.seq_nr = r.seq_nr;
    op.fwd_thread = r.fwd_thread;
    op.parent = r.parent;
    op.depth = r.depth;
    op.bwd_node = r.bwd_node;
    op.nested = r.nested;
    op.start_ns = r.start_ns;
    op.start_seq = r.start_seq;
    op.complete = r.complete;
    op.end_ns = r.complete ? r.end_ns : end;
    op.end_seq = r.complete ? r.end_seq : ~uint64_t{0};
    if (r.module >= 0 && static_cast<size_t>(r.module) < module_names.size()) op.module = module_names[r.module];
    op.inputs = convert_values(ts, r.inputs, r.n_inputs);
    op.outputs = convert_values(ts, r.outputs, r.n_outputs);
    rt.ops.push_back(std::move(op));
  }
  if (per_launch && !device_ns.empty()) {  // an op's device time with the work of the ops inside it
    std::vector<int32_t> parent(rt.ops.size());
    std::vector<int64_t> own(rt.ops.size());
    for (size_t i = 0; i < rt.ops.size(); ++i) {
      parent[i] = ts.rec.ops[i].parent;
      own[i] = rt.ops[i].device_ns;
    }
    const std::vector<int64_t> total = inclusive_device_times(parent, std::move(own));
    for (size_t i = 0; i < rt.ops.size(); ++i) rt.ops[i].device_ns = total[i];
  }
  rt.events.reserve(ts.rec.events.size());
  for (const RawEvent& r : ts.rec.events) {
    MemEvent e;
    e.seq = r.seq;
    e.ptr = r.ptr;
    e.bytes = r.bytes;
    e.block_bytes = r.block_bytes;
    e.device = device_string(r.device_type, r.device_index);
    e.thread = ts.tid;
    e.op = r.op;
    e.phase = r.phase;
    e.time_ns = r.time_ns;
    rt.events.push_back(std::move(e));
  }
  rt.tags = ts.rec.tags;
  return rt;
}

}  // namespace

const Trace& RecordedTrace::trace() {
  std::lock_guard<std::mutex> g(raw_->mu);
  if (!raw_->assembled) {
    AssemblyInput in = std::move(raw_->in);
    for (const RawThreadRecords& t : raw_->threads) {
      in.threads.push_back(convert_thread(t, raw_->module_names, in.end_ns, raw_->device_ns, raw_->per_launch));
    }
    raw_->threads.clear();
    raw_->trace = assemble_trace(std::move(in));
    raw_->assembled = true;
  }
  return raw_->trace;
}

namespace {

// For a trace that recorded meta storages: which of its operators run a Python meta kernel (the fold of
// trace_assembly.h), asked now; empty otherwise.
std::function<bool(const OpRecord&)> meta_kernels_of(const std::vector<RawThreadRecords>& threads) {
  std::set<std::pair<std::string, std::string>> ops;
  for (const RawThreadRecords& r : threads) {
    const bool meta = std::any_of(r.rec.events.begin(), r.rec.events.end(),
                                  [](const RawEvent& e) { return e.device_type == c10::DeviceType::Meta; });
    if (!meta) continue;
    auto name = [&](int32_t i) { return i >= 0 && static_cast<size_t>(i) < r.names.size() ? r.names[i] : std::string(); };
    for (const RawOp& op : r.rec.ops) ops.emplace(name(op.name), name(op.overload));
  }
  if (ops.empty()) return {};
  return detail::meta_kernel_in_python(ops);
}

}  // namespace

RecordedTrace stop_recording() {
  TracerState& s = state();
  std::unique_lock<std::mutex> g(s.mu);
  if (!s.active.load()) GPUCAST_USER_ERROR("no gpucast trace is running; start one with gpucast.trace()");
  s.active.store(false, std::memory_order_release);
  s.observer.store(nullptr, std::memory_order_release);
  remove_callbacks(s);
  const int64_t end = now_ns();
  const uint64_t gen = s.generation.load();

  RecordedTrace out;
  RecordedTrace::Raw& raw = *out.raw_;
  s.active_timer.store(nullptr, std::memory_order_release);
  if (s.timer) {
    raw.device_ns = device_time_by_op(s.timer->stop());
    raw.per_launch = s.timer->per_launch();
    if (std::string r = s.timer->report(); !r.empty()) s.notes.push_back(Note{"device-timer-report", std::move(r)});
    if (s.timer->attributed_none() && cupti_set_aside().empty()) {
      cupti_set_aside() = "CUPTI attributed no device work to ops in an earlier trace of this process";
      s.notes.push_back(Note{"cupti-attributed-none",
                             "CUPTI recorded device work but attributed none of it to ops: later traces in this "
                             "process time with CUDA events"});
    }
  }
  raw.in.timing_source = s.timing_source;
  raw.in.optimizer_state_from_phase = s.options.optimizer_state_from_phase;
  raw.in.timed_layers = s.timed.layers();
  raw.in.start_ns = s.start_ns;
  raw.in.end_ns = end;
  std::vector<std::shared_ptr<ThreadState>> threads = s.threads;
  raw.module_names = s.module_names;
  g.unlock();  // thread buffers are handed over under their own locks

  for (const auto& ts : threads) {
    std::lock_guard<SpinLock> tl(ts->mu);
    if (ts->generation != gen) continue;
    RawThreadRecords r;
    r.tid = ts->tid;
    r.slot = ts->slot;
    r.rec = ts->rec;  // a copy: the thread keeps its buffers for the next trace (reset below)
    r.names.assign(ts->names.begin(), ts->names.end());
    ts->reset(gen);
    raw.threads.push_back(std::move(r));
  }
  raw.in.meta_kernel_in_python = meta_kernels_of(raw.threads);
  g.lock();
  raw.in.baseline_blocks = std::move(s.baseline_blocks);
  raw.in.baseline = std::move(s.baseline);
  raw.in.notes = std::move(s.notes);
  raw.in.counters.dropped_ops = s.dropped_ops.load();
  raw.in.counters.dropped_events = s.dropped_events.load();
  raw.in.counters.callback_errors = s.callback_errors.load();
  raw.in.context = current_context();
  return out;
}

bool trace_active() { return state().active.load(); }
int installed_callbacks() { return state().installed.load(); }

int64_t module_code(const std::string& path) {
  TracerState& s = state();
  if (!s.active.load(std::memory_order_acquire)) return -1;
  std::lock_guard<std::mutex> g(s.mu);
  const bool timed = s.timed.layer_timed(path);
  auto it = s.module_ids.find(path);
  int32_t id;
  if (it == s.module_ids.end()) {
    id = static_cast<int32_t>(s.module_names.size());
    s.module_names.push_back(path);
    s.module_ids.emplace(path, id);
  } else {
    id = it->second;
  }
  return int64_t{id} * 2 + (timed ? 1 : 0);
}

void push_module_code(int64_t code) {
  if (code < 0 || !state().active.load(std::memory_order_acquire)) return;
  ThreadState* ts = thread_state();
  Locked lock(ts);
  if (lock) {
    ts->modules.push_back(static_cast<int32_t>(code / 2));
    ts->module_timed.push_back(static_cast<char>(code % 2));
  }
}

void push_module(const std::string& path) { push_module_code(module_code(path)); }

void pop_module() {
  if (!state().active.load(std::memory_order_acquire)) return;
  ThreadState* ts = thread_state();
  Locked lock(ts);
  if (lock && !ts->modules.empty()) {
    ts->modules.pop_back();
    ts->module_timed.pop_back();
  }
}

void tag_blocks(const std::vector<int64_t>& ptrs, const std::string& device, Category category) {
  TracerState& s = state();
  if (!s.active.load(std::memory_order_acquire)) return;
  ThreadState* ts = thread_state();
  Locked lock(ts);
  if (!lock) return;
  const uint64_t seq = s.seq.fetch_add(1, std::memory_order_relaxed);
  for (int64_t p : ptrs) {
    if (p != 0) ts->rec.tags.push_back(Tag{static_cast<uint64_t>(p), device, category, seq});
  }
}

}  // namespace gpucast
