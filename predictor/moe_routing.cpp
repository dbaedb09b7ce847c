#include "moe_routing.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <map>
#include <string_view>

namespace gpucast::detail {

namespace {

// The first defined tensor among an op's inputs (nullptr: none).
const TensorMeta* first_tensor(const OpRecord& op) {
  for (const Value& v : op.inputs) {
    if (v.kind == Value::Kind::Tensor && !v.tensors.empty() && !v.tensors.front().dtype.empty()) {
      return &v.tensors.front();
    }
  }
  return nullptr;
}

// Rows of a tensor: the product of every dimension but the last (a vector: its length; a scalar: -1, no rows).
// Saturates rather than overflow (a shape the tracer recorded is the tensor's, but a trace file is input).
int64_t rows_of(const TensorMeta& m) {
  if (m.shape.empty()) return -1;
  if (m.shape.size() == 1) return m.shape.front();
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < m.shape.size(); ++i) {
    const int64_t d = m.shape[i];
    if (d < 0) return -1;
    if (d != 0 && rows > std::numeric_limits<int64_t>::max() / d) return std::numeric_limits<int64_t>::max();
    rows *= d;
  }
  return rows;
}

// Whether `path` is `prefix` or inside it (an empty prefix holds every path).
bool under(const std::string& path, const std::string& prefix) {
  if (prefix.empty()) return true;
  return path.compare(0, prefix.size(), prefix) == 0 && (path.size() == prefix.size() || path[prefix.size()] == '.');
}

struct UnitName {
  std::string_view container, unit;  // "a.experts" and "a.experts.3", views into the path
};

// Each component of a module path that holds a digit names a unit of a possible container: the path up to it.
std::vector<UnitName> unit_names(std::string_view path) {
  std::vector<UnitName> out;
  size_t begin = 0;
  while (begin < path.size()) {
    size_t end = path.find('.', begin);
    if (end == std::string::npos) end = path.size();
    const bool digit = std::any_of(path.begin() + static_cast<std::ptrdiff_t>(begin),
                                   path.begin() + static_cast<std::ptrdiff_t>(end),
                                   [](char ch) { return std::isdigit(static_cast<unsigned char>(ch)) != 0; });
    if (digit && begin > 0) out.push_back(UnitName{path.substr(0, begin - 1), path.substr(0, end)});
    if (end == path.size()) break;
    begin = end + 1;
  }
  return out;
}

// The last component with its digits removed: "experts.3" -> "experts.", "expert_12" -> "expert_".
std::string stem(const std::string& unit, const std::string& container) {
  std::string s = unit.substr(container.size());
  s.erase(std::remove_if(s.begin(), s.end(), [](char ch) { return std::isdigit(static_cast<unsigned char>(ch)) != 0; }),
          s.end());
  return s;
}

// Whether the call's experts are routed: two or more, one name up to digits, the same first op on tensors of one
// dtype whose shapes differ in their leading dimension only (rows of features: a token-pruning transformer's blocks
// differ in a middle dimension, [B, N_i, D], and are no routed layer), not every load the same, and none above the
// tokens entering.
bool routed(const RoutedCall& c, const std::vector<const OpRecord*>& first_ops) {
  if (c.units.size() < 2 || c.tokens <= 0) return false;
  const TensorMeta* ref = first_tensor(*first_ops.front());
  if (ref == nullptr || ref->shape.size() < 2) return false;
  bool differ = false;
  for (size_t u = 0; u < c.units.size(); ++u) {
    const TensorMeta* m = first_tensor(*first_ops[u]);
    if (m == nullptr || first_ops[u]->name != first_ops.front()->name ||
        stem(c.units[u].path, c.container) != stem(c.units.front().path, c.container) ||
        m->shape.size() != ref->shape.size() || !std::equal(m->shape.begin() + 1, m->shape.end(), ref->shape.begin() + 1) ||
        m->dtype != ref->dtype || c.units[u].load < 0 || c.units[u].load > c.tokens) {
      return false;
    }
    differ = differ || c.units[u].load != c.units.front().load;
  }
  return differ;
}

}  // namespace

int64_t RoutedCall::top_k() const {
  double sent = 0;  // a double: loads read from a file may be as large as int64 holds
  for (const RoutedUnit& u : units) sent += static_cast<double>(u.load);
  if (tokens <= 0) return 1;
  const double k = sent / static_cast<double>(tokens);
  return k >= static_cast<double>(units.size()) ? static_cast<int64_t>(units.size()) : std::max<int64_t>(1, std::llround(k));
}

