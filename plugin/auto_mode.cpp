// Auto mode's run inside the training job (auto_mode.h): an observer of an armed trace (tracer.h) that finds where
// the first iteration begins and ends, tags what autograd says each block is, and reports the forecast.
//
// Invariants: the observer's methods run inside RecordFunction callbacks; they take no GIL, dispatch nothing and let
// no exception escape (an internal error is one warning and auto mode stops). The per-iteration bookkeeping
// (parameters, steps) is touched on the training thread only: the thread whose op began the iteration. State moves
// Off -> Armed -> Recording [-> Deferred] -> Done by compare-and-swap, so that one thread ends an iteration.
#include "auto_mode.h"

#include "autograd_tags.h"

#include "library_init.h"

#include <pthread.h>
#include <unistd.h>

#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>

#include <nlohmann/json.hpp>

#include "gpucast/config.h"
#include "gpucast/error.h"
#include "gpucast/files.h"
#include "gpucast/memory_timeline.h"
#include "gpucast/note_json.h"
#include "gpucast/trace_json.h"
#include "gpucast/tracer.h"

#ifdef GPUCAST_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#endif

namespace gpucast::auto_mode {
namespace {

using nlohmann::json;

enum class State : int { Off, Armed, Recording, Deferred, Done };

const char* state_name(State s) {
  switch (s) {
    case State::Off: return "off";
    case State::Armed: return "armed";
    case State::Recording: return "recording";
    case State::Deferred: return "deferred";
    case State::Done: return "done";
  }
  return "off";
}

// gpucast's own marker of an iteration's end (gpucast/gpucast.h); the optimizer's scopes are in autograd_tags.h.
constexpr const char* kIterationEndScope = "gpucast.iteration_end";
// Restarts after interrupted iterations before auto mode gives up. 16: a chosen bound.
constexpr int kMaxRestarts = 16;
// How often (in ops on the training thread) the limits are checked. 256: a chosen interval.
constexpr int64_t kLimitCheckInterval = 256;


int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

class AutoMode final : public TraceObserver {
 public:
  // --- configuration (under mu_) ------------------------------------------------------------------
  AutoSettings configure(const std::string& text, bool python) {
    AutoSettings s = read_auto_settings(text);  // throws before anything changes
    stop();
    std::lock_guard<std::mutex> g(mu_);
    settings_ = s;
    python_ = python;
    notes_.clear();
    restarts_ = 0;
    warned_log_ = false;
    if (!s.enabled) return s;
    check_log_path();
    static const int registered = pthread_atfork(nullptr, nullptr, &AutoMode::after_fork_child);
    (void)registered;
    arm();
    return s;
  }

  void stop() {
    const State was = state_.exchange(State::Off);
    if (was == State::Armed) disarm_trace();
    if (was == State::Recording || was == State::Deferred) discard_trace();
  }

  std::string poll(bool at_step) {
    const State s = state_.load();
    if (at_step && (s == State::Recording || s == State::Deferred) && on_training_thread()) {
      // The step's own ops have run (a post-hook runs inside its scope): the same decision as at the scope's end.
      if (tags_.all_stepped()) {
        finish(/*python_asked=*/true);
      } else {
        State rec = State::Recording;
        state_.compare_exchange_strong(rec, State::Deferred);
      }
    } else if (!at_step && s == State::Deferred && on_training_thread()) {
      finish(/*python_asked=*/true);
    }
    std::lock_guard<std::mutex> g(mu_);
    json out{{"state", state_name(state_.load())}, {"verdict", nullptr}};
    if (!python_verdict_.is_null()) {
      out["verdict"] = std::move(python_verdict_);
      python_verdict_ = nullptr;
    }
    return out.dump();
  }

  std::string status() {
    std::lock_guard<std::mutex> g(mu_);
    return json{{"state", state_name(state_.load())}, {"settings", auto_settings_json(settings_)}, {"notes", notes_},
                {"error", config_error_}, {"traced", traced_}}
        .dump();
  }

  void set_config_error(std::string e) {
    std::lock_guard<std::mutex> g(mu_);
    config_error_ = std::move(e);
    config_error_raised_ = false;
  }

  void raise_config_error() {
    std::string e;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (config_error_.empty() || config_error_raised_) return;
      config_error_raised_ = true;
      e = config_error_;
    }
    throw UserError(e);
  }

