// Test helper: the message of the UserError a call throws ("" when it throws none).
#pragma once

#include <functional>
#include <string>

#include "gpucast/error.h"

namespace gpucast::test_util {

inline std::string user_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

}  // namespace gpucast::test_util
