#include "gpucast/comm_model.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <sstream>

#include "gpucast/config.h"
#include "gpucast/error.h"

namespace gpucast {

namespace {

double ring_model_us(double bytes, double n, const Link& link) {
  return 2.0 * (n - 1.0) / n * bytes / link.bytes_per_us + 2.0 * (n - 1.0) * link.alpha_us;
}

// Measured samples (sorted by size, not empty) at `bytes`: linear between neighbours inside them; outside,
// `model` shifted to pass through the nearest sample (not below 0).
template <typename Model>
double interpolate_samples(double bytes, const std::vector<CollectiveSample>& s, Model model) {
  if (bytes <= s.front().bytes) return std::max(0.0, s.front().us + model(bytes) - model(s.front().bytes));
  if (bytes >= s.back().bytes) return s.back().us + model(bytes) - model(s.back().bytes);
  const auto hi = std::upper_bound(s.begin(), s.end(), bytes, [](double b, const CollectiveSample& x) { return b < x.bytes; });
  const auto lo = hi - 1;
  return lo->us + (hi->us - lo->us) * (bytes - lo->bytes) / (hi->bytes - lo->bytes);
}

// The measured samples where they apply (ring, the rank count they were measured on); < 0 otherwise.
double from_samples_us(double bytes, int64_t ranks, const Link& link, const std::vector<CollectiveSample>& s) {
  if (s.empty() || ranks != link.sample_ranks) return -1.0;
  const double n = static_cast<double>(ranks);
  return interpolate_samples(bytes, s, [&](double b) { return ring_model_us(b, n, link); });
}

double from_samples_us(double bytes, int64_t ranks, const Link& link) {
  return from_samples_us(bytes, ranks, link, link.samples);
}

}  // namespace

double allreduce_us(double bytes, int64_t ranks, const Link& link, Algorithm algo, double idle_us) {
  if (ranks <= 1 || bytes <= 0) return 0.0;
  const double n = static_cast<double>(ranks);
  const double measured = from_samples_us(bytes, ranks, link);
  if (measured < 0) {
    return algo == Algorithm::Tree ? bytes / link.bytes_per_us + 2.0 * std::log2(n) * link.alpha_us
                                   : ring_model_us(bytes, n, link);
  }
  const double g0 = link.samples_gap_us, g1 = link.late_gap_us;
  if (idle_us <= g0 || link.late_samples.empty() || !(g0 > 0) || !(g1 > g0)) return measured;
  const double late = from_samples_us(bytes, ranks, link, link.late_samples);
  const double w = idle_us >= g1 ? 1.0 : std::log(idle_us / g0) / std::log(g1 / g0);
  return measured + w * (late - measured);
}

double send_us(double bytes, const Link& link) {
  if (bytes <= 0) return 0.0;
  auto model = [&](double b) { return link.alpha_us + b / link.bytes_per_us; };
  return link.send_samples.empty() ? model(bytes) : interpolate_samples(bytes, link.send_samples, model);
}

namespace {

// Half an all-reduce: its samples where they apply, else the ring model's traffic and steps.
double half_allreduce_us(double bytes, int64_t ranks, const Link& link) {
  const double n = static_cast<double>(ranks);
  const double measured = from_samples_us(bytes, ranks, link);
  if (measured >= 0) return measured / 2.0;
  return (n - 1.0) / n * bytes / link.bytes_per_us + (n - 1.0) * link.alpha_us;
}

double gather_or_scatter_us(double bytes, int64_t ranks, const Link& link, const std::vector<CollectiveSample>& s) {
  if (ranks <= 1 || bytes <= 0) return 0.0;
  if (s.empty() || ranks != link.sample_ranks) return half_allreduce_us(bytes, ranks, link);
  const double n = static_cast<double>(ranks);
  return interpolate_samples(bytes, s, [&](double b) { return ring_model_us(b, n, link) / 2.0; });
}

}  // namespace

double reduce_scatter_us(double bytes, int64_t ranks, const Link& link) {
  return gather_or_scatter_us(bytes, ranks, link, link.reduce_scatter_samples);
}

double all_gather_us(double bytes, int64_t ranks, const Link& link) {
  return gather_or_scatter_us(bytes, ranks, link, link.all_gather_samples);
}

double broadcast_us(double bytes, int64_t ranks, const Link& link) {
  if (ranks <= 1 || bytes <= 0) return 0.0;
  const double n = static_cast<double>(ranks);
  return half_allreduce_us(bytes * n / (n - 1.0), ranks, link);
}

Link fit_ring_allreduce(const std::vector<CollectiveSample>& samples, int64_t ranks) {
  if (samples.size() < 2) GPUCAST_USER_ERROR("fit: at least two all-reduce samples are needed, got {}", samples.size());
  if (ranks < 2) GPUCAST_USER_ERROR("fit: an all-reduce needs at least 2 ranks, got {}", ranks);
  // T = x * u + a * v with u = 2(N-1)/N * S (x = 1/B) and v = 2(N-1) (a = alpha); weights 1/T^2 on squares.
  const double n = static_cast<double>(ranks);
  double suu = 0, svv = 0, suv = 0, sut = 0, svt = 0;
  for (const CollectiveSample& s : samples) {
    if (s.us <= 0 || s.bytes <= 0) continue;
    const double w = 1.0 / (s.us * s.us);
    const double u = 2.0 * (n - 1.0) / n * s.bytes, v = 2.0 * (n - 1.0);
    suu += w * u * u;
    svv += w * v * v;
    suv += w * u * v;
    sut += w * u * s.us;
    svt += w * v * s.us;
  }
  const double det = suu * svv - suv * suv;
  // 1e-300: a chosen guard against a singular system, near the smallest normal double.
  if (std::abs(det) < 1e-300) GPUCAST_USER_ERROR("fit: the all-reduce samples do not determine a link");
  const double x = (sut * svv - svt * suv) / det;
  const double a = (suu * svt - suv * sut) / det;
  if (x <= 0) GPUCAST_USER_ERROR_CODE("link-bandwidth", "fit: the all-reduce samples give a non-positive bandwidth");
  return Link{std::max(a, 0.0), 1.0 / x};
}

std::vector<CollectiveSample> parse_nccl_tests_csv(const std::string& text, const std::string& source) {
  std::vector<CollectiveSample> out;
  std::istringstream in(text);
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.empty() || line.rfind("size", 0) == 0) continue;
    std::istringstream cells(line);
    std::string size, count, type, time;
    if (!std::getline(cells, size, ',') || !std::getline(cells, count, ',') || !std::getline(cells, type, ',') ||
        !std::getline(cells, time, ',')) {
      GPUCAST_USER_ERROR("{}: line {}: expected size(B),count,type,time(ns),...; got '{}'", source, lineno, line);
    }
    try {
      out.push_back(CollectiveSample{std::stod(size), std::stod(time) / 1000.0});
    } catch (const std::exception&) {
      GPUCAST_USER_ERROR("{}: line {}: size and time must be numbers, got '{}'", source, lineno, line);
    }
  }
  return out;
}

