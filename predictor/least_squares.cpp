#include "least_squares.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <utility>

#include "gpucast/error.h"

namespace gpucast::detail {

LeastSquaresFit least_squares(const std::vector<std::vector<double>>& rows, const std::vector<double>& y) {
  const size_t k = rows.empty() ? 0 : rows.front().size();
  if (k > 8 || rows.size() != y.size()) {
    GPUCAST_THROW(std::logic_error, "least_squares: {} rows of {} columns for {} values", rows.size(), k, y.size());
  }
  LeastSquaresFit out;
  out.coef.assign(k, 0.0);
  out.full_rank = !rows.empty();
  if (rows.empty()) return out;
  // The normal equations [X^T X | X^T y], each column scaled by 1 / sqrt of its diagonal.
  std::vector<std::vector<double>> m(k, std::vector<double>(k + 1, 0.0));
  for (size_t r = 0; r < rows.size(); ++r) {
    if (rows[r].size() != k) {
      GPUCAST_THROW(std::logic_error, "least_squares: row {} has {} columns, not {}", r, rows[r].size(), k);
    }
    for (size_t i = 0; i < k; ++i) {
      for (size_t j = 0; j < k; ++j) m[i][j] += rows[r][i] * rows[r][j];
      m[i][k] += rows[r][i] * y[r];
    }
  }
  std::vector<double> scale(k, 0.0);
  for (size_t i = 0; i < k; ++i) scale[i] = m[i][i] > 0 ? 1.0 / std::sqrt(m[i][i]) : 0.0;
  for (size_t i = 0; i < k; ++i) {
    for (size_t j = 0; j < k; ++j) m[i][j] *= scale[i] * scale[j];
    m[i][k] *= scale[i];
  }
  // Gauss-Jordan: column c's pivot is the largest of rows c.. in it; a column without one is left unresolved (its
  // row stays, the other pivots still clear their columns from it).
  std::vector<char> resolved(k, 0);
  for (size_t c = 0; c < k; ++c) {
    size_t piv = c;
    for (size_t r = c + 1; r < k; ++r) {
      if (std::abs(m[r][c]) > std::abs(m[piv][c])) piv = r;
    }
    if (!(std::abs(m[piv][c]) >= kSingularPivot)) {
      out.full_rank = false;
      continue;
    }
    std::swap(m[c], m[piv]);
    resolved[c] = 1;
    for (size_t r = 0; r < k; ++r) {
      if (r == c) continue;
      const double f = m[r][c] / m[c][c];
      for (size_t j = c; j <= k; ++j) m[r][j] -= f * m[c][j];
    }
  }
  for (size_t c = 0; c < k; ++c) out.coef[c] = resolved[c] ? m[c][k] / m[c][c] * scale[c] : 0.0;
  return out;
}

}  // namespace gpucast::detail
