#include "gpucast/trace.h"

#include <algorithm>
#include <array>

#include "gpucast/error.h"

namespace gpucast {
namespace {

constexpr std::array<std::string_view, 3> kPhaseNames = {"forward", "backward", "optimizer"};
constexpr std::array<std::string_view, 3> kScopeNames = {"function", "backward_function", "user_scope"};
constexpr std::array<std::string_view, kNumCategories> kCategoryNames = {
    "parameter", "gradient", "optimizer_state", "activation", "temporary", "input", "other"};
constexpr std::array<std::string_view, 5> kKindNames = {"none", "tensor", "tensor_list", "scalar", "other"};
constexpr std::array<std::string_view, 4> kScalarTypeNames = {"float", "int", "bool", "complex"};

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
std::string_view to_string(Value::ScalarType t) { return kScalarTypeNames.at(static_cast<size_t>(t)); }
Value::ScalarType scalar_type_from_string(std::string_view s) {
  return parse_enum<Value::ScalarType>(kScalarTypeNames, s, "scalar type");
}

Value float_scalar(double x) {
  Value v;
  v.kind = Value::Kind::Scalar;
  v.scalar = x;
  return v;
}

Value int_scalar(int64_t x) {
  Value v = float_scalar(static_cast<double>(x));
  v.scalar_type = Value::ScalarType::Int;
  v.integer = x;
  return v;
}

Value bool_scalar(bool x) {
  Value v = int_scalar(x ? 1 : 0);
  v.scalar_type = Value::ScalarType::Bool;
  return v;
}

Value complex_scalar(double re, double im) {
  Value v = float_scalar(re);
  v.scalar_type = Value::ScalarType::Complex;
  v.imag = im;
  return v;
}

bool is_optimizer_step(const OpRecord& op) {
  return op.scope == Scope::UserScope && op.depth == 0 && op.name.rfind("Optimizer.step#", 0) == 0;
}

bool is_iteration_end_marker(const OpRecord& op) {
  return op.scope == Scope::UserScope && op.depth == 0 && op.name == kIterationEndMarker;
}

int64_t gradient_node(const Trace& t, const OpRecord& op) {
  const auto n_ops = static_cast<int64_t>(t.ops.size());
  auto linked = [&](int64_t n) {
    return n >= 0 && n < n_ops && t.ops[static_cast<size_t>(n)].scope == Scope::BackwardFunction &&
           t.ops[static_cast<size_t>(n)].fwd_op >= 0;
  };
  const int64_t own = op.scope == Scope::BackwardFunction ? op.id : op.bwd_node;
  if (linked(own) || op.phase != Phase::Backward) return own;
  const int64_t from = own >= 0 && own < op.id ? own : op.id;
  // 256: a chosen bound on the ops looked back over, not measured.
  for (int64_t i = from - 1, seen = 0; i >= 0 && seen < 256; --i) {
    const OpRecord& p = t.ops[static_cast<size_t>(i)];
    if (p.thread != op.thread) continue;
    if (p.phase != Phase::Backward) break;
    ++seen;
    const int64_t n = p.scope == Scope::BackwardFunction ? p.id : p.bwd_node;
    if (linked(n)) return n;
  }
  return own;
}

int64_t engine_work_node(const Trace& t, const OpRecord& op) {
  const auto n_ops = static_cast<int64_t>(t.ops.size());
  if (op.phase != Phase::Backward || op.scope != Scope::Function || op.parent < 0 || op.parent >= n_ops) return -1;
  const OpRecord& record = t.ops[static_cast<size_t>(op.parent)];
  if (record.scope != Scope::Function || record.name.rfind("autograd::engine::evaluate_function", 0) != 0) return -1;
  const int64_t node = gradient_node(t, op);
  if (node < 0 || node >= n_ops) return -1;
  const OpRecord& nd = t.ops[static_cast<size_t>(node)];
  return nd.scope == Scope::BackwardFunction && nd.parent == op.parent && nd.fwd_op >= 0 ? node : -1;
}

std::vector<uint64_t> iteration_ends(const Trace& t) {
  std::vector<uint64_t> markers;
  std::vector<std::pair<uint64_t, uint64_t>> steps;  // (end, start)
  std::vector<uint64_t> backward;                    // start_seq of backward ops
  for (const OpRecord& op : t.ops) {
    if (is_iteration_end_marker(op)) {
      markers.push_back(op.end_seq);
    } else if (is_optimizer_step(op)) {
      steps.emplace_back(op.end_seq, op.start_seq);
    } else if (op.phase == Phase::Backward) {
      backward.push_back(op.start_seq);
    }
  }
  if (!markers.empty()) {
    std::sort(markers.begin(), markers.end());
    return markers;
  }
  std::sort(steps.begin(), steps.end());
  std::sort(backward.begin(), backward.end());
  std::vector<uint64_t> ends;
  for (size_t k = 0; k < steps.size(); ++k) {
    if (k + 1 < steps.size()) {
      auto next = std::upper_bound(backward.begin(), backward.end(), steps[k].first);
      if (next == backward.end() || *next >= steps[k + 1].second) continue;  // the next step ends this iteration
    }
    ends.push_back(steps[k].first);
  }
  return ends;
}
}  // namespace gpucast
