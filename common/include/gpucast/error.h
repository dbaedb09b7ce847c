// gpucast/error.h: the one way the core reports failure.
//
// Core code throws standard exceptions through GPUCAST_THROW; only the plugin layer turns them into
// TORCH_CHECK / TORCH_CHECK_VALUE. Messages say what was expected, what was given and what to do.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace gpucast {

// Bad input from the user: configuration, files, arguments.
class UserError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// `s` with every byte that is not part of well-formed UTF-8 written as \xNN: messages quote what they were given,
// and Python decodes every message as UTF-8. With `reversible`, each backslash is written \\ too, so that the bytes
// can be read back exactly (trace files: trace_json.cpp).
std::string valid_utf8(std::string_view s, bool reversible = false);
// The offset of the first byte of `s` that is not part of well-formed UTF-8, or npos.
size_t invalid_utf8_at(std::string_view s);

// An error a caller may act on carries a stable code (lower-case words joined by '-') at the start of its message:
// "[gpucast:<code>] ...". Python reads it (gpucast._errors.error_code) instead of the prose; docs/design.md lists
// the codes. `e` with `code` put before its message (an error of a lower function that this caller classifies),
// unless it already has one.
inline UserError with_code(const char* code, const UserError& e) {
  const std::string what = e.what();
  if (what.rfind("[gpucast:", 0) == 0) return e;
  return UserError(fmt::format("[gpucast:{}] {}", code, what));
}

// f(), where a UserError from it leaves with `code` unless it has one: a parser's entry point names the kind of its
// input once (e.g. "trace-file") for every error of the functions it calls.
template <typename F>
auto with_error_code(const char* code, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const UserError& e) {
    throw with_code(code, e);
  }
}

}  // namespace gpucast

#define GPUCAST_THROW(ExceptionType, ...) throw ExceptionType(fmt::format(__VA_ARGS__))
#define GPUCAST_USER_ERROR(...) GPUCAST_THROW(::gpucast::UserError, __VA_ARGS__)
// A UserError with a stable code (a string literal), e.g. GPUCAST_USER_ERROR_CODE("gpu-rates", "{}: ...", path).
#define GPUCAST_USER_ERROR_CODE(code, format, ...) \
  GPUCAST_THROW(::gpucast::UserError, "[gpucast:" code "] " format __VA_OPT__(, ) __VA_ARGS__)
