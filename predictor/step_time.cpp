#include "gpucast/step_time.h"

#include <algorithm>
#include <map>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "gpucast/error.h"

namespace gpucast {
namespace {

using nlohmann::json;
constexpr const char* kOutside = "(outside modules)";

double duration(const OpRecord& op) {
  return op.device_ns >= 0 ? static_cast<double>(op.device_ns) : static_cast<double>(op.end_ns - op.start_ns);
}

// t(b) = a + c b over the probes, a, c >= 0; evaluated at b.
double fit_at(const std::vector<std::pair<double, double>>& pts, double b) {
  if (pts.empty()) return 0;
  if (pts.size() == 1) return pts[0].first > 0 ? pts[0].second * b / pts[0].first : pts[0].second;
  double n = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (auto [x, y] : pts) {
    n += 1, sx += x, sy += y, sxx += x * x, sxy += x * y;
  }
  const double den = n * sxx - sx * sx;
  double c = den != 0 ? (n * sxy - sx * sy) / den : 0;
  double a = (sy - c * sx) / n;
  if (c < 0) {  // no growth with the batch: a constant
    c = 0;
    a = sy / n;
  } else if (a < 0) {  // through the origin
    a = 0;
    c = sxx > 0 ? sxy / sxx : 0;
  }
  return a + c * b;
}

}  // namespace

IterationTiming iteration_timing(const Trace& t, int64_t batch) {
  IterationTiming it;
  it.batch = batch;
  std::vector<const OpRecord*> steps;
  for (const OpRecord& op : t.ops) {
    if (op.scope == Scope::UserScope && op.depth == 0 && op.name.rfind("Optimizer.step#", 0) == 0) steps.push_back(&op);
  }
  std::sort(steps.begin(), steps.end(), [](auto* a, auto* b) { return a->end_seq < b->end_seq; });
  const uint64_t lo = steps.size() >= 2 ? steps[steps.size() - 2]->end_seq : 0;
  const uint64_t hi = steps.empty() ? ~uint64_t{0} : steps.back()->end_seq;
  bool device = false;
  int64_t first_ns = -1, last_ns = -1;
  std::map<std::string, size_t> index;
  auto layer = [&](const std::string& name) -> LayerTiming& {
    auto [pos, added] = index.emplace(name, it.layers.size());
    if (added) {
      it.layers.push_back({});
      it.layers.back().layer = name;
      it.layers.back().backward_order = -1;
    }
    return it.layers[pos->second];
  };
  int64_t backward_rank = 0;
  for (const OpRecord& op : t.ops) {
    if (op.start_seq <= lo || op.end_seq > hi || !op.complete) continue;
    if (first_ns < 0 || op.start_ns < first_ns) first_ns = op.start_ns;
    last_ns = std::max(last_ns, op.end_ns);
    if (op.device_ns >= 0) device = true;
    const bool top = op.parent < 0;
    if (op.scope == Scope::UserScope && op.name.rfind("Optimizer.step#", 0) == 0 && op.depth == 0) {
      it.optimizer_ns += duration(op);
    } else if (op.phase == Phase::Forward && op.scope == Scope::Function && top) {
      layer(op.module.empty() ? kOutside : op.module).forward_ns += duration(op);
    } else if (op.phase == Phase::Backward && op.scope == Scope::BackwardFunction &&
               (top || t.ops[op.parent].scope != Scope::BackwardFunction)) {
      const std::string name = op.fwd_op >= 0 && !t.ops[op.fwd_op].module.empty() ? t.ops[op.fwd_op].module : kOutside;
      LayerTiming& l = layer(name);
      l.backward_ns += duration(op);
      if (l.backward_order < 0) l.backward_order = backward_rank++;
    }
  }
  for (const Allocation& a : t.allocations) {
    if (a.category != Category::Gradient || a.alloc_op < 0) continue;
    const OpRecord& op = t.ops[a.alloc_op];
    if (op.start_seq <= lo || op.end_seq > hi) continue;
    int64_t node = op.scope == Scope::BackwardFunction ? op.id : op.bwd_node;
    const int64_t fwd = node >= 0 ? t.ops[node].fwd_op : -1;
    layer(fwd >= 0 && !t.ops[fwd].module.empty() ? t.ops[fwd].module : kOutside).grad_bytes += a.block_bytes;
  }
  for (LayerTiming& l : it.layers) {
    if (l.backward_order < 0) l.backward_order = backward_rank++;
  }
  it.wall_ns = first_ns >= 0 ? static_cast<double>(last_ns - first_ns) : 0;
  double layers = 0;
  for (const LayerTiming& l : it.layers) layers += l.forward_ns + l.backward_ns;
  it.other_ns = std::max(0.0, it.wall_ns - layers - it.optimizer_ns);
  it.clock = device ? "device" : "cpu";
  return it;
}

StepTimeForecast forecast_step_time(const std::vector<IterationTiming>& probes, const StepTimeOptions& o) {
  if (probes.empty()) GPUCAST_USER_ERROR("step time: no probe iterations to forecast from");
  if (o.dp < 1) GPUCAST_USER_ERROR("parallel: 'dp' should be an integer of at least 1, got {}", o.dp);
  if (o.dp_mode != "ddp" && o.dp_mode != "zero1" && o.dp_mode != "zero2" && o.dp_mode != "fsdp") {
    GPUCAST_USER_ERROR("parallel: 'dp_mode' should be one of ddp|zero1|zero2|fsdp, got '{}'", o.dp_mode);
  }
  if (o.batch_size < o.dp) {
    GPUCAST_USER_ERROR("step time: batch_size {} is smaller than dp {}: every rank needs a sample", o.batch_size, o.dp);
  }
  StepTimeForecast f;
  f.batch_size = o.batch_size;
  f.dp = o.dp;
  f.per_rank_batch = o.batch_size / o.dp;
  f.clock = probes.back().clock;
  const double b = static_cast<double>(f.per_rank_batch);
  // Layers in the forward order of the largest probe; their points over all probes.
  const IterationTiming& ref = *std::max_element(probes.begin(), probes.end(),
                                                 [](const auto& x, const auto& y) { return x.batch < y.batch; });
  std::vector<std::pair<double, double>> opt, other;
  std::unordered_map<std::string, std::pair<std::vector<std::pair<double, double>>, std::vector<std::pair<double, double>>>> pts;
  if (!(o.time_scale > 0) || o.time_scale > 10) {
    GPUCAST_USER_ERROR("step time: time_scale should be in (0, 10], got {}", o.time_scale);
  }
  const double k = o.time_scale;
  for (const IterationTiming& p : probes) {
    opt.emplace_back(p.batch, k * p.optimizer_ns);
    other.emplace_back(p.batch, k * p.other_ns);
    for (const LayerTiming& l : p.layers) {
      pts[l.layer].first.emplace_back(p.batch, k * l.forward_ns);
      pts[l.layer].second.emplace_back(p.batch, k * l.backward_ns);
    }
  }
  double optimizer_ns = 0;
  for (auto [x, y] : opt) optimizer_ns += y / static_cast<double>(opt.size());
  f.optimizer_ms = optimizer_ns / 1e6;
  f.other_ms = fit_at(other, b) / 1e6;
  std::vector<std::pair<int64_t, size_t>> bwd_order;
  for (const LayerTiming& l : ref.layers) {
    auto& [fw, bw] = pts[l.layer];
    LayerForecast lf{l.layer, fit_at(fw, b) / 1e6, fit_at(bw, b) / 1e6, l.grad_bytes};
    f.forward_ms += lf.forward_ms;
    f.backward_ms += lf.backward_ms;
    bwd_order.emplace_back(l.backward_order, f.per_layer.size());
    f.per_layer.push_back(std::move(lf));
  }
  f.compute_ms = f.forward_ms + f.backward_ms + f.optimizer_ms + f.other_ms;
  f.step_ms = f.compute_ms;
  if (o.dp > 1) {
    if (o.dp_mode != "ddp") {
      GPUCAST_USER_ERROR("parallel: the step-time forecast models dp_mode 'ddp' only so far, got '{}'", o.dp_mode);
    }
    if (!o.have_link) {
      f.notes.push_back("no all-reduce link given (gpucast.calibrate() or a device table): communication not counted");
      return f;
    }
    // Backward runs after forward and "other" (taken before it: the loss, zero_grad); gradients become ready at
    // the end of their layer's backward, in backward order.
    std::sort(bwd_order.begin(), bwd_order.end());
    double t = f.other_ms + f.forward_ms;
    const double backward_end = t + f.backward_ms;
    BucketForecast cur;
    double prev_end = 0;
    auto flush = [&](double ready) {
      if (cur.bytes == 0) return;
      cur.ready_ms = ready;
      cur.start_ms = std::max(ready, prev_end);
      const double us = allreduce_us(static_cast<double>(cur.bytes), o.dp, o.link);
      cur.end_ms = cur.start_ms + us / 1e3;
      f.comm_ms += us / 1e3;
      prev_end = cur.end_ms;
      f.buckets.push_back(cur);
      cur = BucketForecast{};
    };
    for (auto [order, i] : bwd_order) {
      const LayerForecast& l = f.per_layer[i];
      t += l.backward_ms;
      if (l.grad_bytes == 0) continue;
      cur.bytes += l.grad_bytes;
      const int64_t cap = f.buckets.empty() ? o.first_bucket_bytes : o.bucket_bytes;
      if (cur.bytes >= cap) flush(t);
    }
    flush(t);
    f.exposed_comm_ms = std::max(0.0, prev_end - backward_end);
    f.step_ms = f.compute_ms + f.exposed_comm_ms;
  }
  return f;
}

std::string step_time_to_json(const StepTimeForecast& f) {
  json layers = json::array(), buckets = json::array();
  for (const auto& l : f.per_layer) {
    layers.push_back({{"layer", l.layer}, {"forward_ms", l.forward_ms}, {"backward_ms", l.backward_ms},
                      {"grad_bytes", l.grad_bytes}});
  }
  for (const auto& b : f.buckets) {
    buckets.push_back({{"bytes", b.bytes}, {"ready_ms", b.ready_ms}, {"start_ms", b.start_ms}, {"end_ms", b.end_ms}});
  }
  return json{{"batch_size", f.batch_size}, {"per_rank_batch", f.per_rank_batch}, {"dp", f.dp},
              {"step_ms", f.step_ms}, {"compute_ms", f.compute_ms}, {"forward_ms", f.forward_ms},
              {"backward_ms", f.backward_ms}, {"optimizer_ms", f.optimizer_ms}, {"other_ms", f.other_ms},
              {"comm_ms", f.comm_ms}, {"exposed_comm_ms", f.exposed_comm_ms}, {"per_layer", layers},
              {"buckets", buckets}, {"clock", f.clock}, {"notes", f.notes}}
      .dump();
}

std::string iteration_timing_to_json(const IterationTiming& t) {
  json layers = json::array();
  for (const auto& l : t.layers) {
    layers.push_back({{"layer", l.layer}, {"forward_ns", l.forward_ns}, {"backward_ns", l.backward_ns},
                      {"grad_bytes", l.grad_bytes}, {"backward_order", l.backward_order}});
  }
  return json{{"batch", t.batch}, {"wall_ns", t.wall_ns}, {"optimizer_ns", t.optimizer_ns}, {"other_ns", t.other_ns},
              {"clock", t.clock}, {"layers", layers}}
      .dump();
}

IterationTiming iteration_timing_from_json(const std::string& text) {
  IterationTiming t;
  try {
    const json j = json::parse(text);
    t.batch = j.at("batch").get<int64_t>();
    t.wall_ns = j.at("wall_ns").get<double>();
    t.optimizer_ns = j.at("optimizer_ns").get<double>();
    t.other_ns = j.at("other_ns").get<double>();
    t.clock = j.at("clock").get<std::string>();
    for (const json& l : j.at("layers")) {
      t.layers.push_back({l.at("layer").get<std::string>(), l.at("forward_ns").get<double>(),
                          l.at("backward_ns").get<double>(), l.at("grad_bytes").get<int64_t>(),
                          l.at("backward_order").get<int64_t>()});
    }
  } catch (const json::exception& e) {
    GPUCAST_USER_ERROR("iteration timing: not a gpucast iteration timing ({})", e.what());
  }
  return t;
}

}  // namespace gpucast
