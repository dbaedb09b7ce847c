// gpucast/memory_forecast.h: the whole run's peak memory from small traced probes.
//
// Probes are traces of the same training step at small batch sizes (each spanning one or two iterations,
// split at the end of each optimizer step). The forecast checks that the probes have the same structure,
// fits every allocation's size as a function of the batch size, builds the allocation stream of the run at
// the target batch (iteration 1, then a steady-state iteration: taken from the trace when it has two,
// derived from the first otherwise), adds what the target device allocates that the probes could not show,
// applies the parallel strategy, and replays the stream: through the caching-allocator model for a GPU,
// as plain running totals for target "cpu".
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "gpucast/allocator_sim.h"
#include "gpucast/note.h"
#include "gpucast/parallel.h"
#include <nlohmann/json.hpp>

#include "gpucast/trace.h"

namespace gpucast {

// A row of the documented device table (docs/user-guide.md: "Devices and GPU rates").
struct DeviceSpec {
  std::string name;              // "H100-80GB"
  int64_t capacity_bytes = 0;    // total device memory (cudaMemGetInfo total)
  int compute_capability = 0;    // 90 for 9.0
  int64_t context_bytes = 0;     // CUDA context and kernels: held outside the caching allocator
  std::string source;            // where the numbers come from
  // The usual node of this GPU, in the link grammar (comm_model.h): what a forecast with data, tensor or pipeline
  // parallelism over this target assumes for its collectives when neither link= nor a calibration is given.
  std::string default_link;
};

const std::vector<DeviceSpec>& device_table();
// Throws UserError listing the known names for an unknown one. Case-insensitive; "cpu" is not a device here.
const DeviceSpec& find_device(const std::string& name);
// The same, nullptr for a name the table does not have.
const DeviceSpec* lookup_device(const std::string& name);
// The table's names, comma-separated ("cpu" first): what errors about a target list.
std::string known_targets();
// The one rule for a forecast's target name: "cpu", a device table name (returned as the table spells it), or, with
// a capacity (capacity_bytes > 0), any other name, returned as given (a GPU the table lacks). Case-insensitive.
// Throws UserError naming the known targets otherwise, before any probe runs.
std::string canonical_target(const std::string& name, int64_t capacity_bytes);
// cuBLAS workspace per handle and stream, as PyTorch sizes it (CUBLAS_WORKSPACE_CONFIG ":SIZE_KiB:COUNT..."
// overrides; empty means unset). Throws UserError for a malformed value.
int64_t cublas_workspace_bytes(int compute_capability, const std::string& cublas_workspace_config);
// CUDNN_CONV_WSCAP_DBG (a whole number of MiB) in bytes; -1 when empty (unset). Throws UserError otherwise.
int64_t cudnn_conv_wscap_bytes(const std::string& cudnn_conv_wscap);


struct MemoryForecastInput {
  std::vector<const Trace*> probes;     // same step at probe_batch sizes
  std::vector<int64_t> probe_batch;
  int64_t target_batch = 0;             // global batch: each rank runs target_batch / (dp * micro_batches)
  // Sequence-length scaling, when asked: the probes' sequence lengths (one per probe) and the target's. Sizes
  // are then fitted over {1, b, L, b L, b L^2} (at least five probes with three lengths and three batches).
  std::vector<int64_t> probe_seq;
  int64_t target_seq = 0;
  // Device whose events the probes recorded ("cpu", "cuda:0", or "meta": meta probes, read as CPU probes are, their
  // CPU blocks with their meta ones; a GPU target only).
  std::string probe_device = "cpu";
  std::string target = "cpu";           // "cpu" or a device table name
  int64_t capacity_bytes = 0;           // overrides the table's capacity when > 0
  double safety_fraction = 0.9;         // for max_batch_size
  AllocatorConfig allocator;
  ParallelConfig parallel;
  std::string cublas_workspace_config;  // CUBLAS_WORKSPACE_CONFIG, empty if unset
  // cuDNN's workspace per convolution call (forward, and backward), for a GPU target from CPU probes: >= 0 is
  // modelled at every convolution; -1 (unknown) models CUDNN_CONV_WSCAP_DBG's cap when that is set (an upper
  // bound), else none, and the forecast reports how large it may be without changing the peaks.
  int64_t conv_workspace_bytes = -1;
  std::string cudnn_conv_wscap;         // CUDNN_CONV_WSCAP_DBG, empty if unset
  // Probes on the GPU: cuDNN's workspace per call measured at the target batch, keyed "<module>|forward" and
  // "<module>|backward" (the module of the call's op, its phase). Replaces what the probes' calls allocated and
  // freed inside; calls without an entry keep their probes' scratch and report the headroom.
  std::map<std::string, int64_t> conv_workspaces;
  // CPU probes for the CPU target: the scratch each matrix-multiply call takes at the per-rank batch
  // `op_workspace_batch` (oneDNN sizes its scratchpad by the problem's blocking, not in proportion to the batch),
  // measured by running the call alone at that size: keyed by the call's op in the largest probe's trace (its
  // index). At that batch the call's scratch (what it allocates and frees inside) is replaced by one block of the
  // measured bytes over what the call returns; other batches keep the probes' scratch, scaled.
  std::map<int64_t, int64_t> op_workspaces;
  int64_t op_workspace_batch = 0;
  std::vector<uint64_t> exclude_ptrs;   // baseline blocks that are not the job's (the forecaster's own copies)
  // Routed layers (mixture of experts): the share of a call's tokens each of its k most-loaded experts receives in
  // the bound the peaks are forecast for, in (0, 1]. 1: every token's k experts are the same k (the heaviest routing
  // without a capacity factor);
  // below the even share k / experts, the even share.
  double moe_skew = 1.0;
};

// Routed layers (mixture of experts) in the probes: the peak under routing spread evenly over the experts
// (expected) and under moe_skew (bound; MemoryForecast's peaks are the bound's).
struct MoeForecast {
  int64_t routed_calls = 0;       // routed layer calls in the largest probe's trace (each layer, each iteration)
  int64_t experts = 0;            // the most experts one call ran
  int64_t top_k = 0;              // tokens sent to experts over tokens entering (the largest of the calls')
  double skew = 1.0;
  int64_t routed_allocations = 0;       // allocations sized by an expert's load
  int64_t unexplained_allocations = 0;  // allocations in routed calls sized neither by the batch nor by a load
  int64_t expected_peak_allocated_bytes = 0;
  int64_t expected_peak_reserved_bytes = 0;
  int64_t bound_peak_allocated_bytes = 0;
  int64_t bound_peak_reserved_bytes = 0;
};

// What a group of data-parallel ranks that hold alike peak at (FSDP2's last ranks hold fewer rows of a parameter
// whose rows do not divide evenly; ZeroRedundancyOptimizer's partition gives each rank its own share).
struct RankMemory {
  std::vector<int64_t> ranks;         // data-parallel ranks, in order
  int64_t peak_allocated_bytes = 0;
  int64_t peak_reserved_bytes = 0;
  std::map<std::string, int64_t> breakdown;  // bytes by category at that peak
};

struct MemoryForecast {
  std::string target;
  int64_t batch_size = 0;
  int64_t per_rank_batch = 0;
  int64_t seq_len = 0;                // target sequence length when scaled by it, else 0
  int64_t peak_allocated_bytes = 0;   // torch.cuda.max_memory_allocated() over the run (cpu: bytes held)
  int64_t peak_reserved_bytes = 0;    // torch.cuda.max_memory_reserved() (cpu: == allocated)
  int64_t first_iteration_peak_bytes = 0;
  int64_t steady_peak_bytes = 0;
  int64_t capacity_bytes = 0;         // 0 for cpu
  int64_t outside_allocator_bytes = 0;  // CUDA context, NCCL buffers: not in the allocator's counters
  int64_t max_batch_size = 0;         // largest global batch whose reserved + outside fits capacity x safety
  double fragmentation = 0.0;
  std::map<std::string, int64_t> breakdown;  // bytes by category at the peak
  std::string peak_phase;
  std::string peak_op;
  std::string peak_module;
  int peak_iteration = 0;             // 1 or 2
  bool scaled = true;                 // false when the probes' structures differ
  // A rule the forecast applied has not been matched to its engine (tensor and pipeline parallelism, ZeRO-2, FSDP):
  // the peaks may be off either way; the reason says which rule and what is known of its error. Also a warning.
  bool approximate = false;
  std::string approximate_reason;
  // Per group of data-parallel ranks that hold alike (one group without data parallelism); peak_* above are the
  // largest group's. Tensor- and pipeline-parallel ranks are not told apart yet.
  std::vector<RankMemory> per_rank;
  int64_t nonlinear_allocations = 0;  // allocations whose size is not linear in the batch size
  int64_t allocations = 0;            // allocations in the forecast stream
  // GPU targets from CPU probes: convolution calls of one iteration (forward and backward), the cuDNN workspace
  // modelled at each (-1: not known, none modelled), and the largest workspace per call that would leave
  // peak_allocated_bytes / peak_reserved_bytes as forecast (-1: not computed, e.g. no convolution).
  int64_t conv_calls = 0;
  int64_t conv_workspace_bytes = -1;
  int64_t conv_workspace_headroom_allocated_bytes = -1;
  int64_t conv_workspace_headroom_reserved_bytes = -1;
  int64_t conv_calls_measured = 0;    // GPU probes: calls whose workspace came from conv_workspaces
  std::vector<Note> warnings;  // what may make the forecast wrong (gpucast.forecast warns of each)
  std::vector<Note> notes;
  double forecast_ms = 0.0;           // time spent forecasting (probes excluded)
  std::optional<MoeForecast> moe;     // routed layers found in the probes, else none
};

MemoryForecast forecast_memory(const MemoryForecastInput& input);
// Where two probe traces' allocation structures on `device` first differ (their memory events in order: allocation
// or free, which allocation, in which op), empty when they match: a kernel that allocates otherwise at one size.
std::string probe_structure_difference(const Trace& a, const Trace& b, const std::string& device);
std::string memory_forecast_to_json(const MemoryForecast& f);
// The same document as a value (auto mode's log record holds it).
nlohmann::json memory_forecast_json(const MemoryForecast& f);

}  // namespace gpucast
