// gpucast/timed_layers.h: sparse device timing, which ops of a trace get device timers.
//
// A trace may time only some layers on the device (the D-optimal subset the step-time forecast chose): device
// timers (CUPTI correlation, CUDA events) are then taken only around the ops of those layers, their backward
// and the optimizer step, so that timing costs what the chosen layers cost. A layer is a module path (the
// innermost module an op ran in) or "(outside modules)". An op is timed when:
//   - no layers were chosen (everything is timed), or
//   - it runs inside a timed op (its kernels are part of that op's time), or
//   - it belongs to the optimizer step, or
//   - it is a forward op whose innermost module is a chosen layer, or
//   - it is a backward node made by a timed forward op (found by its sequence number, SeqMarks), or
//   - it is work of the autograd engine's for a timed node, outside it: in the engine's record around that node,
//     after it (a broadcast bias's gradient reduced to the bias's shape, a second gradient of a tensor added).
// Plain C++: the tracer calls these inside RecordFunction callbacks (no allocation, no exception there).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

#include "gpucast/trace.h"

namespace gpucast {

inline constexpr const char* kOutsideModules = "(outside modules)";

class TimedLayers {
 public:
  TimedLayers() = default;  // every layer timed
  // Only these layers; an empty list still means every layer. Names are kept as given.
  explicit TimedLayers(std::vector<std::string> layers);
  bool all() const { return layers_.empty(); }
  bool layer_timed(const std::string& path) const { return all() || set_.count(path) > 0; }
  const std::vector<std::string>& layers() const { return layers_; }

 private:
  std::vector<std::string> layers_;
  std::unordered_set<std::string> set_;
};

// Whether one op gets device timers (see above). module_timed: its innermost module (or "(outside modules)")
// is timed; seq_marked: for a backward node, the forward op with its sequence number was timed; after_timed_node:
// the op runs in the engine's record around a node, outside that node, which has run and was timed.
bool op_device_timed(bool all, bool parent_timed, Phase phase, Scope scope, bool module_timed, bool seq_marked,
                     bool after_timed_node = false);

// Which forward sequence numbers were timed, for the backward nodes they make (possibly on another thread).
// A fixed bitmap indexed by the sequence number modulo its size: lock-free, no allocation; every forward op
// sets or clears its bit, so a number seen in an earlier iteration never leaks into a later one, and two
// numbers that share a bit at most time one more node than asked (never one less of the chosen ones, unless
// two forward ops of one iteration collide, 2^20 apart).
class SeqMarks {
 public:
  static constexpr int64_t kBits = int64_t{1} << 20;
  void mark(int64_t seq_nr, bool timed) noexcept;
  bool marked(int64_t seq_nr) const noexcept;

 private:
  std::array<std::atomic<uint64_t>, kBits / 64> words_{};
};

}  // namespace gpucast
