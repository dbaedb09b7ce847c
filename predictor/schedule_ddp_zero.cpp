// DDP and ZeRO-1/2, and a single rank (step_schedule.h): gradient accumulation's micro-batches, then the last one
// with its gradients reduced in buckets in backward order while backward goes on; the optimizer step; ZeRO's
// all-gather of the updated parameters.
#include <algorithm>
#include <vector>

#include "step_schedule.h"

namespace gpucast::detail {

void schedule_ddp_zero(StepSchedule& s) {
  StepTimeForecast& f = s.f;
  const ParallelConfig& P = s.P;
  const Topology& T = s.T;
  const int64_t mbs = s.mbs;
  const Link* dp_link = s.dp_link;
  const double bcast_ms = s.bcast_ms;
  const double other_mb = f.other_ms / s.m;  // the step's rest, before each micro-batch's forward
  // DDP and ZeRO-1/2: buckets in backward order, reduced while backward goes on.
  double t = bcast_ms;
  for (int64_t mb = 0; mb + 1 < mbs; ++mb) {
    t = s.span(kOtherSpan, "other", mb, 0, t, other_mb);
    t = s.run_pass(s.forward_layers, false, mb, 0, t, {});
    t = s.run_pass(s.backward_layers, true, mb, 0, t, {});
  }
  t = s.span(kOtherSpan, "other", mbs - 1, 0, t, other_mb);
  const double backward_start = s.run_pass(s.forward_layers, false, mbs - 1, 0, t, {});
  double prev_end = 0;
  BucketForecast cur;
  auto flush = [&](double ready) {
    if (cur.bytes == 0) return;
    cur.ready_ms = ready;
    f.buckets.push_back(cur);
    cur = BucketForecast{};
  };
  const bool reduce = P.dp > 1 && dp_link;
  auto bucket = [&](size_t i, double end) {
    const LayerForecast& l = f.per_layer[i];
    if (!reduce || l.grad_bytes == 0) return;
    cur.bytes += l.grad_bytes;
    const int64_t cap = f.buckets.empty() && !P.bucket_cap_given ? s.first_bucket_bytes : P.bucket_bytes;
    if (cur.bytes >= cap) flush(end);
  };
  const double backward_end = s.run_pass(s.backward_layers, true, mbs - 1, 0, backward_start, bucket);
  if (reduce) {
    flush(backward_end);
    for (size_t k = 0; k < f.buckets.size(); ++k) {
      BucketForecast& b = f.buckets[k];
      // The compute since the group's previous collective: the previous bucket's readiness; for the first, the
      // buffers' broadcast at the forward's start, else the previous step's last bucket (its optimizer step).
      b.idle_ms = std::max(0.0, k > 0 ? b.ready_ms - f.buckets[k - 1].ready_ms
                                      : b.ready_ms + (bcast_ms > 0 ? -bcast_ms : f.optimizer_ms));
      // Without overlap (the ranks' threads fill every core) the reductions run after backward, one by one. The
      // first waits for the last rank (ranks sharing cores drift apart over the compute since they last met); it
      // aligns them for the rest.
      const double lag = k > 0 ? 0.0 : s.drifts ? s.drift_rate * b.idle_ms : T.sync_wait_us / 1e3;
      b.start_ms = std::max((T.overlap ? b.ready_ms : backward_end) + lag, prev_end);
      b.end_ms = s.add_comm(s.reduce_kind(), static_cast<double>(b.bytes), b.start_ms,
                          s.reduce_us(static_cast<double>(b.bytes), b.idle_ms));
      prev_end = b.end_ms;
    }
  }
  const double exposed = std::max(0.0, prev_end - backward_end);
  f.exposed_comm_ms += exposed;
  // The step's end: the compute and the communication on its critical path.
  double t_end = s.span("optimizer step", "optimizer", mbs - 1, 0, backward_end + exposed, f.optimizer_ms);
  if (P.dp > 1 && dp_link && s.sharded && s.all_rank_grad > 0) {
    const double us = all_gather_us(static_cast<double>(s.all_rank_grad), P.dp, *dp_link);
    t_end = s.add_comm("dp_all_gather", static_cast<double>(s.all_rank_grad), t_end, us);
    f.exposed_comm_ms += us / 1e3;
  }
  f.step_ms = t_end;
}

}  // namespace gpucast::detail
