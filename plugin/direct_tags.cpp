// The observer of a direct trace (direct_tags.h).
//
// Invariants: as every TraceObserver, its methods run inside RecordFunction callbacks, dispatch nothing, take no
// GIL and let no exception escape; the bookkeeping is touched by the thread that started the trace only (other
// threads' ops are recorded, not tagged); an internal error stops the tagging, never the trace.
#include "direct_tags.h"

#include <atomic>
#include <cstdint>

#include <ATen/record_function.h>
#include <c10/core/GradMode.h>

#include "autograd_tags.h"

namespace gpucast {
namespace {

class DirectTags final : public TraceObserver {
 public:
  void start() {
    tags_.reset();
    step_depth_ = 0;
    failed_ = false;
    thread_.store(at::RecordFunction::currentThreadId(), std::memory_order_release);
  }

  void finish() noexcept {
    try {
      if (on_thread() && !failed_) tags_.tag_model_state();
    } catch (...) {
    }
    thread_.store(~uint64_t{0}, std::memory_order_release);
  }

  bool begins_at(const at::RecordFunction&) noexcept override { return false; }
  bool restarts_at(const at::RecordFunction&) noexcept override { return false; }
  void preempted() noexcept override {}

  void started(const at::RecordFunction& fn) noexcept override {
    if (!on_thread() || failed_) return;
    try {
      if (fn.scope() == at::RecordScope::USER_SCOPE) {
        if (is_step(fn)) {
          ++step_depth_;
          tags_.tag_model_state();
        }
      } else if (fn.scope() == at::RecordScope::FUNCTION) {
        if (step_depth_ > 0) {
          tags_.note_step_op(fn);
        } else if (c10::GradMode::is_enabled()) {
          tags_.note_forward(fn, tags_.note_parameters(fn));
        }
      }
    } catch (...) {
      failed_ = true;
    }
  }

  void ended(const at::RecordFunction& fn, bool /*unwinding*/) noexcept override {
    if (!on_thread() || failed_ || fn.scope() != at::RecordScope::USER_SCOPE || !is_step(fn)) return;
    // The step is over: the next forward is the next iteration's, and its inputs are tagged again.
    if (step_depth_ > 0 && --step_depth_ == 0) tags_.expect_inputs();
  }

 private:
  bool on_thread() const {
    return at::RecordFunction::currentThreadId() == thread_.load(std::memory_order_acquire);
  }
  static bool is_step(const at::RecordFunction& fn) { return name_starts_with(fn.name(), kStepScope); }

  AutogradTags tags_;
  int step_depth_ = 0;
  bool failed_ = false;
  std::atomic<uint64_t> thread_{~uint64_t{0}};
};

DirectTags& instance() {
  static auto* d = new DirectTags();  // never destroyed: callbacks may run during process exit
  return *d;
}

}  // namespace

void start_trace_with_direct_tags(const TraceOptions& options) {
  start_trace(options, &instance());
  // After start_trace: until now other threads' callbacks saw no training thread; this thread runs no op between.
  instance().start();
}

void finish_direct_tags() noexcept { instance().finish(); }

}  // namespace gpucast
