// 1F1B pipeline parallelism (step_schedule.h): the stages' passes in 1F1B order with their sends, the data-parallel
// reduction after the pipeline drains, the optimizer step.
#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <utility>
#include <vector>

#include "gpucast/error.h"
#include "step_schedule.h"

namespace gpucast::detail {
namespace {

// The step's rest (Python between the ops, zero_grad, a host's launches beyond the kernels) is each rank's for its
// own modules: a stage's share by the recorded ops of its layers (without op counts, by its compute), run after each
// of its passes, a forward's and a backward's by their ops.
struct StageRest {
  std::vector<double> fw, bw;  // per stage, per pass
};

StageRest stage_rests(const StepSchedule& sc) {
  const StepTimeForecast& f = sc.f;
  const ParallelConfig& P = sc.P;
  const IterationTiming& ref = sc.ref;
  const std::vector<double>& stage_fw = sc.stage_fw;
  const std::vector<double>& stage_bw = sc.stage_bw;
  const int64_t mbs = sc.mbs;
  std::vector<double> stage_ops(P.pp, 0.0), stage_fw_ops(P.pp, 0.0);
  for (size_t i = 0; i < f.per_layer.size(); ++i) {
    const LayerTiming& l = ref.layers[i];
    stage_ops[f.per_layer[i].stage] += static_cast<double>(l.forward_ops_all + l.backward_ops_all);
    stage_fw_ops[f.per_layer[i].stage] += static_cast<double>(l.forward_ops_all);
  }
  const double all_ops = std::accumulate(stage_ops.begin(), stage_ops.end(), 0.0);
  double all_compute = 0;
  for (int64_t s = 0; s < P.pp; ++s) all_compute += stage_fw[s] + stage_bw[s];
  StageRest out{std::vector<double>(P.pp, 0.0), std::vector<double>(P.pp, 0.0)};
  for (int64_t s = 0; s < P.pp; ++s) {
    const double share = all_ops > 0         ? stage_ops[s] / all_ops
                         : all_compute > 0 ? (stage_fw[s] + stage_bw[s]) / all_compute
                                           : 1.0 / static_cast<double>(P.pp);
    const double fw_part = stage_ops[s] > 0 ? stage_fw_ops[s] / stage_ops[s] : 0.5;
    out.fw[s] = f.other_ms * share * fw_part / static_cast<double>(mbs);
    out.bw[s] = f.other_ms * share * (1.0 - fw_part) / static_cast<double>(mbs);
  }
  return out;
}

// 1F1B's order on every stage: stage s runs min(pp - s - 1, m) forwards, then one forward and one backward in turn,
// then the remaining backwards. Per stage: (backward, micro-batch) in order.
std::vector<std::vector<std::pair<bool, int64_t>>> one_f_one_b(int64_t pp, int64_t mbs) {
  std::vector<std::vector<std::pair<bool, int64_t>>> order(pp);
  for (int64_t s = 0; s < pp; ++s) {
    const int64_t warm = std::min<int64_t>(pp - s - 1, mbs);
    int64_t fw = 0, bw = 0;
    for (; fw < warm; ++fw) order[s].emplace_back(false, fw);
    while (bw < mbs) {
      if (fw < mbs) order[s].emplace_back(false, fw++);
      order[s].emplace_back(true, bw++);
    }
  }
  return order;
}

// The step after the pipeline drains (t_end: the last stage's end): the slowest stage's rank (its compute, its
// tensor-parallel all-reduces and its sends), the data-parallel reduction, the optimizer step, ZeRO's all-gather;
// the bubble is what that rank waits for beside its own work.
void finish(StepSchedule& sc, const StageRest& rest, const std::vector<double>& hop_ms, double t_end) {
  StepTimeForecast& f = sc.f;
  const ParallelConfig& P = sc.P;
  const double m = sc.m;
  const int64_t mbs = sc.mbs;
  const Link* dp_link = sc.dp_link;
  const std::vector<double>& stage_fw = sc.stage_fw;
  const std::vector<double>& stage_bw = sc.stage_bw;
  const std::vector<double>& rest_fw = rest.fw;
  const std::vector<double>& rest_bw = rest.bw;
  const std::vector<double>& tp_fw_ms = sc.tp_fw_ms;
  const std::vector<double>& tp_bw_ms = sc.tp_bw_ms;
  const int64_t rank_grad = sc.rank_grad;
  // The slowest stage's rank: its compute, its tensor-parallel all-reduces and its sends.
  int64_t slow = 0;
  auto stage_work = [&](int64_t s) { return stage_fw[s] + stage_bw[s] + rest_fw[s] + rest_bw[s]; };
  for (int64_t s = 1; s < P.pp; ++s) {
    if (stage_work(s) > stage_work(slow)) slow = s;
  }
  double slow_tp = 0;
  for (size_t i : sc.forward_layers) {
    if (f.per_layer[i].stage == slow) slow_tp += tp_fw_ms[i] + tp_bw_ms[i];
  }
  f.tp_comm_ms = m * slow_tp;
  for (int64_t s = 0; s < P.pp; ++s) {
    const double sends = m * ((s + 1 < P.pp ? hop_ms[s] : 0.0) + (s > 0 ? hop_ms[s - 1] : 0.0));
    f.pp_comm_ms = std::max(f.pp_comm_ms, sends);
  }
  f.exposed_comm_ms += f.tp_comm_ms;
  if (dp_link && rank_grad > 0) {
    const double us = sc.reduce_us(static_cast<double>(rank_grad));
    t_end = sc.add_comm(sc.reduce_kind(), static_cast<double>(rank_grad), t_end, us);
    f.exposed_comm_ms += us / 1e3;
  }
  for (int64_t s = 0; s < P.pp; ++s) sc.span("optimizer step", "optimizer", mbs - 1, s, t_end, f.optimizer_ms);
  t_end += f.optimizer_ms;
  if (dp_link && sc.sharded && rank_grad > 0) {
    const double us = all_gather_us(static_cast<double>(rank_grad), P.dp, *dp_link);
    t_end = sc.add_comm("dp_all_gather", static_cast<double>(rank_grad), t_end, us);
    f.exposed_comm_ms += us / 1e3;
  }
  f.step_ms = t_end;
  f.compute_ms = m * (stage_fw[slow] + stage_bw[slow] - slow_tp + rest_fw[slow] + rest_bw[slow]) + f.optimizer_ms;
  // What the slowest stage's rank waits for beside its own work: the fill and drain, and the sends.
  f.bubble_ms = std::max(0.0, f.step_ms - f.compute_ms - f.exposed_comm_ms);
}

}  // namespace

void schedule_pipeline(StepSchedule& sc) {
  StepTimeForecast& f = sc.f;
  const ParallelConfig& P = sc.P;
  const int64_t mbs = sc.mbs;
  // 1F1B on every stage (one_f_one_b). A forward waits for the previous stage's output (its send), a backward for
  // the next stage's gradient; each send takes the link's time for the stage's output at the micro-batch.
  std::vector<std::vector<size_t>> stage_forward(P.pp), stage_backward(P.pp);
  for (size_t i : sc.forward_layers) stage_forward[f.per_layer[i].stage].push_back(i);
  for (size_t i : sc.backward_layers) stage_backward[f.per_layer[i].stage].push_back(i);
  std::vector<double> hop_ms(P.pp, 0.0);
  for (int64_t s = 0; s + 1 < P.pp; ++s) {
    if (sc.pp_link) hop_ms[s] = send_us(static_cast<double>(sc.send_bytes[s]), *sc.pp_link) / 1e3;
  }
  const StageRest rests = stage_rests(sc);
  const double start = sc.bcast_ms;
  std::vector<double> free(P.pp, start);
  std::vector<std::vector<double>> fwd_done(P.pp, std::vector<double>(mbs, -1.0)), bwd_done = fwd_done;
  const std::vector<std::vector<std::pair<bool, int64_t>>> order = one_f_one_b(P.pp, mbs);
  std::vector<size_t> next(P.pp, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int64_t s = 0; s < P.pp; ++s) {
      while (next[s] < order[s].size()) {
        const auto [backward, j] = order[s][next[s]];
        double ready = start;
        if (!backward && s > 0) {
          if (fwd_done[s - 1][j] < 0) break;
          ready = fwd_done[s - 1][j] + hop_ms[s - 1];
        } else if (backward) {
          const double after = s + 1 < P.pp ? bwd_done[s + 1][j] : fwd_done[s][j];
          if (after < 0) break;
          ready = after + (s + 1 < P.pp ? hop_ms[s] : 0.0);
        }
        const double begin = std::max(free[s], ready);
        double end = sc.run_pass(backward ? stage_backward[s] : stage_forward[s], backward, j, s, begin, {});
        if (const double rest = backward ? rests.bw[s] : rests.fw[s]; rest > 0) {
          end = sc.span(kOtherSpan, "other", j, s, end, rest);
        }
        (backward ? bwd_done : fwd_done)[s][j] = end;
        free[s] = end;
        // The output forward to the next stage, the gradient back to the previous one.
        if (sc.pp_link && !backward && s + 1 < P.pp) {
          sc.add_comm("pp_send", static_cast<double>(sc.send_bytes[s]), end, hop_ms[s] * 1e3, s);
        }
        if (sc.pp_link && backward && s > 0) {
          sc.add_comm("pp_send", static_cast<double>(sc.send_bytes[s - 1]), end, hop_ms[s - 1] * 1e3, s);
        }
        ++next[s];
        progress = true;
      }
    }
  }
  for (int64_t s = 0; s < P.pp; ++s) {  // 1F1B's order always completes; a stage left waiting is a bug here
    if (next[s] != order[s].size()) {
      GPUCAST_THROW(std::logic_error, "step time: the 1F1B schedule stopped at stage {} of {}", s, P.pp);
    }
  }
  finish(sc, rests, hop_ms, *std::max_element(free.begin(), free.end()));
}

}  // namespace gpucast::detail
