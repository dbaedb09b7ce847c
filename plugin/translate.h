// translate.h (plugin, private): the one place where the core's errors become torch's. A UserError (bad input:
// configuration, files, arguments) becomes ValueError through TORCH_CHECK_VALUE, its message starting with a stable
// code (gpucast/error.h): the code of the parser that found it, else the op's (`code`: the kind of input the op
// takes); anything else propagates as torch reports it (RuntimeError: gpucast's own fault).
#pragma once

#include <c10/util/Exception.h>

#include <stdexcept>

#include "gpucast/error.h"

namespace gpucast {

template <typename F>
auto translate(const char* code, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const UserError& e) {
    TORCH_CHECK_VALUE(false, with_code(code, e).what());
  }
  throw std::logic_error("unreachable");
}

}  // namespace gpucast
