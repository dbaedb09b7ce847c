// gpucast/error.h: the one way the core reports failure.
//
// Core code throws standard exceptions through GPUCAST_THROW; only the plugin layer turns them into
// TORCH_CHECK / TORCH_CHECK_VALUE. Messages say what was expected, what was given and what to do.
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace gpucast {

// Bad input from the user: configuration, files, arguments.
class UserError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

}  // namespace gpucast

#define GPUCAST_THROW(ExceptionType, ...) throw ExceptionType(fmt::format(__VA_ARGS__))
#define GPUCAST_USER_ERROR(...) GPUCAST_THROW(::gpucast::UserError, __VA_ARGS__)
