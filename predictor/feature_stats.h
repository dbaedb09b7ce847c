// feature_stats.h (predictor, private): the standardisation both learned models fit on their training features.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace gpucast::detail {

// Per column of `width`-wide rows (each vector holds whole rows, back to back): the mean and the standard
// deviation; a column whose variance is at most 1e-8 (constant over the training set) keeps deviation 1, so that
// standardising it leaves it at 0 instead of dividing by nothing. No rows: means 0, deviations 1.
inline void column_stats(const std::vector<const std::vector<float>*>& rows, int width, std::vector<float>& mean,
                         std::vector<float>& sd) {
  std::vector<double> s(width, 0.0), s2(width, 0.0);
  int64_t count = 0;
  for (const auto* r : rows) {
    for (size_t i = 0; i + width <= r->size(); i += width) {
      for (int j = 0; j < width; ++j) {
        s[j] += (*r)[i + j];
        s2[j] += double((*r)[i + j]) * (*r)[i + j];
      }
      ++count;
    }
  }
  mean.assign(width, 0.f);
  sd.assign(width, 1.f);
  for (int j = 0; j < width; ++j) {
    const double m = count ? s[j] / count : 0.0;
    const double v = count ? s2[j] / count - m * m : 0.0;
    mean[j] = static_cast<float>(m);
    sd[j] = v > 1e-8 ? static_cast<float>(std::sqrt(v)) : 1.f;
  }
}

}  // namespace gpucast::detail