const std::vector<Interconnect>& interconnect_table() {
  // Bus bandwidth in bytes per microsecond (1 GB/s = 1000 B/us), as nccl-tests reports it for a ring
  // all-reduce of large messages; alpha per ring step.
  static const std::vector<Interconnect> table = {
      // nvlink3-5: bench/results/neusight_parallel.txt:1 (alpha 9.00 us, 218.4 GB/s), scaled by the NVLink
      // datasheets' per-GPU bandwidths (600 / 900 / 1800 GB/s).
      {"nvlink3", {9.0, 218400.0}, "A100 SXM4 NVLink 3 (600 GB/s per GPU): ring fitted to vTrain's A100 4-GPU nccl-tests table"},
      {"nvlink4", {9.0, 327600.0}, "H100 SXM NVLink 4 (900 GB/s per GPU): nvlink3's fit scaled by 900/600"},
      {"nvlink5", {9.0, 655200.0}, "B200 NVLink 5 (1800 GB/s per GPU): nvlink3's fit scaled by 1800/600"},
      // pcie*, ib-*, eth-100g: no measurement here. Link rates from the specifications (PCI-SIG PCIe 3.0 / 4.0 /
      // 5.0 x16: 16 / 32 / 64 GB/s per direction; InfiniBand HDR 200 and NDR 400 Gb/s; IEEE 802.3 100 Gb/s); the bus
      // bandwidths a chosen 62.5 % of PCIe's rate and 92 / 88 % of the NICs', the alphas (10 / 15 / 30 us) chosen.
      {"pcie3", {10.0, 10000.0}, "PCIe 3.0 x16 (16 GB/s per direction), nominal nccl-tests bus bandwidth"},
      {"pcie4", {10.0, 20000.0}, "PCIe 4.0 x16 (32 GB/s per direction), nominal nccl-tests bus bandwidth"},
      {"pcie5", {10.0, 40000.0}, "PCIe 5.0 x16 (64 GB/s per direction), nominal nccl-tests bus bandwidth"},
      {"ib-hdr", {15.0, 23000.0}, "InfiniBand HDR 200 Gb/s, one NIC per GPU, nominal nccl-tests bus bandwidth"},
      {"ib-ndr", {15.0, 46000.0}, "InfiniBand NDR 400 Gb/s, one NIC per GPU, nominal nccl-tests bus bandwidth"},
      {"eth-100g", {30.0, 11000.0}, "100 Gb/s Ethernet (RoCE), one NIC per GPU, nominal nccl-tests bus bandwidth"},
  };
  return table;
}

