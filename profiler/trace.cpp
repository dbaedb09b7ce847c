#include "gpucast/trace.h"

#include <array>

#include "gpucast/error.h"

namespace gpucast {
namespace {

constexpr std::array<std::string_view, 3> kPhaseNames = {"forward", "backward", "optimizer"};
constexpr std::array<std::string_view, 3> kScopeNames = {"function", "backward_function", "user_scope"};
constexpr std::array<std::string_view, kNumCategories> kCategoryNames = {
    "parameter", "gradient", "optimizer_state", "activation", "temporary", "input", "other"};
constexpr std::array<std::string_view, 5> kKindNames = {"none", "tensor", "tensor_list", "scalar", "other"};

template <typename Enum, size_t N>
Enum parse_enum(const std::array<std::string_view, N>& names, std::string_view s, std::string_view what) {
  for (size_t i = 0; i < N; ++i) {
    if (names[i] == s) return static_cast<Enum>(i);
  }
  std::string expected;
  for (size_t i = 0; i < N; ++i) expected += fmt::format("{}'{}'", i ? ", " : "", names[i]);
  GPUCAST_USER_ERROR("unknown {} '{}'; expected one of {}", what, s, expected);
}

}  // namespace

std::string_view to_string(Phase p) { return kPhaseNames.at(static_cast<size_t>(p)); }
std::string_view to_string(Scope s) { return kScopeNames.at(static_cast<size_t>(s)); }
std::string_view to_string(Category c) { return kCategoryNames.at(static_cast<size_t>(c)); }
std::string_view to_string(Value::Kind k) { return kKindNames.at(static_cast<size_t>(k)); }

Phase phase_from_string(std::string_view s) { return parse_enum<Phase>(kPhaseNames, s, "phase"); }
Scope scope_from_string(std::string_view s) { return parse_enum<Scope>(kScopeNames, s, "scope"); }
Category category_from_string(std::string_view s) {
  return parse_enum<Category>(kCategoryNames, s, "category");
}
Value::Kind value_kind_from_string(std::string_view s) {
  return parse_enum<Value::Kind>(kKindNames, s, "value kind");
}

}  // namespace gpucast
