// When the library loads (torch.ops.load_library, `import gpucast`, or a program linked with it): the first copy in
// a process registers the ops, installs the CPU allocator wrapper and starts auto mode from GPUCAST_CONF. A second
// copy (one from a build folder, one installed) registers nothing and says so: registering the same ops twice would
// throw inside a static initialiser, which aborts the process. Nothing here throws.
#include "library_init.h"

#include <dlfcn.h>
#include <unistd.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>

#include "auto_mode.h"
#include "gpucast/tracer.h"

namespace gpucast {
namespace {

// The path of the copy that registered torch.ops.gpucast before this one, if one did.
std::optional<std::string> registered_copy() {
  auto op = c10::Dispatcher::singleton().findSchema({"gpucast::library_path", ""});
  if (!op) return std::nullopt;
  try {
    return op->typed<std::string()>().call();
  } catch (...) {
    return std::string("(unknown)");
  }
}

bool load() noexcept {
  try {
    if (std::optional<std::string> other = registered_copy()) {
      say("gpucast: this copy of the library (" + this_library_path() + ") was not loaded: another copy is loaded "
          "from " + *other + "; the ops are that copy's. Load one copy per process (GPUCAST_LIBRARY names which).");
      return false;
    }
    // Installed at load so that frees of blocks allocated before a trace are seen with their size. Failing to
    // install only means no CPU memory events (a trace notes it).
    std::string why, meta_why;
    install_cpu_allocator_hook(&why);
    install_meta_allocator_hook(&meta_why);
    static torch::Library library(torch::Library::DEF, "gpucast", std::nullopt, __FILE__, __LINE__);
    register_ops(library);
    register_step_gnn_ops(library);
    register_workspace_ops(library);
    auto_mode::start_from_environment();
    return true;
  } catch (const std::exception& e) {
    say(std::string("gpucast: the library could not register its ops: ") + e.what());
    return false;
  } catch (...) {
    say("gpucast: the library could not register its ops");
    return false;
  }
}

const bool g_loaded = load();

}  // namespace

void say(const std::string& line) {
  const std::string text = line + "\n";
  ssize_t ignored = ::write(2, text.data(), text.size());
  (void)ignored;
}

std::string this_library_path() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&this_library_path), &info) != 0 && info.dli_fname != nullptr) {
    return info.dli_fname;
  }
  return "(unknown)";
}

}  // namespace gpucast

extern "C" __attribute__((visibility("default"))) const char* gpucast_library_path() {
  static const std::string* path = new std::string(gpucast::this_library_path());
  return path->c_str();
}
