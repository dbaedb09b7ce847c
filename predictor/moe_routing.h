// moe_routing.h (internal): routed layers (mixture of experts) in a probe trace, and the tokens each of their
// experts receives at another size under a stated routing. Used by memory_forecast.cpp; not part of the public
// interface.
//
// A routed layer sends each token to k of its experts, chosen per token by a router, then runs each expert on the
// rows it was sent (transformers' Mixtral, Qwen2-MoE, OLMoE, PhiMoE: `torch.where(expert_mask[i])`, then
// `experts[i](hidden_states[top_x])`). The tokens an expert receives depend on the data, so the probes' sizes are
// not a line through the batch: they are a line through the expert's load. What the trace shows of it: sibling
// modules whose names differ in digits only ("experts.0", "experts.1"; "expert_0") run as consecutive calls inside
// one call of their parent, each on an input that differs from the others' in its leading dimension only, and not
// every load is the same (a dense ModuleList of layers gets the same input in every layer).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gpucast/trace.h"

namespace gpucast::detail {

struct RoutedUnit {
  std::string path;                     // the expert's module path
  uint64_t start_seq = 0, end_seq = 0;  // its first top-level op's start to its last one's end
  int64_t load = 0;                     // rows of its first op's first tensor input (every dimension but the last)
};

// One call of a routed layer (the experts' parent module), in the order the trace ran them.
struct RoutedCall {
  std::string container;                // module path the experts are children of ("...mlp.experts")
  uint64_t start_seq = 0, end_seq = 0;  // the parent's run of top-level forward ops
  int64_t tokens = 0;                   // rows entering the parent: its first op's first tensor input
  std::vector<RoutedUnit> units;        // the experts it ran, in order
  // Tokens sent to experts in all (the loads' sum) over the tokens entering: the router's k (at least 1).
  int64_t top_k() const;
};

std::vector<RoutedCall> find_routed_calls(const Trace& t);

// Where an op's memory belongs in the routed calls: the call (-1: none) and the experts whose loads may size it:
// the same expert twice for an op inside one, the experts before and after for an op between them (-1: none on
// that side). A backward op belongs where the forward op it differentiates ran.
struct RoutedPlace {
  int64_t call = -1;
  int64_t before = -1, after = -1;
};
RoutedPlace routed_place(const Trace& t, const std::vector<RoutedCall>& calls, int64_t op);

// Each expert's load when the call's tokens are scaled by `scale`: spread evenly over the experts the call ran
// (expected), or with each of the k most-loaded experts receiving `skew` of the tokens (at least the even share,
// at most every token), the rest spread evenly over the others (bound). The most-loaded experts are the first k
// (heavy_first) or the last k the call ran.
std::vector<int64_t> expected_loads(const RoutedCall& c, double scale);
std::vector<int64_t> skewed_loads(const RoutedCall& c, double scale, double skew, bool heavy_first);

}  // namespace gpucast::detail