  // --- TraceObserver ------------------------------------------------------------------------------
  bool begins_at(const at::RecordFunction& fn) noexcept override {
    try {
      if (state_.load(std::memory_order_acquire) != State::Armed) return false;
      const char* name = fn.name();
      bool begins = false;
      if (fn.scope() == at::RecordScope::USER_SCOPE) {
        begins = name_starts_with(name, kZeroGradScope);
      } else if (fn.scope() == at::RecordScope::FUNCTION && c10::GradMode::is_enabled() &&
                 !name_starts_with(name, "gpucast::")) {
        for_each_tensor(fn, [&](const at::Tensor& t) { begins = begins || is_parameter(t); });
      }
      if (!begins) return false;
      State armed = State::Armed;
      if (!state_.compare_exchange_strong(armed, State::Recording)) return false;
      begin_iteration();
      return true;
    } catch (...) {
      return false;
    }
  }

  // A zero_grad scope after the forward began, before the iteration ended: the attempt before it was abandoned (an
  // exception raised in Python between ops, a caught KeyboardInterrupt, then the loop's next step), and the
  // iteration begins again here.
  bool restarts_at(const at::RecordFunction& fn) noexcept override {
    try {
      // Cheapest first: this runs before every recorded op.
      if (fn.scope() != at::RecordScope::USER_SCOPE || state_.load(std::memory_order_acquire) != State::Recording ||
          !on_training_thread() || !tags_.forward_seen() || step_depth_ > 0 ||
          !name_starts_with(fn.name(), kZeroGradScope)) {
        return false;
      }
      if (++restarts_ == 1) {
        add_note("interrupted-iteration",
                 "zero_grad ran again before the first iteration ended (an exception or an interrupt left it): that "
                 "iteration is not forecast from; the next complete one is");
      }
      reset_iteration();
      start_ns_ = now_ns();
      return true;
    } catch (...) {
      return false;
    }
  }

  void started(const at::RecordFunction& fn) noexcept override {
    try {
      const State s = state_.load(std::memory_order_acquire);
      if (s != State::Recording && s != State::Deferred) return;
      if (!on_training_thread()) {
        if (another_forward(fn)) give_up("concurrent-iterations",
                                         "another thread ran a forward pass with parameters while the first iteration "
                                         "was traced (two models trained at once?): no forecast, since which "
                                         "iteration it would describe is not known");
        return;
      }
      if (++ops_ % kLimitCheckInterval == 0 && over_limits()) return;
      if (fn.scope() == at::RecordScope::USER_SCOPE) {
        if (name_starts_with(fn.name(), kStepScope)) {
          ++step_depth_;
          tags_.tag_model_state();
        }
        return;
      }
      if (fn.scope() != at::RecordScope::FUNCTION) return;
      if (step_depth_ > 0) {  // the optimizer's ops: the parameters they read are the ones it steps
        tags_.note_step_op(fn);
        return;
      }
      if (!c10::GradMode::is_enabled()) return;
      const bool reads_parameter = tags_.note_parameters(fn);
      if (reads_parameter && s == State::Deferred) {  // the next forward: the iteration that waited has ended
        finish(/*python_asked=*/false);
        return;
      }
      tags_.note_forward(fn, reads_parameter);
    } catch (...) {
      internal_error("an op's start");
    }
  }

  void ended(const at::RecordFunction& fn, bool unwinding) noexcept override {
    try {
      const State s = state_.load(std::memory_order_acquire);
      if ((s != State::Recording && s != State::Deferred) || !on_training_thread()) return;
      if (unwinding) {
        interrupted(fn);
        return;
      }
      if (fn.scope() != at::RecordScope::USER_SCOPE) return;
      const char* name = fn.name();
      if (name_starts_with(name, kStepScope)) {
        if (step_depth_ > 0 && --step_depth_ == 0) {
          if (tags_.all_stepped()) {
            finish(/*python_asked=*/false);
          } else {
            State rec = State::Recording;
            state_.compare_exchange_strong(rec, State::Deferred);
          }
        }
      } else if (std::strcmp(name, kIterationEndScope) == 0 ||
                 (!settings_.iteration_scope.empty() && settings_.iteration_scope == name)) {
        finish(/*python_asked=*/false);
      }
    } catch (...) {
      internal_error("an op's end");
    }
  }

  void preempted() noexcept override {
    state_.store(State::Off);
    try {
      add_note("preempted", "a gpucast.trace() started before the first iteration began: auto mode is off");
    } catch (...) {
    }
  }