const Interconnect& find_interconnect(const std::string& name) {
  const std::string lower = ascii_lower(name);
  std::string names;
  for (const Interconnect& i : interconnect_table()) {
    if (i.name == lower) return i;
    names += (names.empty() ? "" : ", ") + i.name;
  }
  GPUCAST_USER_ERROR("link: unknown interconnect '{}'; known: {}", name, names);
}

std::vector<ConfigKey> link_config_keys() {
  using F = ConfigKey::Form;
  return {
      {"intra", F::String, std::string(), {}, "interconnect inside a node (interconnect table)"},
      {"alpha_us", F::String, std::string(), {}, "intra-node latency per ring step, microseconds"},
      {"bytes_per_us", F::String, std::string(), {}, "intra-node bus bandwidth, bytes per microsecond"},
      {"gpus_per_node", F::NonNegativeInt, int64_t{0}, {}, "GPUs in one node (0: one node)"},
      {"inter", F::String, std::string(), {}, "interconnect between nodes (interconnect table)"},
      {"inter_alpha_us", F::String, std::string(), {}, "inter-node latency per ring step"},
      {"inter_bytes_per_us", F::String, std::string(), {}, "inter-node bus bandwidth per GPU"},
      {"samples", F::String, std::string(), {}, "measured intra-node all-reduces: BYTES/US;BYTES/US;..."},
      {"ranks", F::PositiveInt, int64_t{0}, {}, "the rank count the samples were measured on"},
      {"samples_gap_us", F::String, std::string("0"), {},
       "the compute before each of the samples, microseconds (the group's idle spell)"},
      {"late_samples", F::String, std::string(), {},
       "all-reduces after a longer idle spell, same ranks: BYTES/US;BYTES/US;..."},
      {"late_gap_us", F::String, std::string("0"), {}, "the idle spell before late_samples"},
      {"overlap", F::Bool, true, {}, "collectives run beside the compute"},
      {"memory_contention", F::String, std::string("1"), {}, "memory-bound slowdown, all ranks at work"},
      {"memory_contention_samples", F::String, std::string(), {},
       "memory-bound slowdown by working set: BYTES/FACTOR;BYTES/FACTOR;..."},
      {"compute_contention", F::String, std::string("1"), {}, "compute-bound slowdown, all ranks at work"},
      // 5: a chosen default where calibrate() has not measured it (it measured 1.96-1.97 on the 2-core host of
      // bench/results/fsdp_live.txt); keep it equal to Topology::balance.
      {"balance", F::String, std::string("5"), {}, "FLOP per byte splitting a layer's time"},
      {"sync_wait_us", F::String, std::string("0"), {},
       "the last rank's lag at a step's first collective, ranks sharing cores"},
      {"drift_compute", F::String, std::string("0"), {},
       "the last rank's lag per unit of compute-bound work since the ranks last met"},
      {"drift_memory", F::String, std::string("0"), {},
       "the last rank's lag per unit of memory-bound work since the ranks last met"},
      {"ddp_overhead_us", F::String, std::string("0"), {},
       "a DDP step's cost outside backward beyond the plain module's, per step"},
      {"ddp_overhead_samples", F::String, std::string(), {},
       "that cost by the gradient bytes per rank: BYTES/US;BYTES/US;..."},
      {"fsdp_overhead_unit_us", F::String, std::string("0"), {},
       "what FSDP spends beside its collectives per unit and micro-batch"},
      {"fsdp_overhead_layer_us", F::String, std::string("0"), {},
       "what FSDP spends beside its collectives per layer with parameters and micro-batch"},
      {"fsdp_overhead_mib_us", F::String, std::string("0"), {},
       "what FSDP spends beside its collectives per MiB of parameters and micro-batch"},
      {"send_samples", F::String, std::string(), {},
       "measured one-way point-to-point sends (pipeline hops): BYTES/US;BYTES/US;..."},
      {"all_gather_samples", F::String, std::string(), {},
       "measured all-gathers by the gathered tensor's bytes (FSDP, ZeRO): BYTES/US;BYTES/US;..."},
      {"reduce_scatter_samples", F::String, std::string(), {},
       "measured reduce-scatters by the scattered tensor's bytes (FSDP, ZeRO): BYTES/US;..."},
      {"algorithm", F::Choice, std::string("ring"), {"ring", "tree"},
       "all-reduce algorithm of the data- and tensor-parallel reductions"},
  };
}

