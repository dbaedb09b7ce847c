// The step-time forecast's first part: the probes' times fitted per layer over the batch (step_schedule.h).
#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "gpucast/error.h"
#include "gpucast/layer_model.h"
#include "step_schedule.h"

namespace gpucast::detail {

double kernel_ns(const IterationTiming& p) {
  double ns = p.optimizer_ns;
  for (const LayerTiming& l : p.layers) ns += l.forward_ns + l.backward_ns;
  return ns;
}

namespace {

// The tracer's own cost out of a probe: where the untraced wall time is known, (wall - untraced) / ops per
// recorded op, taken out of each unit by its op count. With device clocks the layers' and the optimizer's times
// are their kernels', which the tracer does not slow: what the untraced step spends beyond them is the host's
// (launches, Python, synchronization), its "other".
IterationTiming without_tracer_cost(IterationTiming p) {
  if (!(p.untraced_wall_ns > 0) || p.ops_total <= 0 || p.wall_ns <= p.untraced_wall_ns) return p;
  if (p.clock == "device") {
    p.other_ns = std::max(0.0, p.untraced_wall_ns - kernel_ns(p));
    p.wall_ns = p.untraced_wall_ns;
    return p;
  }
  const double c = (p.wall_ns - p.untraced_wall_ns) / static_cast<double>(p.ops_total);
  auto less = [&](double& t, int64_t ops) { t = std::max(0.0, t - c * static_cast<double>(ops)); };
  for (LayerTiming& l : p.layers) {
    less(l.forward_ns, l.forward_ops_all);
    less(l.backward_ns, l.backward_ops_all);
  }
  less(p.optimizer_ns, p.optimizer_ops);
  less(p.other_ns, p.other_ops);
  p.wall_ns = p.untraced_wall_ns;
  return p;
}

// Options the forecast cannot take, named in a UserError.
void check_options(const StepTimeOptions& o) {
  const ParallelConfig& P = o.parallel;
  for (auto [key, v] : {std::pair<const char*, int64_t>{"dp", P.dp}, {"tp", P.tp}, {"pp", P.pp},
                        {"micro_batches", P.micro_batches}}) {
    if (v < 1) GPUCAST_USER_ERROR("parallel: '{}' should be an integer of at least 1, got {}", key, v);
  }
  if (P.dp_mode != "ddp" && P.dp_mode != "zero1" && P.dp_mode != "zero2" && P.dp_mode != "fsdp") {
    GPUCAST_USER_ERROR("parallel: 'dp_mode' should be one of ddp|zero1|zero2|fsdp, got '{}'", P.dp_mode);
  }
  if (o.batch_size < P.dp * P.micro_batches) {
    GPUCAST_USER_ERROR("step time: batch_size {} is smaller than dp x micro_batches = {}: every rank needs a sample "
                       "in every micro-batch", o.batch_size, P.dp * P.micro_batches);
  }
  if (!(o.time_scale > 0) || o.time_scale > 10) {
    GPUCAST_USER_ERROR("step time: time_scale should be in (0, 10], got {}", o.time_scale);
  }
  if (o.seq_len < 0) GPUCAST_USER_ERROR("step time: seq_len should be at least 0, got {}", o.seq_len);
}

// The forecast's batch and strategy fields.
StepTimeForecast begin_forecast(const StepTimeOptions& o) {
  const ParallelConfig& P = o.parallel;
  StepTimeForecast f;
  f.batch_size = o.batch_size;
  f.dp = P.dp, f.tp = P.tp, f.pp = P.pp, f.micro_batches = P.micro_batches, f.dp_mode = P.dp_mode;
  f.per_rank_batch = o.batch_size / (P.dp * P.micro_batches);
  if (f.per_rank_batch * P.dp * P.micro_batches != o.batch_size) {
    f.notes.push_back(Note{"batch-not-divisible", fmt::format("batch_size {} is not a multiple of dp x micro_batches = {}: each rank's "
                                  "micro-batch taken as {}", o.batch_size, P.dp * P.micro_batches, f.per_rank_batch)});
  }
  return f;
}

// Sparse timing: only the chosen layers' times are used; the others come from per-kind roofline models fitted on
// them (layer_model.h), over all probes. Each probe's wall time is known: the untimed layers and "other" share
// what the timed layers and the optimizer leave of it. Sets fits.modelled and fits.f.timed_layers (nothing where
// every layer is timed), and fits.f.other_ms from `other`, each probe's rest of the step (sparse: recomputed).
template <typename SameKernels>
void fit_untimed_layers(StepFits& fits, const StepTimeOptions& o, const SameKernels& same_kernels,
                        std::vector<SizedValue>& other) {
  StepTimeForecast& f = fits.f;
  const std::vector<IterationTiming>& probes = fits.probes;
  const IterationTiming& ref = fits.largest();
  const double b = fits.b, seq = fits.seq, k = fits.k;
  auto sized = [&](const IterationTiming& p, double value) {
    return SizedValue{static_cast<double>(p.batch), o.seq_len > 0 ? static_cast<double>(p.seq) : 0.0, value};
  };
  std::unordered_map<std::string, LayerForecast>& modelled = fits.modelled;  // untimed layers at the target batch
  // Chosen when the probes were traced (their timed flags), or here by the design.
  std::vector<size_t> chosen;
  std::string chooser;
  const int64_t chosen_before = std::count_if(ref.layers.begin(), ref.layers.end(), [](const LayerTiming& l) { return l.timed; });
  if (o.every_layer && chosen_before < static_cast<int64_t>(ref.layers.size()) && ref.clock == "device") {
    GPUCAST_USER_ERROR("step time: every_layer asks for the times of every layer, but the probes were timed on the "
                       "device for {} of their {} layers only; forecast again with time_fraction=1 to time them all",
                       chosen_before, ref.layers.size());
  }
  if (!o.every_layer && chosen_before < static_cast<int64_t>(ref.layers.size())) {
    for (size_t i = 0; i < ref.layers.size(); ++i) {
      if (ref.layers[i].timed) chosen.push_back(i);
    }
    chooser = "chosen before the probes were timed";
    if (chosen.empty()) GPUCAST_USER_ERROR("step time: the probes were traced with none of their layers timed");
  } else if (o.time_fraction < 1.0 || o.time_budget < 1.0) {
    chosen = choose_timed_indices(ref, o.time_fraction, o.design, o.design_seed, o.time_budget);
    chooser = o.design + " design";
  }
  if (!chooser.empty()) {
    const size_t n = ref.layers.size();
    std::unordered_map<std::string, bool> timed;
    for (const LayerTiming& l : ref.layers) timed[l.layer] = false;
    for (size_t i : chosen) timed[ref.layers[i].layer] = true;
    std::vector<LayerCost> costs;
    std::vector<LayerSample> samples;
    for (const IterationTiming& p : probes) {
      for (const LayerTiming& l : p.layers) {
        if (!timed[l.layer] || !same_kernels(l)) continue;
        costs.push_back(layer_cost(l));
        samples.push_back({costs.size() - 1, l.forward_ns, l.backward_ns});  // scaled by k below, once
      }
    }
    LayerTimeModel model;
    model.fit(costs, samples, o.prior);
    // Each untimed layer is priced at every probe's batch against its work at the largest probe, so that the
    // model's guard against extrapolation prices one layer the same way at every batch size.
    std::unordered_map<std::string, LayerCost> reach;
    for (const LayerTiming& l : ref.layers) reach.emplace(l.layer, layer_cost(l));
    // A layer without a backward pass in the probe (its parameters frozen, no input needing a gradient) costs
    // nothing there, whatever its kind's backward model says.
    auto price = [&](const IterationTiming& p, const LayerTiming& l) {
      const auto r = reach.find(l.layer);
      LayerPrediction pr = model.predict(layer_cost(l), r == reach.end() ? nullptr : &r->second);
      if (!layer_runs_backward(p, l)) pr.backward_ns = 0;
      return pr;
    };
    f.timed_layers = static_cast<int64_t>(chosen.size());
    // Each probe's rest: its wall time less the optimizer and the timed layers, all measured; the untimed layers
    // and "other" share it (over the probes that ran the largest probe's kernels throughout where there are two:
    // the model predicts those). Fitted over the batch like a layer, the rest anchors the step at the target; the
    // modelled layers take their part of it and "other" what is left. (Fitting "other" alone as each probe's
    // rest less the modelled layers clamped it: where the model prices the untimed layers above their time at
    // small probes and below it at large ones, those remainders fall through zero, and a fit held to a >= 0
    // intercept lost the difference at the target: the zoo LSTM at 32, one of four layers timed, 8 % low.)
    other.clear();
    int64_t uniform = 0;
    for (const IterationTiming& p : probes) {
      uniform += std::all_of(p.layers.begin(), p.layers.end(), same_kernels) ? 1 : 0;
    }
    for (const IterationTiming& p : probes) {
      if (uniform >= 2 && !std::all_of(p.layers.begin(), p.layers.end(), same_kernels)) continue;
      double layers = 0;
      for (const LayerTiming& l : p.layers) {
        if (timed[l.layer]) layers += l.forward_ns + l.backward_ns;
      }
      other.push_back(sized(p, std::max(0.0, k * (p.wall_ns - p.optimizer_ns - layers))));
    }
    // Untimed layers at the target batch: the model prices each at the probes' batch sizes, where it was fitted,
    // and those times are fitted over the batch like measured ones.
    std::unordered_map<std::string, std::pair<std::vector<SizedValue>, std::vector<SizedValue>>> model_pts;
    std::unordered_map<std::string, std::string> model_source;
    for (const IterationTiming& p : probes) {
      for (const LayerTiming& l : p.layers) {
        if (timed[l.layer]) continue;
        const LayerPrediction pr = price(p, l);
        model_pts[l.layer].first.push_back(sized(p, pr.forward_ns));
        model_pts[l.layer].second.push_back(sized(p, pr.backward_ns));
        model_source[l.layer] = pr.source;
      }
    }
    for (const LayerTiming& l : ref.layers) {
      if (timed[l.layer]) continue;
      auto& [fw, bw] = model_pts[l.layer];
      LayerForecast lf{l.layer, fit_size(fw, b, seq) * k / 1e6, fit_size(bw, b, seq) * k / 1e6, l.grad_bytes};
      lf.source = model_source[l.layer];
      modelled[l.layer] = lf;
    }
    f.notes.push_back(Note{"sparse-timing", fmt::format("timed {} of {} layers ({}); the rest from per-kind roofline models: {}",
                                  chosen.size(), n, chooser, model.describe())});
  }
  f.other_ms = fit_size(other, b, seq) / 1e6;
  if (!chooser.empty()) {
    // Sparse timing: `other` held each probe's rest. The rest at the target less the modelled layers; where they
    // come to more than the rest, "other" is 0 and, with CPU clocks (the layers' times make up the wall), they are
    // scaled down to it. Device clocks: a probe's wall is the host's where the host bounds it (small probes),
    // while the kernels grow with the batch.
    double untimed_ms = 0;
    for (const auto& [name, lf] : modelled) untimed_ms += lf.forward_ms + lf.backward_ms;
    const double rest_ms = f.other_ms;
    f.other_ms = std::max(0.0, rest_ms - untimed_ms);
    if (untimed_ms > rest_ms && untimed_ms > 0 && ref.clock == "cpu") {
      const double s = rest_ms / untimed_ms;
      for (auto& [name, lf] : modelled) lf.forward_ms *= s, lf.backward_ms *= s;
      f.notes.push_back(Note{"untimed-layers-scaled", fmt::format("the untimed layers' models come to {:.3f} ms at the target, more than the "
                                    "{:.3f} ms the probes' walls leave beside the timed layers and the optimizer "
                                    "(fitted over the batch): scaled down to it",
                                    untimed_ms, rest_ms)});
    }
  }
}

}  // namespace

StepFits fit_probes(const std::vector<IterationTiming>& traced, const StepTimeOptions& o) {
  StepFits fits;
  std::vector<IterationTiming>& probes = fits.probes;
  for (const IterationTiming& p : traced) probes.push_back(without_tracer_cost(p));
  if (probes.empty()) GPUCAST_USER_ERROR("step time: no probe iterations to forecast from");
  check_options(o);
  const ParallelConfig& P = o.parallel;
  fits.f = begin_forecast(o);
  StepTimeForecast& f = fits.f;
  f.clock = probes.back().clock;
  const double b = static_cast<double>(f.per_rank_batch);
  const double m = static_cast<double>(P.micro_batches);
  fits.seq_len = o.seq_len;
  fits.b = b, fits.m = m, fits.seq = static_cast<double>(o.seq_len), fits.k = o.time_scale;
  const double seq = fits.seq;
  // By sequence length too: every probe recorded with one.
  if (o.seq_len > 0) {
    for (const IterationTiming& p : probes) {
      if (p.seq <= 0) {
        GPUCAST_USER_ERROR("step time: seq_len {} asks for scaling by sequence length, but the probe at batch {} has "
                           "no sequence length recorded (forecast(..., seq_len=) records it)",
                           o.seq_len, p.batch);
      }
    }
  }
  auto tokens = [&](const IterationTiming& p) { return fits.tokens(p); };
  auto sized = [&](const IterationTiming& p, double value) {
    return SizedValue{static_cast<double>(p.batch), o.seq_len > 0 ? static_cast<double>(p.seq) : 0.0, value};
  };
  // Layers in the forward order of the largest probe (most samples, or tokens); their points over all probes.
  fits.ref = static_cast<size_t>(std::max_element(probes.begin(), probes.end(), [&](const auto& x, const auto& y) {
                                   return fits.tokens(x) < fits.tokens(y);
                                 }) - probes.begin());
  const IterationTiming& ref = fits.largest();
  if (P.traced_world > 0 && (P.pp > 1 || P.dp > 1)) {
    // The probes' timings already hold the rank's data-parallel hooks, shards and (fake) collectives, which the
    // schedules below would add again: only tensor parallelism is forecast from a traced rank.
    GPUCAST_USER_ERROR("parallel: dp={} pp={} with probes traced as one rank (traced_world {}): the step time of a "
                       "rank traced with data or pipeline parallelism is not forecast yet (the step time of a pipeline "
                       "stage traced alone, or of a data-parallel rank); trace the whole model in one process and "
                       "describe them", P.dp, P.pp, P.traced_world);
  }
  if (P.pp > 1 && P.pp > static_cast<int64_t>(ref.layers.size())) {
    GPUCAST_USER_ERROR("parallel: 'pp' {} is more than the {} layers the probes found: every stage needs a layer", P.pp,
                       ref.layers.size());
  }
  // A layer's time is fitted on the probes that ran the same kernels as the largest one (the same number of
  // recorded ops in its forward and its backward): below some batch size PyTorch picks other kernels (CPU
  // convolutions: im2col below 16 on one thread), whose times say nothing about the target's.
  std::unordered_map<std::string, std::pair<int64_t, int64_t>> ref_ops;
  for (const LayerTiming& l : ref.layers) ref_ops[l.layer] = {l.forward_ops_all, l.backward_ops_all};
  auto same_kernels = [&](const LayerTiming& l) {
    auto it = ref_ops.find(l.layer);
    return it == ref_ops.end() || it->second == std::pair<int64_t, int64_t>{l.forward_ops_all, l.backward_ops_all};
  };
  std::vector<SizedValue> opt, other;
  LayerPoints& pts = fits.pts;
  LayerPoints& fixed_pts = fits.fixed_pts;
  const double k = o.time_scale;
  std::map<std::string, int64_t> switched;  // layer -> probes left out
  for (const IterationTiming& p : probes) {
    opt.push_back(sized(p, k * p.optimizer_ns));
    other.push_back(sized(p, k * p.other_ns));
    for (const LayerTiming& l : p.layers) {
      if (!same_kernels(l)) {
        ++switched[l.layer];
        continue;
      }
      pts[l.layer].first.push_back(sized(p, k * l.forward_ns));
      pts[l.layer].second.push_back(sized(p, k * l.backward_ns));
      fixed_pts[l.layer].first.push_back(sized(p, k * l.forward_fixed_ns));
      fixed_pts[l.layer].second.push_back(sized(p, k * l.backward_fixed_ns));
    }
  }
  if (!switched.empty()) {
    f.notes.push_back(Note{"kernel-switch", fmt::format("{} layer(s) ran other kernels in smaller probes than the largest (batch {}; e.g. "
                                  "'{}'): fitted only on the probes that ran the largest probe's kernels",
                                  switched.size(), ref.batch, switched.begin()->first)});
  }
  // The optimizer step's work does not grow with the batch, but on a CPU its time does, up to a point: after a
  // larger forward and backward less of the parameters, gradients and optimizer state is left in the caches
  // (AdamW's step for the zoo's CNN took twice as long after a backward at batch 32 as at batch 2 on one host,
  // the LSTM's 1.45 times). Its time is the probe's nearest the target in size (in tokens where the forecast
  // scales by sequence length; the larger of two as near).
  const double target_tokens = std::max(b * (o.seq_len > 0 ? seq : 1.0), 1.0);
  size_t nearest = 0;
  auto distance = [&](size_t i) { return std::abs(std::log(std::max(tokens(probes[i]), 1.0) / target_tokens)); };
  for (size_t i = 1; i < probes.size(); ++i) {
    const double d = distance(i), best = distance(nearest);
    if (d < best - 1e-9 || (d <= best + 1e-9 && tokens(probes[i]) > tokens(probes[nearest]))) nearest = i;
  }
  fits.optimizer_ns = opt[nearest].value;
  fit_untimed_layers(fits, o, same_kernels, other);
  return fits;
}

}  // namespace gpucast::detail