 private:
  static void after_fork_child() {
    // A forked child (a data-loading worker) is not the process that trains: auto mode is off there.
    instance().state_.store(State::Off);
    abandon_trace_after_fork();
  }

 public:
  static AutoMode& instance() {
    static auto* a = new AutoMode();  // never destroyed: callbacks may run during process exit
    return *a;
  }

 private:
  bool on_training_thread() const {
    return at::RecordFunction::currentThreadId() == training_thread_.load(std::memory_order_acquire);
  }

  TraceOptions trace_options() const {
    TraceOptions o;
    o.optimizer_state_from_phase = true;
    // Device timers are for step times, which auto mode does not forecast: the trace records memory and ops only.
    o.device_timing = false;
    return o;
  }

  // Under mu_.
  void arm() {
    reset_iteration();
    state_.store(State::Armed);
    try {
      arm_trace(trace_options(), this);
    } catch (const UserError& e) {
      state_.store(State::Off);
      notes_.push_back(Note{"not-armed", e.what()});
      say(fmt::format("gpucast: auto mode is off: {}", e.what()));
    }
  }

  // On the thread whose op began the iteration (begins_at).
  void begin_iteration() {
    reset_iteration();
    training_thread_.store(at::RecordFunction::currentThreadId(), std::memory_order_release);
    start_ns_ = now_ns();
  }

  void reset_iteration() {
    tags_.reset();
    step_depth_ = 0;
    ops_ = 0;
  }

  // A forward op on another thread: grad mode on and a parameter read (autograd's engine threads run with grad
  // mode off unless create_graph).
  static bool another_forward(const at::RecordFunction& fn) {
    if (fn.scope() != at::RecordScope::FUNCTION || !c10::GradMode::is_enabled()) return false;
    bool found = false;
    for_each_tensor(fn, [&](const at::Tensor& t) { found = found || is_parameter(t); });
    return found;
  }

  bool over_limits() {
    const double seconds = static_cast<double>(now_ns() - start_ns_) / 1e9;
    if (recorded_ops() < settings_.max_iteration_ops && seconds < static_cast<double>(settings_.max_iteration_s)) {
      return false;
    }
    give_up("no-iteration-end",
            fmt::format("the first iteration did not end within {} ops and {} s (max_iteration_ops, "
                        "max_iteration_s): tracing stopped, no forecast. A process that does not train (a "
                        "data-loading worker) never ends one; a loop whose optimizer records no step scope needs "
                        "gpucast::step(), gpucast.iteration_end or iteration_scope",
                        settings_.max_iteration_ops, settings_.max_iteration_s));
    return true;
  }

  // An exception left an op of the iteration: it is not forecast from. Recording starts afresh at the next one.
  void interrupted(const at::RecordFunction& fn) {
    State s = state_.load();
    if ((s != State::Recording && s != State::Deferred) || !state_.compare_exchange_strong(s, State::Off)) return;
    discard_trace();
    tags_.reset();
    if (++restarts_ > kMaxRestarts) {
      state_.store(State::Done);
      add_note("interrupted-iteration",
               fmt::format("{} iterations in a row were interrupted by exceptions: auto mode stopped", restarts_ - 1));
      TORCH_WARN("gpucast: auto mode stopped: ", restarts_ - 1,
                 " first iterations in a row were interrupted by exceptions; training goes on");
      return;
    }
    if (restarts_ == 1) {
      add_note("interrupted-iteration",
               fmt::format("an exception left '{}' during the first iteration: that iteration is not forecast "
                           "from; the next complete one is",
                           fn.name() == nullptr ? "" : fn.name()));
    }
    std::lock_guard<std::mutex> g(mu_);
    arm();
  }

  void give_up(const char* code, const std::string& why) {
    State s = state_.load();
    if ((s != State::Recording && s != State::Deferred) || !state_.compare_exchange_strong(s, State::Done)) return;
    discard_trace();
    add_note(code, why);
    TORCH_WARN("gpucast: auto mode: ", why);
  }

  void discard_trace() {
    try {
      if (trace_active()) (void)stop_recording();  // not assembled: dropping it costs little
    } catch (const UserError&) {
      // stopped by another thread in between
    }
  }

  void add_note(const char* code, std::string text) {
    std::lock_guard<std::mutex> g(mu_);
    notes_.push_back(Note{code, std::move(text)});
  }

