// Which ops run a meta kernel written in Python, for folding meta traces (trace_assembly.h fold_meta_kernels).
//
// torch.library.Library records the Python file and line that created it as the registration's debug text
// (torch 2.14.1 torch/library.py:242-244, passed to torch._C._dispatch_library), and the operator's dump lists the
// kernel the dispatcher runs for each key first, as "Meta: registered at <file>:<line> :: ...", the kernels it
// overrode as "Meta (inactive): ..." (aten/src/ATen/core/dispatch/OperatorEntry.cpp, dumpState). A Meta kernel
// registered from a .py file is one of PyTorch's Python meta kernels (torch/_meta_registrations.py
// activate_meta(), or a decomposition it registers) or one a user registered from Python: either way the CPU and
// GPU do not run it. An operator whose CPU and CUDA run its CompositeExplicitAutograd kernel (no kernel of their
// own: aten::_safe_softmax) runs that composite on meta too while meta probes run (python/gpucast/_meta.py), and is
// not folded: its ops inside are the ones the CPU and GPU run.
//
// Asked when a trace stops (never inside a callback), once per operator the trace recorded.
#include <functional>
#include <memory>
#include <string>
#include <set>
#include <utility>

#include <ATen/core/dispatch/Dispatcher.h>

#include "gpucast/trace.h"
#include "memory_sink.h"

namespace gpucast::detail {
namespace {

// What the dispatcher holds for one operator, from its dump.
struct Kernels {
  bool python_meta = false;         // the Meta kernel it runs is registered from a .py file
  bool composite_explicit = false;  // a CompositeExplicitAutograd kernel
  bool backend = false;             // a CPU or CUDA kernel of its own
};

Kernels ask_dispatcher(const std::string& name, const std::string& overload) {
  Kernels k;
  const auto op = c10::Dispatcher::singleton().findOp(c10::OperatorName(name, overload));
  if (!op.has_value()) return k;  // a user scope or a backward node, not an operator
  std::string dump(1, '\n');  // each key is then found at a line's start
  dump += op->dumpState();
  auto line = [&](const std::string& key) -> std::string {
    const size_t at = dump.find("\n" + key);
    if (at == std::string::npos) return {};
    const size_t end = dump.find('\n', at + 1);
    return dump.substr(at + 1, end == std::string::npos ? std::string::npos : end - at - 1);
  };
  const std::string meta = line("Meta: registered at ");
  if (!meta.empty()) {
    const size_t from = std::string("Meta: registered at ").size();
    const size_t stop = meta.find(" :: ");
    const std::string where = meta.substr(from, stop == std::string::npos ? std::string::npos : stop - from);
    const std::string file = where.substr(0, where.rfind(':'));
    k.python_meta = file.size() >= 3 && file.compare(file.size() - 3, 3, ".py") == 0;
  }
  k.composite_explicit = !line("CompositeExplicitAutograd[alias]: ").empty();
  k.backend = !line("CPU: ").empty() || !line("CUDA: ").empty();
  return k;
}

Kernels kernels_of(const std::string& name, const std::string& overload) {
  try {
    return ask_dispatcher(name, overload);
  } catch (const std::exception&) {
    return Kernels{};  // left as it ran: the trace keeps what the meta kernel did
  }
}

// The one rule: a Python meta kernel standing in for the composite the CPU and CUDA run (ATen's operators: meta
// probes register composites for those only). Convolutions excepted:
// their composite picks a backend by device (aten/src/ATen/native/Convolution.cpp, select_conv_backend), and meta
// has none (it would call convolution_overrideable, which raises); the forecast's convolution rule
// (replace_conv_scratch) stands for what the backends allocate.
bool composite_on_meta(const Kernels& k, const std::string& name) {
  return k.python_meta && k.composite_explicit && !k.backend && name.rfind("aten::", 0) == 0 &&
         name.find("convolution") == std::string::npos;
}

// The scope python/gpucast/_meta.py opens around PyTorch's Python meta kernel where an op's composite could not run
// on meta (FALLBACK_SCOPE there): folded as that kernel would be.
constexpr const char* kMetaFallbackScope = "gpucast.meta_fallback";

}  // namespace

std::function<bool(const OpRecord&)> meta_kernel_in_python(
    const std::set<std::pair<std::string, std::string>>& ops) {
  // Asked now, when the trace stops, for the operators it recorded: registrations change (meta probes register
  // kernels for their duration) and the trace is assembled later.
  auto python = std::make_shared<std::set<std::pair<std::string, std::string>>>();
  for (const auto& [name, overload] : ops) {
    const Kernels k = kernels_of(name, overload);
    if (k.python_meta && !composite_on_meta(k, name)) python->emplace(name, overload);
  }
  return [python](const OpRecord& op) {
    return op.name == kMetaFallbackScope || python->count({op.name, op.overload}) != 0;
  };
}

}  // namespace gpucast::detail

namespace gpucast {

bool meta_runs_composite(const std::string& name, const std::string& overload) {
  return detail::composite_on_meta(detail::kernels_of(name, overload), name);
}

}  // namespace gpucast
