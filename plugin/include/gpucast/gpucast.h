// gpucast/gpucast.h: what a LibTorch C++ training program needs for gpucast's auto mode (GPUCAST_CONF).
//
// Link the program with libgpucast.so (CMake: target_link_libraries(train PRIVATE torch gpucast)); the library
// starts auto mode when it loads. Calling gpucast::library_path() (or any function below that is not a template)
// also keeps a linker that drops unreferenced libraries (--as-needed, the default on Debian and Ubuntu) from
// dropping it; otherwise link with -Wl,--no-as-needed.
//
// torch.optim's Python optimizers record a scope around zero_grad and step, where auto mode finds the iteration's
// start and end; LibTorch's C++ optimizers record none. Call their zero_grad and step through gpucast::zero_grad and
// gpucast::step, or mark the iteration's end with gpucast::mark_iteration_end(), or name a scope your loop records
// already with GPUCAST_CONF's iteration_scope key. Without gpucast loaded these only record scopes, which cost
// nothing when no profiler listens.
#pragma once

#include <ATen/record_function.h>

// Exported by libgpucast.so: the file it was loaded from.
extern "C" const char* gpucast_library_path();

namespace gpucast {

// Where libgpucast.so was loaded from (a reference that keeps the library linked).
inline const char* library_path() { return gpucast_library_path(); }

// opt.zero_grad() inside the scope torch.optim records for it: the iteration begins here.
template <class Optimizer>
void zero_grad(Optimizer& opt) {
  RECORD_USER_SCOPE("Optimizer.zero_grad#torch::optim.zero_grad");
  opt.zero_grad();
}

// opt.step() inside the scope torch.optim records for it: the iteration ends where the step that updates the last
// parameter holding a gradient ends. Returns what opt.step() returns (the loss, for closures).
template <class Optimizer>
auto step(Optimizer& opt) {
  RECORD_USER_SCOPE("Optimizer.step#torch::optim.step");
  return opt.step();
}

// The iteration ends here (a scope of its own, "gpucast.iteration_end", which torch.profiler shows too).
inline void mark_iteration_end() { RECORD_USER_SCOPE("gpucast.iteration_end"); }

}  // namespace gpucast