std::vector<RoutedCall> find_routed_calls(const Trace& t) {
  // The top-level ops in start order (the ops are held in start order), and per possible container the positions
  // among them of the forward ops run inside one of its units.
  std::vector<const OpRecord*> top;
  // Views into the ops' module paths, which outlive this function's use of them.
  std::map<std::string_view, std::vector<std::pair<size_t, std::string_view>>> members;  // container -> (position, unit)
  for (const OpRecord& op : t.ops) {
    if (op.parent >= 0 || !op.complete) continue;
    if (op.phase == Phase::Forward) {
      for (const UnitName& n : unit_names(op.module)) members[n.container].emplace_back(top.size(), n.unit);
    }
    top.push_back(&op);
  }
  std::vector<RoutedCall> calls;
  for (const auto& [container, list] : members) {
    const size_t dot = container.rfind('.');
    const std::string parent(dot == std::string_view::npos ? std::string_view() : container.substr(0, dot));
    // A backward node carries its forward op's module: only forward ops extend a call.
    auto in_parent = [&](size_t i) { return top[i]->phase == Phase::Forward && under(top[i]->module, parent); };
    size_t k = 0;
    while (k < list.size()) {
      // One call of the parent: the container's ops with nothing outside the parent between them.
      size_t last = k;
      while (last + 1 < list.size()) {
        bool joined = true;
        for (size_t i = list[last].first + 1; i < list[last + 1].first && joined; ++i) joined = in_parent(i);
        if (!joined) break;
        ++last;
      }
      size_t begin = list[k].first, end = list[last].first;
      while (begin > 0 && in_parent(begin - 1)) --begin;
      while (end + 1 < top.size() && in_parent(end + 1)) ++end;
      RoutedCall call;
      call.container = std::string(container);
      call.start_seq = top[begin]->start_seq;
      call.end_seq = top[end]->end_seq;
      const TensorMeta* entering = first_tensor(*top[begin]);
      call.tokens = entering != nullptr ? rows_of(*entering) : -1;
      std::vector<const OpRecord*> first_ops;
      for (size_t j = k; j <= last; ++j) {
        const OpRecord& op = *top[list[j].first];
        if (j == k || list[j].second != list[j - 1].second) {
          const TensorMeta* m = first_tensor(op);
          call.units.push_back(RoutedUnit{std::string(list[j].second), op.start_seq, op.end_seq, m != nullptr ? rows_of(*m) : -1});
          first_ops.push_back(&op);
        }
        call.units.back().end_seq = op.end_seq;
      }
      if (routed(call, first_ops)) calls.push_back(std::move(call));
      k = last + 1;
    }
  }
  std::sort(calls.begin(), calls.end(), [](const RoutedCall& a, const RoutedCall& b) { return a.start_seq < b.start_seq; });
  return calls;
}

RoutedPlace routed_place(const Trace& t, const std::vector<RoutedCall>& calls, int64_t op) {
  const auto n = static_cast<int64_t>(t.ops.size());
  if (calls.empty() || op < 0 || op >= n) return {};
  if (t.ops[static_cast<size_t>(op)].phase != Phase::Forward) {
    op = t.ops[static_cast<size_t>(op)].fwd_op;  // inherited inside a backward node
    if (op < 0 || op >= n || t.ops[static_cast<size_t>(op)].phase != Phase::Forward) return {};
  }
  // Up to the top-level op (64: a chosen guard, deeper than any nesting a trace holds; a malformed link ends it).
  for (int depth = 0; depth < 64; ++depth) {
    const int64_t parent = t.ops[static_cast<size_t>(op)].parent;
    if (parent < 0 || parent >= n || parent == op) break;
    op = parent;
  }
  const uint64_t seq = t.ops[static_cast<size_t>(op)].start_seq;
  auto it = std::upper_bound(calls.begin(), calls.end(), seq,
                             [](uint64_t s, const RoutedCall& c) { return s < c.start_seq; });
  if (it == calls.begin()) return {};
  --it;
  if (seq > it->end_seq) return {};
  RoutedPlace place;
  place.call = it - calls.begin();
  for (size_t u = 0; u < it->units.size(); ++u) {
    const RoutedUnit& unit = it->units[u];
    if (seq >= unit.start_seq && seq <= unit.end_seq) {
      place.before = place.after = static_cast<int64_t>(u);
      return place;
    }
    if (unit.end_seq < seq) place.before = static_cast<int64_t>(u);
    if (unit.start_seq > seq && place.after < 0) place.after = static_cast<int64_t>(u);
  }
  return place;
}

std::vector<int64_t> expected_loads(const RoutedCall& c, double scale) {
  double sent = 0;
  for (const RoutedUnit& u : c.units) sent += static_cast<double>(u.load);
  const auto h = static_cast<double>(c.units.size());
  return std::vector<int64_t>(c.units.size(), std::llround(sent * scale / h));
}

std::vector<int64_t> skewed_loads(const RoutedCall& c, double scale, double skew, bool heavy_first) {
  double sent = 0;
  for (const RoutedUnit& u : c.units) sent += static_cast<double>(u.load);
  sent *= scale;
  const double tokens = static_cast<double>(c.tokens) * scale;
  const size_t h = c.units.size();
  const size_t k = std::min<size_t>(h, static_cast<size_t>(c.top_k()));
  const double even = sent / static_cast<double>(h);
  // Each heavy expert: `skew` of the tokens, at least the even share, at most every token and no more than the k
  // of them can be sent in all.
  const double heavy = std::min({std::max(skew * tokens, even), tokens, sent / static_cast<double>(k)});
  const double rest = h > k ? std::min(tokens, (sent - heavy * static_cast<double>(k)) / static_cast<double>(h - k)) : 0;
  std::vector<int64_t> loads(h, std::llround(std::max(0.0, rest)));
  for (size_t i = 0; i < k; ++i) loads[heavy_first ? i : h - 1 - i] = std::llround(heavy);
  return loads;
}

}  // namespace gpucast::detail
