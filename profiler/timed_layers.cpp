#include "gpucast/timed_layers.h"

namespace gpucast {

TimedLayers::TimedLayers(std::vector<std::string> layers) : layers_(std::move(layers)) {
  set_.insert(layers_.begin(), layers_.end());
}

bool op_device_timed(bool all, bool parent_timed, Phase phase, Scope scope, bool module_timed, bool seq_marked,
                     bool after_timed_node) {
  if (all || parent_timed || phase == Phase::Optimizer) return true;
  if (scope == Scope::BackwardFunction) return seq_marked;
  if (phase == Phase::Backward) return after_timed_node;
  return phase == Phase::Forward && scope == Scope::Function && module_timed;
}

void SeqMarks::mark(int64_t seq_nr, bool timed) noexcept {
  if (seq_nr < 0) return;
  const auto bit = static_cast<uint64_t>(seq_nr % kBits);
  const uint64_t mask = uint64_t{1} << (bit % 64);
  auto& w = words_[bit / 64];
  if (timed) {
    w.fetch_or(mask, std::memory_order_relaxed);
  } else {
    w.fetch_and(~mask, std::memory_order_relaxed);
  }
}

bool SeqMarks::marked(int64_t seq_nr) const noexcept {
  if (seq_nr < 0) return false;
  const auto bit = static_cast<uint64_t>(seq_nr % kBits);
  return (words_[bit / 64].load(std::memory_order_relaxed) >> (bit % 64) & 1) != 0;
}

}  // namespace gpucast
