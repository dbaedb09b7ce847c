// The step-time forecast's second part: the layers at the rank's micro-batch, their stages, the optimizer's share
// and the step's rest, laid out for a strategy's schedule (step_schedule.h).
#include <algorithm>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "gpucast/error.h"
#include "step_schedule.h"

namespace gpucast::detail {
namespace {

  // Ranks sharing one host's memory and cores run slower together than the probe ran alone: each layer by its
  // memory-bound share (bytes against FLOPs at the host's balance), the optimizer as memory-bound, the rest of
  // the step as compute-bound. With contention measured by working set, a layer's memory-bound share at its
  // bytes at the target batch, the optimizer's at its bytes.
struct HostContention {
  const Topology& T;
  bool contended = false;
  double act_scale = 1;  // activations (and a layer's bytes) at the target micro-batch over the largest probe's
  double memory_share(double flops, double bytes) const {
    const double mem = bytes, cmp = flops / T.balance;
    return mem + cmp > 0 ? mem / (mem + cmp) : 0.5;
  }
  double factor(double flops, double bytes) const {
    if (!contended) return 1.0;
    const double share = memory_share(flops, bytes);
    return share * T.memory_contention_for(bytes * act_scale) + (1.0 - share) * T.compute_contention;
  }
};

// The contention of ranks sharing the host, applied to the step's rest and the optimizer (the layers take theirs
// in layers_at_target), with its note.
HostContention host_contention(StepFits& fits, const StepTimeOptions& o) {
  const ParallelConfig& P = o.parallel;
  const IterationTiming& ref = fits.largest();
  StepTimeForecast& f = fits.f;
  double& optimizer_ns = fits.optimizer_ns;
  const double b = fits.b, seq = fits.seq;
  const Topology& T = o.topology;
  const bool by_size = !T.memory_contention_samples.empty();
  const bool contended =
      P.dp * P.tp * P.pp > 1 && (T.memory_contention != 1.0 || T.compute_contention != 1.0 || by_size);
  // Activations (and a layer's bytes) at the target micro-batch over the reference probe's.
  const double act_scale = fits.tokens(ref) > 0 ? b * (o.seq_len > 0 ? seq : 1.0) / fits.tokens(ref) : 1.0;
  const HostContention c{T, contended, act_scale};
  if (contended) {
    f.other_ms *= T.compute_contention;
    optimizer_ns *= ref.optimizer_bytes > 0 ? T.memory_contention_for(ref.optimizer_bytes) : T.memory_contention;
    if (by_size) {
      const auto& s = T.memory_contention_samples;
      f.notes.push_back(Note{"host-contention", fmt::format(
          "ranks share the host: memory-bound work x{:.3f} for working sets of {:.3g} MiB up to x{:.3f} from "
          "{:.3g} MiB, compute-bound x{:.3f} when all run at once (measured by gpucast.calibrate())",
          s.front().factor, s.front().bytes / (1 << 20), s.back().factor, s.back().bytes / (1 << 20),
          T.compute_contention)});
    } else {
      f.notes.push_back(Note{"host-contention", fmt::format("ranks share the host: memory-bound work x{:.3f}, compute-bound x{:.3f} when all "
                                    "run at once (measured by gpucast.calibrate())",
                                    T.memory_contention, T.compute_contention)});
    }
  }
  return c;
}

// Notes on how the ranks meet: collectives without overlap, ranks drifting apart.
void sync_notes(StepSchedule& s) {
  StepTimeForecast& f = s.f;
  const ParallelConfig& P = s.P;
  const Topology& T = s.T;
  if (!T.overlap && P.dp * P.tp * P.pp > 1) {
    f.notes.push_back(Note{"no-overlap", "collectives do not overlap the compute (the ranks' threads fill every core of the host): "
                      "their time adds to the step"});
  }
  const bool drifts = s.drifts = (T.drift_compute > 0 || T.drift_memory > 0) && P.dp > 1 && P.dp_mode != "fsdp";
  if (drifts) {
    f.notes.push_back(Note{"rank-drift", fmt::format("the last rank falls behind the average one by {:.2f} % of the compute-bound and "
                                  "{:.2f} % of the memory-bound time since the ranks last met (ranks sharing cores "
                                  "drift apart; measured by gpucast.calibrate()): the step's first data-parallel "
                                  "collective starts that much later",
                                  100.0 * T.drift_compute, 100.0 * T.drift_memory)});
  } else if (T.sync_wait_us > 0 && P.dp > 1 && P.dp_mode != "fsdp") {
    f.notes.push_back(Note{"sync-wait", fmt::format("the last rank reaches the first data-parallel reduction {:.3f} ms after the "
                                  "average one (ranks sharing cores drift apart; measured by gpucast.calibrate()): "
                                  "it starts that much later",
                                  T.sync_wait_us / 1e3)});
  }
}

// The link of a group; a group without one gets a note.
const Link* group_link(StepSchedule& s, const char* what, int64_t ranks, int64_t stride) {
  const Link* l = s.T.link_for(ranks, stride);
  if (!l) {
    s.f.notes.push_back(Note{"no-link", fmt::format("no {} link for {} ranks (gpucast.calibrate() or link=...): its communication "
                                    "is not counted", what, ranks)});
  }
  return l;
}

// What the layers' loop leaves for the stages, the optimizer and the ranks' drift.
struct LayerTotals {
  int64_t total_grad = 0, split_grad = 0;
  std::vector<std::pair<int64_t, size_t>> bwd_order;  // (backward order, layer)
  std::vector<double> drift_of;  // each layer's drift per ms (Topology::drift_*)
};

// Per layer at the micro-batch; tensor parallelism splits matmuls and embeddings and adds its all-reduces.
LayerTotals layers_at_target(StepSchedule& s, StepFits& fits, const HostContention& c, const Link* tp_link) {
  StepTimeForecast& f = s.f;
  const ParallelConfig& P = s.P;
  const Topology& T = s.T;
  const IterationTiming& ref = s.ref;
  const double b = fits.b, seq = fits.seq, m = fits.m, act_scale = c.act_scale;
  LayerTotals out;
  int64_t& total_grad = out.total_grad;
  int64_t& split_grad = out.split_grad;
  int64_t matmul_with_params = 0;
  bool inside_pair = false;
  std::vector<double>& tp_fw_ms = s.tp_fw_ms;
  std::vector<double>& tp_bw_ms = s.tp_bw_ms;
  std::vector<double>& tp_bytes = s.tp_bytes;
  tp_fw_ms.assign(ref.layers.size(), 0.0), tp_bw_ms.assign(ref.layers.size(), 0.0);
  tp_bytes.assign(ref.layers.size(), 0.0);
  std::vector<double>& drift_of = out.drift_of;
  drift_of.assign(ref.layers.size(), 0.0);
  for (const LayerTiming& l : ref.layers) {
    const double mshare = c.memory_share(l.flops, l.bytes);
    drift_of[f.per_layer.size()] = mshare * T.drift_memory + (1.0 - mshare) * T.drift_compute;
    auto& [fw, bw] = fits.pts[l.layer];
    LayerForecast lf{l.layer, fit_size(fw, b, seq) / 1e6, fit_size(bw, b, seq) / 1e6, l.grad_bytes};
    if (auto it = fits.modelled.find(l.layer); it != fits.modelled.end()) {
      lf.forward_ms = it->second.forward_ms;
      lf.backward_ms = it->second.backward_ms;
      lf.source = it->second.source;
    }
    const double slowdown = c.factor(l.flops, l.bytes);
    lf.forward_ms *= slowdown;
    lf.backward_ms *= slowdown;
    total_grad += l.grad_bytes;
    const size_t i = f.per_layer.size();
    // Megatron's pairs: a column-parallel matmul (with parameters) shards the activations until the next one,
    // row-parallel, gathers them with an all-reduce; every layer in between runs on the shards.
    const bool paired = l.kind == "matmul" && l.grad_bytes > 0;
    const bool row = paired && matmul_with_params % 2 == 1;
    const bool split = P.tp > 1 && (l.kind == "embedding" || paired || inside_pair || l.kind == "matmul");
    if (paired) inside_pair = !row, ++matmul_with_params;
    if (split) {
      if (P.traced_world == 0) {
        // What every rank still does whole (its kernels' launches), then the divided rest. (Probes that ran as a
        // tensor-parallel rank computed on its shards already: nothing to divide, only the all-reduces to add.)
        auto& [ffw, fbw] = fits.fixed_pts[l.layer];
        const double fixed_fw = std::min(lf.forward_ms, fit_size(ffw, b, seq) / 1e6 * slowdown);
        const double fixed_bw = std::min(lf.backward_ms, fit_size(fbw, b, seq) / 1e6 * slowdown);
        lf.forward_ms = fixed_fw + (lf.forward_ms - fixed_fw) / static_cast<double>(P.tp);
        lf.backward_ms = fixed_bw + (lf.backward_ms - fixed_bw) / static_cast<double>(P.tp);
        lf.grad_bytes /= P.tp;
        split_grad += l.grad_bytes;
      }
      const double bytes = static_cast<double>(l.out_bytes) * act_scale;
      const double us = tp_link ? allreduce_us(bytes, P.tp, *tp_link, T.algorithm) : 0.0;
      tp_bytes[i] = bytes;
      if (l.kind == "embedding") {
        tp_fw_ms[i] = us / 1e3;
      } else if (row) {
        tp_fw_ms[i] = us / 1e3;
        tp_bw_ms[i] = us / 1e3;
      }
      lf.tp_comm_ms = tp_fw_ms[i] + tp_bw_ms[i];
      f.tp_comm_ms += m * lf.tp_comm_ms;
    }
    out.bwd_order.emplace_back(l.backward_order, i);
    f.per_layer.push_back(std::move(lf));
  }
  f.comm_ms += f.tp_comm_ms;
  return out;
}

// Pipeline stages of balanced time (each a contiguous run of layers) and this rank's optimizer step: its share of
// the parameters.
void stages_and_optimizer(StepSchedule& s, const StepFits& fits, const LayerTotals& t, double act_scale) {
  StepTimeForecast& f = s.f;
  const ParallelConfig& P = s.P;
  const IterationTiming& ref = s.ref;
  const double m = fits.m;
  const int64_t total_grad = t.total_grad, split_grad = t.split_grad;
  const std::vector<double>& tp_fw_ms = s.tp_fw_ms;
  const std::vector<double>& tp_bw_ms = s.tp_bw_ms;
  // Optimizer: this rank's share of the parameters.
  double share = total_grad > 0 ? (static_cast<double>(total_grad - split_grad) +
                                   static_cast<double>(split_grad) / static_cast<double>(P.tp)) /
                                      static_cast<double>(total_grad)
                                : P.traced_world > 0 ? 1.0 : 1.0 / static_cast<double>(P.tp);

  // Pipeline stages.
  std::vector<double> cost;
  for (size_t i = 0; i < f.per_layer.size(); ++i) {
    cost.push_back(f.per_layer[i].forward_ms + f.per_layer[i].backward_ms + tp_fw_ms[i] + tp_bw_ms[i]);
  }
  const std::vector<int64_t> stage = P.pp > 1 ? balanced_stages(cost, P.pp) : std::vector<int64_t>(cost.size(), 0);
  std::vector<double>& stage_fw = s.stage_fw;
  std::vector<double>& stage_bw = s.stage_bw;
  std::vector<int64_t>& send_bytes = s.send_bytes;
  stage_fw.assign(P.pp, 0.0), stage_bw.assign(P.pp, 0.0);
  std::vector<int64_t> stage_grad(P.pp, 0);
  send_bytes.assign(P.pp, 0);
  for (size_t i = 0; i < f.per_layer.size(); ++i) {
    LayerForecast& l = f.per_layer[i];
    l.stage = stage[i];
    stage_fw[l.stage] += l.forward_ms + tp_fw_ms[i];
    stage_bw[l.stage] += l.backward_ms + tp_bw_ms[i];
    stage_grad[l.stage] += l.grad_bytes;
    send_bytes[l.stage] = static_cast<int64_t>(static_cast<double>(ref.layers[i].out_bytes) * act_scale);
  }
  for (const LayerForecast& l : f.per_layer) f.forward_ms += m * l.forward_ms, f.backward_ms += m * l.backward_ms;
  const int64_t rank_grad = s.rank_grad = *std::max_element(stage_grad.begin(), stage_grad.end());
  int64_t& all_rank_grad = s.all_rank_grad;
  for (int64_t g : stage_grad) all_rank_grad += g;
  if (P.pp > 1 && all_rank_grad > 0) share *= static_cast<double>(rank_grad) / static_cast<double>(all_rank_grad);
  if (P.pp > 1 && all_rank_grad == 0) share /= static_cast<double>(P.pp);
  const bool sharded = s.sharded = P.dp_mode != "ddp";
  f.optimizer_ms = fits.optimizer_ns / 1e6 * share / (sharded ? static_cast<double>(P.dp) : 1.0);
}

// A step bound by its host: where the probes show it (device clocks) or the rates table prices it, the rest of the
// step is what the host spends beyond the kernels (per micro-batch).
void host_bound_rest(StepSchedule& s, const StepFits& fits) {
  StepTimeForecast& f = s.f;
  const IterationTiming& ref = s.ref;
  const std::vector<IterationTiming>& probes = fits.probes;
  const double m = fits.m, k = fits.k;
  auto tokens = [&](const IterationTiming& p) { return fits.tokens(p); };
  const bool priced_host = ref.clock == "gpu-table" &&
                           std::all_of(probes.begin(), probes.end(), [](const IterationTiming& p) { return p.host_ns > 0; });
  // The host issues the kernels while the device runs the ones before: a probe's step is its host time where
  // that is longer than its kernels (small batches, many small ops), else its kernels' time. The host's time
  // does not grow with the batch; the kernels' do. With device clocks it shows where the probes' walls grow less
  // than half as fast as their batch (one probe: where its kernels take less than half of its wall): their walls
  // (untraced) are the host's time. Priced, it is the table's cost per launching op. At the target, what the host
  // spends beyond the kernels is that time less the target's kernel time per micro-batch, if positive. Where the
  // probes do not show it, "other" stays the fit over the batch.
  std::vector<double> host;
  bool untraced = true;
  if (priced_host) {
    for (const IterationTiming& p : probes) host.push_back(k * p.host_ns / 1e6);
  } else if (ref.clock == "device") {
    auto lo = std::min_element(probes.begin(), probes.end(), [&](const auto& x, const auto& y) { return tokens(x) < tokens(y); });
    auto hi = std::max_element(probes.begin(), probes.end(), [&](const auto& x, const auto& y) { return tokens(x) < tokens(y); });
    bool host_bound = false;
    if (tokens(*hi) > tokens(*lo) && lo->wall_ns > 0) {
      // 0.5: a chosen threshold, the wall growing less than half as fast as the work.
      host_bound = (hi->wall_ns / lo->wall_ns - 1) < 0.5 * (tokens(*hi) / tokens(*lo) - 1);
    } else {
      // 0.5: a chosen threshold, kernels filling less than half the wall.
      host_bound = kernel_ns(ref) < 0.5 * ref.wall_ns;
    }
    if (host_bound) {
      for (const IterationTiming& p : probes) {
        host.push_back(k * p.wall_ns / 1e6);
        untraced = untraced && p.untraced_wall_ns > 0;
      }
    }
  }
  if (!host.empty()) {
    std::sort(host.begin(), host.end());
    const double host_ms = host[host.size() / 2];
    f.host_ms = host_ms;
    const double kernels_ms = (f.forward_ms + f.backward_ms) / m + f.optimizer_ms;
    const double before = f.other_ms;
    f.other_ms = std::max(0.0, host_ms - kernels_ms);
    f.notes.push_back(Note{
        host_ms > kernels_ms ? "host-bound" : "device-bound",
        fmt::format(
            "{}: the kernels take {:.3f} ms per micro-batch at the target, the probes' host {:.3f} ms per step ({}): "
            "the step is {}-bound; the rest of the step {:.3f} ms (fitted over the batch: {:.3f} ms)",
            priced_host ? "priced kernels" : "device clocks", kernels_ms, host_ms,
            priced_host ? "priced per op from the rates table"
                        : untraced ? "untraced" : "traced: the tracer's cost included",
            host_ms > kernels_ms ? "host" : "device", f.other_ms, before)});
  }
}

// DDP's and FSDP's own work beside their collectives, measured by gpucast.calibrate() (Topology).
void strategy_overheads(StepSchedule& s) {
  StepTimeForecast& f = s.f;
  const ParallelConfig& P = s.P;
  const Topology& T = s.T;
  const double m = s.m;
  const int64_t rank_grad = s.rank_grad;
  const bool ddp_overhead = (T.ddp_overhead_us > 0 || !T.ddp_overhead_samples.empty()) && P.dp > 1 &&
                            P.dp_mode != "fsdp";
  if (ddp_overhead) {  // once per step (the reduction's aftermath), by the gradient bytes this rank reduces
    const double us = T.ddp_overhead_for(static_cast<double>(rank_grad));
    f.other_ms += us / 1e3;
    f.notes.push_back(Note{"ddp-overhead", fmt::format("DDP costs {:.3f} ms per step outside backward beyond the plain module (its "
                                  "wrapper, and the collectives' threads on the shared cores; measured by "
                                  "gpucast.calibrate(){})",
                                  us / 1e3,
                                  T.ddp_overhead_samples.empty()
                                      ? std::string()
                                      : fmt::format(", for {:.3g} MiB of gradients per rank",
                                                    static_cast<double>(rank_grad) / (1 << 20)))});
  }
  // FSDP's units over the layers, by their parameters (the probes hold them whole).
  std::vector<double> params;
  FsdpUnits& U = s.units;
  if (P.dp > 1 && P.dp_mode == "fsdp") {
    std::vector<std::string> names;
    for (const LayerForecast& l : f.per_layer) names.push_back(l.layer), params.push_back(static_cast<double>(l.grad_bytes));
    U = fsdp_units(names, params, P.fsdp_units);
  }
  const double fsdp_unit = T.fsdp_overhead_unit_us, fsdp_layer = T.fsdp_overhead_layer_us, fsdp_mib = T.fsdp_overhead_mib_us;
  if (P.dp > 1 && P.dp_mode == "fsdp" && (fsdp_unit > 0 || fsdp_layer > 0 || fsdp_mib > 0)) {
    // FSDP's own work beside its collectives, every micro-batch: by its units, their layers with parameters and
    // the parameters' MiB.
    int64_t units = 0, layers = 0;
    double mib = 0;
    for (double b : U.bytes) units += b > 0, mib += b / (1 << 20);
    for (double b : params) layers += b > 0;
    const double us = static_cast<double>(m) * (units * fsdp_unit + layers * fsdp_layer + mib * fsdp_mib);
    f.other_ms += us / 1e3;
    f.notes.push_back(Note{"fsdp-overhead", fmt::format("FSDP's own work beside its collectives (its hooks, copies into and out of the "
                                  "gathered buffers, the optimizer over sharded tensors; measured by "
                                  "gpucast.calibrate()): {:.3f} ms per step for {} unit(s), {} layer(s) with "
                                  "parameters and {:.3g} MiB of them{}",
                                  us / 1e3, units, layers, mib, m > 1 ? fmt::format(", {} micro-batches", m) : "")});
  }
}

// The ranks' drift per ms of this step's compute: its layers by their memory-bound shares, the optimizer as
// memory-bound, the rest as compute-bound.
double drift_rate(const StepSchedule& s, const std::vector<double>& drift_of) {
  const StepTimeForecast& f = s.f;
  const Topology& T = s.T;
  const double m = s.m;
  double drift_rate = 0;
  if (s.drifts) {
    double lagged = f.optimizer_ms * T.drift_memory + f.other_ms * T.drift_compute;
    double spent = f.optimizer_ms + f.other_ms;
    for (size_t i = 0; i < f.per_layer.size(); ++i) {
      const double ms = m * (f.per_layer[i].forward_ms + f.per_layer[i].backward_ms);
      lagged += ms * drift_of[i];
      spent += ms;
    }
    drift_rate = spent > 0 ? lagged / spent : 0.0;
  }
  return drift_rate;
}

// DDP's broadcast of the module's buffers from rank 0, before the step's first forward (once per step: the
// micro-batches under no_sync skip it); it blocks that forward. Under pipeline parallelism, a stage's share.
void broadcast_buffers(StepSchedule& s) {
  StepTimeForecast& f = s.f;
  const ParallelConfig& P = s.P;
  const Topology& T = s.T;
  if (P.dp > 1 && s.dp_link && P.dp_mode != "fsdp" && P.broadcast_buffers && P.buffer_bytes > 0) {
    const double bytes = static_cast<double>(P.buffer_bytes) / static_cast<double>(P.pp);
    // It waits for the last rank, which fell behind over the optimizer step since the previous step's reduction.
    s.bcast_ms = s.add_comm("dp_broadcast_buffers", bytes, s.drifts ? f.optimizer_ms * T.drift_memory : 0.0,
                            broadcast_us(bytes, P.dp, *s.dp_link));
    f.exposed_comm_ms += s.bcast_ms;
  }
}

}  // namespace

StepSchedule lay_out_layers(StepFits& fits, const StepTimeOptions& o) {
  const HostContention c = host_contention(fits, o);
  StepSchedule s(std::move(fits.f), o, fits.largest());
  const ParallelConfig& P = s.P;
  s.first_bucket_bytes = o.first_bucket_bytes;
  s.m = fits.m;
  s.mbs = P.micro_batches;
  sync_notes(s);
  // The groups' links: tp innermost, then dp, then pp.
  const Link* tp_link = P.tp > 1 ? group_link(s, "tensor-parallel", P.tp, 1) : nullptr;
  s.dp_link = P.dp > 1 ? group_link(s, "data-parallel", P.dp, P.tp) : nullptr;
  s.pp_link = P.pp > 1 ? group_link(s, "pipeline", P.pp, P.tp * P.dp) : nullptr;
  LayerTotals totals = layers_at_target(s, fits, c, tp_link);
  stages_and_optimizer(s, fits, totals, c.act_scale);
  host_bound_rest(s, fits);
  s.f.other_ms *= s.m;
  strategy_overheads(s);
  s.f.compute_ms = s.f.forward_ms + s.f.backward_ms + s.f.optimizer_ms + s.f.other_ms;
  s.drift_rate = drift_rate(s, totals.drift_of);
  // The step laid out on its streams: compute spans (per layer, or per pass where the layers times the
  // micro-batches would pass kMaxLayerSpans) beside the communication in f.comm.
  broadcast_buffers(s);
  s.layer_spans = s.f.per_layer.size() * static_cast<size_t>(s.mbs) * 2 <= kMaxLayerSpans;
  std::sort(totals.bwd_order.begin(), totals.bwd_order.end());
  s.forward_layers.resize(s.f.per_layer.size());
  std::iota(s.forward_layers.begin(), s.forward_layers.end(), size_t{0});
  for (auto [order, i] : totals.bwd_order) s.backward_layers.push_back(i);
  return s;
}

double StepSchedule::add_comm(const char* kind, double bytes, double start_ms, double us, int64_t stage) {
  f.comm.push_back({kind, static_cast<int64_t>(bytes), start_ms, start_ms + us / 1e3, stage});
  f.comm_ms += us / 1e3;
  return start_ms + us / 1e3;
}

double StepSchedule::span(std::string name, const char* kind, int64_t mb, int64_t stage, double start, double ms) {
  f.compute.push_back({std::move(name), kind, mb, stage, start, start + ms});
  return start + ms;
}

double StepSchedule::run_pass(const std::vector<size_t>& layers, bool backward, int64_t mb, int64_t stage, double t,
                              const std::function<void(size_t, double)>& done) {
  const double start = t;
  for (size_t i : layers) {
    const double ms = backward ? f.per_layer[i].backward_ms : f.per_layer[i].forward_ms;
    const double tp = backward ? tp_bw_ms[i] : tp_fw_ms[i];
    if (layer_spans) {
      t = span(f.per_layer[i].layer + (backward ? " backward" : " forward"), backward ? "backward" : "forward", mb,
               stage, t, ms);
      if (tp > 0) f.comm.push_back({"tp_allreduce", static_cast<int64_t>(tp_bytes[i]), t, t + tp, stage});
      t += tp;
    } else {
      t += ms + tp;
    }
    if (done) done(i, t);
  }
  if (!layer_spans && !layers.empty()) {
    span(fmt::format("{} (micro-batch {})", backward ? "backward" : "forward", mb), backward ? "backward" : "forward",
         mb, stage, start, t - start);
  }
  return t;
}

double StepSchedule::reduce_us(double bytes, double idle_ms) const {
  return sharded ? reduce_scatter_us(bytes, P.dp, *dp_link)
                 : allreduce_us(bytes, P.dp, *dp_link, T.algorithm, idle_ms < 0 ? -1.0 : idle_ms * 1e3);
}

}  // namespace gpucast::detail