Topology Topology::parse(const std::string& text) {
  Config cfg("link", link_config_keys());
  cfg.parse(text);
  auto number = [&](const char* key, bool positive) {
    const std::string& v = cfg.get_string(key);
    const std::optional<double> x = parse_number(v);
    if (!x || !(positive ? *x > 0 : *x >= 0) || !std::isfinite(*x)) {
      GPUCAST_USER_ERROR("link: '{}' should be a {} number, got '{}'", key, positive ? "positive" : "non-negative", v);
    }
    return *x;
  };
  Topology t;
  t.gpus_per_node = cfg.was_set("gpus_per_node") ? cfg.get_int("gpus_per_node") : 0;
  auto side = [&](const char* name, const char* alpha, const char* bw, bool& have, Link& link) {
    if (cfg.was_set(name)) {
      link = find_interconnect(cfg.get_string(name)).link;
      have = true;
    }
    if (cfg.was_set(alpha) != cfg.was_set(bw)) {
      GPUCAST_USER_ERROR("link: '{}' and '{}' go together; got only '{}'", alpha, bw, cfg.was_set(alpha) ? alpha : bw);
    }
    if (cfg.was_set(alpha)) {
      link = Link{number(alpha, false), number(bw, true)};
      have = true;
    }
  };
  side("intra", "alpha_us", "bytes_per_us", t.have_intra, t.intra);
  side("inter", "inter_alpha_us", "inter_bytes_per_us", t.have_inter, t.inter);
  if (cfg.was_set("samples") != cfg.was_set("ranks")) {
    GPUCAST_USER_ERROR("link: 'samples' and 'ranks' go together; got only '{}'", cfg.was_set("samples") ? "samples" : "ranks");
  }
  // "A/B;A/B;...": positive number pairs, sorted by A.
  auto pairs = [&](const char* key, const char* form, bool zero_second = false) {
    const std::string& text = cfg.get_string(key);
    std::vector<std::pair<double, double>> out;
    size_t start = 0;
    while (start <= text.size()) {
      const size_t end = std::min(text.find(';', start), text.size());
      const std::string item = text.substr(start, end - start);
      const size_t slash = item.find('/');
      std::optional<double> pa, pb;
      if (slash != std::string::npos) {
        pa = parse_number(std::string_view(item).substr(0, slash));
        pb = parse_number(std::string_view(item).substr(slash + 1));
      }
      const double a = pa && pb ? *pa : -1, b = pb ? *pb : -1;
      if (!(a > 0) || !(zero_second ? b >= 0 : b > 0) || !std::isfinite(a) || !std::isfinite(b)) {
        GPUCAST_USER_ERROR("link: '{}' should be {} pairs joined by ';' ({}), got '{}' in '{}'", key, form,
                           zero_second ? "positive bytes, non-negative microseconds" : "positive numbers", item, text);
      }
      out.emplace_back(a, b);
      start = end + 1;
    }
    std::sort(out.begin(), out.end());
    return out;
  };
  if (cfg.was_set("samples")) {
    if (!t.have_intra) GPUCAST_USER_ERROR("link: 'samples' refine an intra-node link: give alpha_us and bytes_per_us too");
    for (auto [bytes, us] : pairs("samples", "BYTES/MICROSECONDS")) t.intra.samples.push_back({bytes, us});
    t.intra.sample_ranks = cfg.get_int("ranks");
  }
  t.intra.samples_gap_us = number("samples_gap_us", false);
  if (cfg.was_set("late_samples")) {
    if (!cfg.was_set("samples")) {
      GPUCAST_USER_ERROR("link: 'late_samples' refine 'samples': give samples and ranks too");
    }
    if (!cfg.was_set("late_gap_us") || !cfg.was_set("samples_gap_us")) {
      GPUCAST_USER_ERROR("link: 'late_samples' need 'samples_gap_us' and 'late_gap_us' (the idle spells before each)");
    }
    for (auto [bytes, us] : pairs("late_samples", "BYTES/MICROSECONDS")) t.intra.late_samples.push_back({bytes, us});
    t.intra.late_gap_us = number("late_gap_us", true);
    if (!(t.intra.late_gap_us > t.intra.samples_gap_us)) {
      GPUCAST_USER_ERROR("link: 'late_gap_us' ({}) should be longer than 'samples_gap_us' ({})",
                         cfg.get_string("late_gap_us"), cfg.get_string("samples_gap_us"));
    }
  } else if (cfg.was_set("late_gap_us")) {
    GPUCAST_USER_ERROR("link: 'late_gap_us' goes with 'late_samples'; got only 'late_gap_us'");
  }
  if (cfg.was_set("send_samples")) {
    if (!t.have_intra) {
      GPUCAST_USER_ERROR("link: 'send_samples' refine an intra-node link: give alpha_us and bytes_per_us too");
    }
    for (auto [bytes, us] : pairs("send_samples", "BYTES/MICROSECONDS")) t.intra.send_samples.push_back({bytes, us});
  }
  for (const char* key : {"all_gather_samples", "reduce_scatter_samples"}) {
    if (!cfg.was_set(key)) continue;
    if (!cfg.was_set("samples")) {
      GPUCAST_USER_ERROR("link: '{}' go with the all-reduce 'samples' and 'ranks' they were measured beside "
                         "(gpucast.calibrate() gives all of them)", key);
    }
    auto& into = std::string(key) == "all_gather_samples" ? t.intra.all_gather_samples : t.intra.reduce_scatter_samples;
    for (auto [bytes, us] : pairs(key, "BYTES/MICROSECONDS")) into.push_back({bytes, us});
  }
  if (cfg.was_set("memory_contention_samples")) {
    for (auto [bytes, factor] : pairs("memory_contention_samples", "BYTES/FACTOR")) {
      t.memory_contention_samples.push_back({bytes, factor});
    }
  }
  t.overlap = cfg.get_bool("overlap");
  t.memory_contention = number("memory_contention", true);
  t.compute_contention = number("compute_contention", true);
  t.balance = number("balance", true);
  t.sync_wait_us = number("sync_wait_us", false);
  t.ddp_overhead_us = number("ddp_overhead_us", false);
  t.fsdp_overhead_unit_us = number("fsdp_overhead_unit_us", false);
  t.fsdp_overhead_layer_us = number("fsdp_overhead_layer_us", false);
  t.fsdp_overhead_mib_us = number("fsdp_overhead_mib_us", false);
  t.algorithm = cfg.get_string("algorithm") == "tree" ? Algorithm::Tree : Algorithm::Ring;
  if (cfg.was_set("ddp_overhead_samples")) {
    for (auto [bytes, us] : pairs("ddp_overhead_samples", "BYTES/MICROSECONDS", true)) {
      t.ddp_overhead_samples.push_back({bytes, us});
    }
  }
  t.drift_compute = number("drift_compute", false);
  t.drift_memory = number("drift_memory", false);
  return t;
}

