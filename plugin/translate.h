// translate.h (plugin, private): the one place where the core's errors become torch's. A UserError (bad input:
// configuration, files, arguments) becomes ValueError through TORCH_CHECK_VALUE, its message starting with a stable
// code (gpucast/error.h): the code of the parser that found it, else the op's (`code`: the kind of input the op
// takes); anything else propagates as torch reports it (RuntimeError: gpucast's own fault).
#pragma once

#include <c10/util/Exception.h>

#include <stdexcept>

#include "auto_mode.h"
#include "gpucast/error.h"

namespace gpucast {

template <typename F>
auto translate(const char* code, F&& f) -> decltype(f()) {
  try {
    auto_mode::raise_config_error();  // a GPUCAST_CONF the library could not read when it loaded: once
    return f();
  } catch (const UserError& e) {
    TORCH_CHECK_VALUE(false, valid_utf8(with_code(code, e).what()));
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    // gpucast's own fault (a library's exception that no parser turned into a UserError): RuntimeError, its
    // message made valid UTF-8 so that Python can show it.
    TORCH_CHECK(false, "gpucast internal error: ", valid_utf8(e.what()));
  }
  throw std::logic_error("unreachable");
}

}  // namespace gpucast
