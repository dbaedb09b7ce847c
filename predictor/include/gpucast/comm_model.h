// gpucast/comm_model.h: the cost of collectives, from alpha-beta models per algorithm.
//
// Ring all-reduce over N ranks moves 2(N-1)/N of the message over each link and takes 2(N-1) latency steps:
//   T = 2(N-1)/N * S / B + 2(N-1) * alpha
// (ScaleDL's T_comm). Tree all-reduce: 2 log2(N) steps of the whole message (pipelined: S / B + 2 log2 N alpha).
// A link's alpha and B come from a documented table or are fitted on measurements (nccl-tests output, or
// gpucast.calibrate() on a live process group).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gpucast/config.h"

namespace gpucast {

struct CollectiveSample {
  double bytes = 0.0;
  double us = 0.0;
};

struct Link {
  Link() = default;
  Link(double alpha, double bandwidth) : alpha_us(alpha), bytes_per_us(bandwidth) {}
  double alpha_us = 0.0;        // latency per step
  double bytes_per_us = 0.0;    // bandwidth of one link (bus bandwidth as nccl-tests reports it)
  // All-reduce times measured on this link over sample_ranks ranks (gpucast.calibrate()), sorted by size. For
  // that rank count, a ring all-reduce inside the measured sizes is interpolated between its neighbours; outside
  // them, the alpha-beta model shifted to pass through the nearest sample.
  std::vector<CollectiveSample> samples;
  int64_t sample_ranks = 0;
  // On hosts whose ranks share the cores (gpucast.calibrate() on CPU backends) a collective is slower the longer
  // the group sat idle before it (its threads and connections wake from a deeper sleep). `samples` were measured
  // after samples_gap_us of compute; late_samples (the same rank count, sorted by size) after late_gap_us. A
  // collective after an idle spell between the two is interpolated linearly in log(gap); shorter spells take
  // `samples`, longer ones late_samples. Empty late_samples: `samples` whatever the gap.
  double samples_gap_us = 0.0;
  std::vector<CollectiveSample> late_samples;
  double late_gap_us = 0.0;
  // One-way point-to-point sends measured on this link (gpucast.calibrate(): half a round trip between two
  // ranks), sorted by size: what a pipeline stage's output and gradient take to the next stage.
  std::vector<CollectiveSample> send_samples;
  // All-gathers and reduce-scatters measured on this link over sample_ranks ranks (gpucast.calibrate()), by the
  // bytes of the whole (gathered, or to be scattered) tensor, sorted by size: what FSDP's and ZeRO's collectives
  // take where they are not half an all-reduce (gloo's reduce-scatter costs a whole one).
  std::vector<CollectiveSample> all_gather_samples;
  std::vector<CollectiveSample> reduce_scatter_samples;
};

enum class Algorithm { Ring, Tree };

// Time of one all-reduce of `bytes` over `ranks` ranks; `idle_us`: how long the group sat idle before it (< 0:
// unknown, the link's `samples`). Ring: 2(N-1)/N S/B + 2(N-1) alpha. Tree (NCCL's double binary tree, its two
// trees pipelined over full-duplex links: every rank receives and sends about S): S/B + 2 log2(N) alpha, a bound
// on what a tree reaches. Measured samples that apply (their rank count) are used for either.
double allreduce_us(double bytes, int64_t ranks, const Link& link, Algorithm algo = Algorithm::Ring,
                    double idle_us = -1.0);
// One point-to-point send of `bytes` (a pipeline hop): inside the link's send_samples interpolated between its
// neighbours, outside them alpha + S/B shifted to pass through the nearest sample; without samples alpha + S/B.
double send_us(double bytes, const Link& link);
// Reduce-scatter and all-gather of `bytes` (the whole tensor): the link's all_gather_samples /
// reduce_scatter_samples for their rank count (interpolated as send_us does, the ring model half an all-reduce's
// traffic and steps outside them); else half the all-reduce (its samples, or the ring model).
double reduce_scatter_us(double bytes, int64_t ranks, const Link& link);
double all_gather_us(double bytes, int64_t ranks, const Link& link);
// Broadcast of `bytes` from one rank (pipelined along the ring): the message once over each link and N-1
// latency steps, an all-gather of bytes * N / (N-1).
double broadcast_us(double bytes, int64_t ranks, const Link& link);

// Least-squares fit of a ring all-reduce link to measured times (weighted by 1/time, so that small and large
// messages count alike). Throws UserError for fewer than two samples or a non-positive fit.
Link fit_ring_allreduce(const std::vector<CollectiveSample>& samples, int64_t ranks);

// A row of the documented interconnect table (docs/user-guide.md: "Devices and GPU rates", interconnects): nominal nccl-tests bus bandwidth
// of a ring all-reduce and a per-step latency.
struct Interconnect {
  std::string name;             // "nvlink4"
  Link link;
  std::string source;
};
const std::vector<Interconnect>& interconnect_table();
// Case-insensitive; throws UserError listing the known names.
const Interconnect& find_interconnect(const std::string& name);

// How much slower memory-bound work runs with every rank at work than alone, for a working set of `bytes` per
// rank (gpucast.calibrate(): copies of several sizes; what fits the shared caches with every rank's beside it
// hardly slows down, what spills to memory shares its bandwidth).
struct ContentionSample {
  double bytes = 0.0;
  double factor = 1.0;
};

// What DDP costs a step outside backward for a model with `bytes` of gradients per rank.
struct OverheadSample {
  double bytes = 0.0;
  double us = 0.0;
};

// Where the ranks sit and what joins them. Ranks are laid out tensor-parallel innermost, then data-parallel,
// then pipeline stages (Megatron's order); a group whose ranks span more than gpus_per_node GPUs crosses
// nodes and runs at the inter-node link (a ring across nodes is bound by the NIC of each GPU).
struct Topology {
  int64_t gpus_per_node = 0;    // 0: every rank in one node
  bool have_intra = false;
  Link intra;                   // the link inside a node (or the one gpucast.calibrate() measured)
  bool have_inter = false;
  Link inter;
  // Ranks sharing the host's cores and memory (gpucast.calibrate() on CPU backends): whether a collective runs
  // beside the compute (false: the ranks' threads fill every core, so its time adds to the step), and how much
  // slower memory-bound and compute-bound work runs when every rank works at once. A layer's time splits into
  // the two by its bytes and FLOPs at `balance` FLOP per byte.
  bool overlap = true;
  double memory_contention = 1.0;
  double compute_contention = 1.0;
  // 5: a chosen default, not measured (calibrate() measured 1.96-1.97 in bench/results/fsdp_live.txt).
  double balance = 5.0;
  // Memory-bound slowdown by working set, sorted by bytes; empty: memory_contention for every working set.
  std::vector<ContentionSample> memory_contention_samples;
  // How much later than the average rank the last one reaches a step's first collective when the ranks share the
  // host's cores (the scheduler's time slices drift them apart while they compute): the data-parallel reductions
  // start that much later. Measured by gpucast.calibrate() on CPU backends; 0 elsewhere.
  double sync_wait_us = 0.0;
  // The same lag per unit of compute since the ranks last met, for compute- and memory-bound work (the lag's
  // mean over its mean time, matmuls and copies, gpucast.calibrate()). Where either is given, the first
  // reduction after a span of compute starts that span times its rate later, instead of sync_wait_us.
  double drift_compute = 0.0;
  double drift_memory = 0.0;
  // What a DDP step costs the ranks outside backward beyond the plain module's forward and optimizer step (the
  // wrapper, and the collective threads' work competing for the shared cores after each reduction), per step.
  // Measured by gpucast.calibrate() on CPU backends; 0 elsewhere.
  double ddp_overhead_us = 0.0;
  // The all-reduce algorithm of the data- and tensor-parallel reductions ("algorithm:tree"; ring by default, which
  // calibrate()'s samples and the nccl-tests tables measure).
  Algorithm algorithm = Algorithm::Ring;
  // The same cost by the gradient bytes a rank reduces (calibrate(): two models of 19 KB and 2.1 MB; the
  // collective threads' aftermath grows with the bytes they moved), sorted by bytes; empty: ddp_overhead_us.
  std::vector<OverheadSample> ddp_overhead_samples;
  // What FSDP spends beside its collectives in a step (its hooks, copies into and out of the gathered buffers,
  // the optimizer over sharded tensors; gpucast.calibrate() on CPU backends): per unit, per layer with parameters
  // and per MiB of parameters, each micro-batch.
  double fsdp_overhead_unit_us = 0.0;
  double fsdp_overhead_layer_us = 0.0;
  double fsdp_overhead_mib_us = 0.0;
  // "intra:nvlink4,gpus_per_node:8,inter:ib-ndr", or numbers: "alpha_us:9,bytes_per_us:230000" (intra),
  // "inter_alpha_us:..,inter_bytes_per_us:..", measured intra samples "samples:65536/120.5;1048576/900,ranks:2",
  // with "samples_gap_us:7000,late_samples:65536/2400;4194304/5100,late_gap_us:34000" after idle spells,
  // and the host's "overlap:False,memory_contention:1.24,compute_contention:1,balance:1.3,sync_wait_us:850",
  // "drift_compute:0.03,drift_memory:0.09",
  // with "memory_contention_samples:2097152/1;33554432/1.36" (BYTES/FACTOR), "ddp_overhead_us:600" and
  // "ddp_overhead_samples:19240/120;2122280/560" (BYTES/MICROSECONDS). Errors name the key.
  static Topology parse(const std::string& text);  // its keys: link_config_keys()
  // The memory-bound slowdown of a working set of `bytes` per rank: between two samples linear in log(bytes),
  // outside them the nearest; memory_contention without samples.
  double memory_contention_for(double bytes) const;
  // DDP's cost outside backward, microseconds per step, for `grad_bytes` of gradients per rank: between two
  // samples linear in the bytes, outside them the nearest; ddp_overhead_us without samples.
  double ddp_overhead_for(double grad_bytes) const;
  // The link of a group of `ranks` ranks whose members are `stride` ranks apart; nullptr when unknown.
  const Link* link_for(int64_t ranks, int64_t stride) const;
};

// nccl-tests all_reduce_perf output as vTrain stores it: "size(B),count,type,time(ns),busbw(GB/s),..." (the
// first time column is out-of-place). Errors name the path and the line.
std::vector<CollectiveSample> parse_nccl_tests_csv(const std::string& text, const std::string& source);

// The keys of the link configuration (Topology::parse), in the configuration grammar (gpucast/config.h), with
// their forms, defaults and meaning: the one list of them (Python asks for it: torch.ops.gpucast.link_keys).
std::vector<ConfigKey> link_config_keys();

}  // namespace gpucast