namespace {

// A value read from samples sorted by bytes: between two, linear in the bytes (or in their log), outside them the
// nearest; `value` picks a sample's value.
template <typename Sample, typename Value>
double between_samples(const std::vector<Sample>& s, double bytes, bool log_bytes, Value value) {
  if (bytes <= s.front().bytes) return value(s.front());
  if (bytes >= s.back().bytes) return value(s.back());
  const auto hi = std::upper_bound(s.begin(), s.end(), bytes, [](double b, const Sample& x) { return b < x.bytes; });
  const auto lo = hi - 1;
  const double w = log_bytes ? std::log(bytes / lo->bytes) / std::log(hi->bytes / lo->bytes)
                             : (bytes - lo->bytes) / (hi->bytes - lo->bytes);
  return value(*lo) + (value(*hi) - value(*lo)) * w;
}

}  // namespace

double Topology::memory_contention_for(double bytes) const {
  if (memory_contention_samples.empty()) return memory_contention;
  return between_samples(memory_contention_samples, bytes, true, [](const ContentionSample& x) { return x.factor; });
}

double Topology::ddp_overhead_for(double grad_bytes) const {
  if (ddp_overhead_samples.empty()) return ddp_overhead_us;
  return between_samples(ddp_overhead_samples, grad_bytes, false, [](const OverheadSample& x) { return x.us; });
}

const Link* Topology::link_for(int64_t ranks, int64_t stride) const {
  const bool inside = gpus_per_node <= 0 || ranks * stride <= gpus_per_node;
  if (inside) return have_intra ? &intra : nullptr;
  return have_inter ? &inter : nullptr;
}

}  // namespace gpucast