  void internal_error(const char* where) noexcept {
    State s = state_.exchange(State::Done);
    if (s == State::Recording || s == State::Deferred) discard_trace();
    if (s == State::Done || s == State::Off) return;
    try {
      TORCH_WARN("gpucast: auto mode stopped after an internal error (at ", where, "); training goes on");
    } catch (...) {
    }
  }

  // The iteration has ended: stop, forecast, log, report. `python_asked`: the Python layer reports the verdict.
  void finish(bool python_asked) {
    State s = state_.load();
    if ((s != State::Recording && s != State::Deferred) || !state_.compare_exchange_strong(s, State::Done)) return;
    json verdict;
    try {
      tags_.tag_model_state();
      RecordedTrace recorded = stop_recording();
      const Trace& trace = recorded.trace();
      describe_traced(trace);
      save_traced(trace);
      verdict = judge(trace);
    } catch (const UserError& e) {  // what the forecast reads from the environment (PYTORCH_ALLOC_CONF, ...)
      discard_trace();
      TORCH_WARN("gpucast: auto mode stopped, no forecast: ", valid_utf8(e.what()), "; training goes on");
      return;
    } catch (const std::exception& e) {
      discard_trace();
      TORCH_WARN("gpucast: auto mode stopped after an internal error (", valid_utf8(e.what()),
                 "); training goes on");
      return;
    }
    tags_.reset();
    if (python_asked && python_) {
      std::lock_guard<std::mutex> g(mu_);
      python_verdict_ = std::move(verdict);
      return;
    }
    report(verdict);
  }

  // What status_json() says of the traced iteration: its ops, batch, and the bytes allocated in it by category.
  void describe_traced(const Trace& trace) {
    std::map<std::string, int64_t> by_category;
    for (const Allocation& a : trace.allocations) {
      if (a.alloc_event >= 0) by_category[std::string(to_string(a.category))] += a.block_bytes;
    }
    std::lock_guard<std::mutex> g(mu_);
    traced_ = json{{"ops", trace.ops.size()}, {"events", trace.events.size()}, {"batch", tags_.batch()},
                   {"allocated_by_category", by_category}};
  }

  // GPUCAST_TRACE (python -m gpucast run --save-trace): the traced iteration, as the forecast read it, written
  // atomically for `python -m gpucast report` before the forecast is judged (so a run that then stops keeps it). A
  // path that cannot be written is one warning; training goes on.
  void save_traced(const Trace& trace) {
    const char* path = std::getenv("GPUCAST_TRACE");
    if (path == nullptr || *path == '\0') return;
    try {
      write_file_atomically(path, [&](std::ostream& out) { write_trace_json(trace, out); });
    } catch (const std::exception& e) {
      TORCH_WARN("gpucast: the traced iteration was not saved to GPUCAST_TRACE: ", valid_utf8(e.what()));
    }
  }

  // Forecast, log record, and the verdict {"risk", "raise", "message", "warnings", "record"}.
  json judge(const Trace& trace) {
    std::string probe_device = "cpu";
    for (const auto& [device, baseline] : trace.baseline) {
      if (device.rfind("cuda", 0) == 0) probe_device = device;
    }
    for (const MemEvent& e : trace.events) {
      if (probe_device == "cpu" && e.device.rfind("cuda", 0) == 0) probe_device = e.device;
    }
    const AutoVerdict v = forecast_traced_step(trace, tags_.batch(), resolved_target(), settings_, probe_device,
                                               ForecastEnvironment::from_process());
    AutoRecordContext c;
    const TraceContext tc = current_context();
    c.context = json{{"gpucast_version", tc.gpucast_version}, {"torch_version", tc.torch_version},
                     {"device", tc.device}, {"build_type", tc.build_type}};
    c.time = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    c.rank = env_int("RANK");
    c.world_size = env_int("WORLD_SIZE");
    {
      std::lock_guard<std::mutex> g(mu_);
      c.notes = notes_;
    }
    json record = auto_record(v, c);
    append_log(record);
    return json{{"risk", v.risk}, {"raise", settings_.raise}, {"message", v.message},
                {"warnings", v.forecast.warnings}, {"record", std::move(record)}};
  }

