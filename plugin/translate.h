// translate.h (plugin, private): the one place where the core's errors become torch's. A UserError (bad input:
// configuration, files, arguments; its message may start with a stable code, gpucast/error.h) becomes ValueError
// through TORCH_CHECK_VALUE; anything else propagates as torch reports it (RuntimeError: gpucast's own fault).
#pragma once

#include <c10/util/Exception.h>

#include <stdexcept>

#include "gpucast/error.h"

namespace gpucast {

template <typename F>
auto translate(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const UserError& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  throw std::logic_error("unreachable");
}

}  // namespace gpucast
