// gpucast/checked.h: integer arithmetic on sizes that came from outside (a job description, a trace file). Values
// are bounded when parsed, but products and sums of bounded values can still pass int64_t; signed overflow is
// undefined behaviour, so every such sum and product goes through these, which throw a UserError instead.
#pragma once

#include <cstdint>
#include <string_view>

#include "gpucast/error.h"

namespace gpucast {

// a + b and a * b; `what` names the quantity in the error ("job: activation bytes").
inline int64_t checked_add(int64_t a, int64_t b, std::string_view what) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) {
    GPUCAST_USER_ERROR("{}: {} + {} overflows a 64-bit count: not a job a machine holds", what, a, b);
  }
  return r;
}
inline int64_t checked_mul(int64_t a, int64_t b, std::string_view what) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) {
    GPUCAST_USER_ERROR("{}: {} x {} overflows a 64-bit count: not a job a machine holds", what, a, b);
  }
  return r;
}

}  // namespace gpucast