  // Where the Python layer does not: a warning through c10's handler (under Python, attributed to the frame that
  // called the op whose scope ended the iteration), or the job stopped at the training thread's next allocation.
  void report(const json& verdict) {
    for (const json& w : verdict["warnings"]) {
      if (w.value("code", "") == "trace-capped") {
        TORCH_WARN("gpucast: the first iteration's trace reached its cap: the forecast is a lower bound (",
                   w.value("text", ""), ")");
      }
    }
    const std::string message = verdict["message"].get<std::string>();
    if (verdict["risk"].get<bool>()) {
      if (settings_.raise) {
        refuse_next_allocation(message);
      } else {
        TORCH_WARN(message);
      }
    } else if (settings_.verbose) {
      say(message);
    }
  }

  std::string resolved_target() const { return resolve_target(settings_.target); }

  static std::optional<int64_t> env_int(const char* name) {
    const char* v = std::getenv(name);
    if (v == nullptr) return std::nullopt;
    const std::optional<double> d = parse_number(v);
    if (!d || *d < 0 || *d > 1e9 || *d != static_cast<double>(static_cast<int64_t>(*d))) return std::nullopt;
    return static_cast<int64_t>(*d);
  }

  // Under mu_: a GPUCAST_LOG that cannot be written is said once, when the configuration is read.
  void check_log_path() {
    const char* path = std::getenv("GPUCAST_LOG");
    if (path == nullptr || *path == '\0') return;
    const std::string problem = append_line_problem(path);
    if (problem.empty()) return;
    warned_log_ = true;
    say(fmt::format("gpucast: GPUCAST_LOG='{}' cannot be written ({}): forecasts will not be logged",
                    valid_utf8(path), problem));
  }

  void append_log(const json& record) {
    const char* path = std::getenv("GPUCAST_LOG");
    if (path == nullptr || *path == '\0') return;
    try {
      append_line(path, record.dump());
    } catch (const UserError& e) {
      std::lock_guard<std::mutex> g(mu_);
      if (warned_log_) return;
      warned_log_ = true;
      TORCH_WARN("gpucast: the forecast was not logged: ", e.what());
    }
  }

  std::mutex mu_;  // settings, notes, the verdict for Python, the configuration error
  std::atomic<State> state_{State::Off};
  std::atomic<uint64_t> training_thread_{~uint64_t{0}};
  AutoSettings settings_;
  bool python_ = false;
  bool warned_log_ = false;
  std::vector<Note> notes_;
  json python_verdict_;
  json traced_;  // the traced iteration (describe_traced); null before
  std::string config_error_;
  bool config_error_raised_ = false;
  int restarts_ = 0;
  // The iteration's bookkeeping: training thread only.
  AutogradTags tags_;
  int step_depth_ = 0;
  int64_t ops_ = 0;
  int64_t start_ns_ = 0;
};

}  // namespace

std::string resolve_target(const std::string& target) {
  if (target != "auto") return target;
#ifdef GPUCAST_WITH_CUDA
  if (c10::cuda::device_count() > 0) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, c10::cuda::current_device()) == cudaSuccess) {
      return resolve_auto_target(prop.name, static_cast<int64_t>(prop.totalGlobalMem));
    }
  }
#endif
  return "cpu";
}

void start_from_environment() noexcept {
  try {
    const char* text = std::getenv("GPUCAST_CONF");
    bool enabled = false;
    if (text != nullptr && *text != '\0') {
      try {
        enabled = AutoMode::instance().configure(valid_utf8(text), /*python=*/false).enabled;
      } catch (const UserError& e) {
        AutoMode::instance().set_config_error(e.what());
        say(fmt::format("gpucast: auto mode is off: {}", e.what()));
        return;
      }
    }
    // GPUCAST_LOG receives auto mode's forecasts only: set alone, it would stay empty without a word.
    const char* log = std::getenv("GPUCAST_LOG");
    if (!enabled && log != nullptr && *log != '\0') {
      say(fmt::format("gpucast: GPUCAST_LOG='{}' is set but auto mode is off when the library loads (GPUCAST_CONF "
                      "has no enabled:True): only auto mode's forecasts are logged there",
                      valid_utf8(log)));
    }
  } catch (...) {
    say("gpucast: auto mode is off: an internal error while reading GPUCAST_CONF");
  }
}

void raise_config_error() { AutoMode::instance().raise_config_error(); }

AutoSettings configure(const std::string& text, bool python) {
  AutoSettings s = AutoMode::instance().configure(text, python);
  AutoMode::instance().set_config_error("");
  return s;
}

void stop() { AutoMode::instance().stop(); }

std::string poll(bool at_step) { return AutoMode::instance().poll(at_step); }

std::string status_json() { return AutoMode::instance().status(); }

}  // namespace gpucast::auto_mode
