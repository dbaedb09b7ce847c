// FSDP (step_schedule.h): each unit's parameters gathered before its compute (the next prefetched), its gradients
// reduce-scattered after its backward, on one communication stream; the optimizer step.
#include <algorithm>
#include <vector>

#include "step_schedule.h"

namespace gpucast::detail {

void schedule_fsdp(StepSchedule& s) {
  StepTimeForecast& f = s.f;
  const ParallelConfig& P = s.P;
  const Topology& T = s.T;
  const int64_t mbs = s.mbs;
  const Link* dp_link = s.dp_link;
  const FsdpUnits& U = s.units;
  const double other_mb = f.other_ms / s.m;  // the step's rest, before each micro-batch's forward
  // Units (ParallelConfig::fsdp_units): each given module path with the layers inside it (the innermost unit
  // holds a layer), the rest the root unit; without units every layer with parameters is one. A unit's bytes
  // are its layers' parameters (the probes hold them whole: its gather moves their full size). Each pass gathers
  // the next unit when the current one starts computing (prefetch), on one communication stream in issue order;
  // the root unit is gathered first in forward and, under fully_shard's default, kept for backward; a unit's
  // gradients are reduce-scattered once its last layer's backward is done, the root's once backward is. Every
  // micro-batch gathers again (gradient accumulation under no_sync keeps the gradients, not the parameters), the
  // last one reduce-scatters.
  double comm_free = 0, compute = 0;
  auto pass = [&](const std::vector<size_t>& layers, bool backward, int64_t mb, bool reduce) {
    std::vector<int64_t> order;  // the units this pass gathers, in issue order
    std::vector<char> listed(U.bytes.size(), 0);
    std::vector<int64_t> left(U.bytes.size(), 0);  // the unit's layers still to run in this pass
    // reshard_after_forward (ParallelConfig): False keeps every unit gathered for backward; not given keeps the root
    // (fully_shard's default); True or a number of ranks gathers them again (the latter within that many ranks).
    const int64_t reshard = P.reshard_after_forward;
    auto list = [&](int64_t u) {
      if (u < 0 || listed[static_cast<size_t>(u)] || U.bytes[static_cast<size_t>(u)] <= 0) return;
      if (backward && (reshard == 0 || (u == U.root && reshard < 0))) return;
      listed[static_cast<size_t>(u)] = 1;
      order.push_back(u);
    };
    if (!backward) list(U.root);
    for (size_t i : layers) {
      list(U.unit_of[i]);
      if (U.unit_of[i] >= 0) ++left[static_cast<size_t>(U.unit_of[i])];
    }
    std::vector<double> gathered(U.bytes.size(), -1.0);  // when the unit's gather ends (-1: not issued)
    size_t next = 0;
    auto gather = [&](double not_before) {
      const int64_t u = order[next++];
      const double bytes = U.bytes[static_cast<size_t>(u)];
      const int64_t ranks = backward && reshard >= 2 ? reshard : P.dp;
      comm_free = s.add_comm("fsdp_all_gather", bytes, std::max(comm_free, not_before),
                           all_gather_us(bytes, ranks, *dp_link));
      gathered[static_cast<size_t>(u)] = comm_free;
    };
    if (!order.empty()) gather(compute);
    auto scatter = [&](int64_t u) {
      const double bytes = U.bytes[static_cast<size_t>(u)];
      if (bytes <= 0) return;
      comm_free = s.add_comm("fsdp_reduce_scatter", bytes, std::max(comm_free, compute),
                           reduce_scatter_us(bytes, P.dp, *dp_link));
    };
    std::vector<char> started(U.bytes.size(), 0);
    for (size_t i : layers) {
      const int64_t u = U.unit_of[i];
      double ready = compute;
      if (u >= 0 && listed[static_cast<size_t>(u)]) {
        const bool first = !started[static_cast<size_t>(u)];
        started[static_cast<size_t>(u)] = 1;
        while (gathered[static_cast<size_t>(u)] < 0) gather(compute);  // the units listed before it, then its own
        ready = std::max(compute, gathered[static_cast<size_t>(u)]);
        if (first && next < order.size()) gather(ready);  // prefetch the next unit as this one starts
      }
      compute = s.run_pass({i}, backward, mb, 0, ready, {});
      if (backward && reduce && u >= 0 && u != U.root && --left[static_cast<size_t>(u)] == 0) scatter(u);
    }
    if (backward && reduce && U.root >= 0) scatter(U.root);  // the root's gradients once backward is done
  };
  for (int64_t mb = 0; mb < mbs; ++mb) {
    compute = s.span(kOtherSpan, "other", mb, 0, compute, other_mb);
    pass(s.forward_layers, false, mb, false);
    pass(s.backward_layers, true, mb, mb + 1 == mbs);
  }
  const double compute_only = f.other_ms + f.forward_ms + f.backward_ms + f.tp_comm_ms;  // every micro-batch
  double t_end = std::max(compute, comm_free);  // the compute's end and the collectives on its critical path
  if (!T.overlap) {  // the collectives take the cores from the compute: their time adds
    double fsdp_comm = 0;
    for (const CommForecast& c : f.comm) {
      if (c.kind.rfind("fsdp_", 0) == 0) fsdp_comm += c.end_ms - c.start_ms;
    }
    t_end = compute_only + fsdp_comm;
  }
  f.exposed_comm_ms += t_end - compute_only;
  s.span("optimizer step", "optimizer", mbs - 1, 0, t_end, f.optimizer_ms);
  f.step_ms = t_end + f.optimizer_ms;
}

}  // namespace gpucast::detail
