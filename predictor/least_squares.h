// least_squares.h (predictor, private): the one least-squares solver of the forecasts (the step time's fits over
// batch and sequence length, the memory forecast's fits of allocation sizes).
#pragma once

#include <vector>

namespace gpucast::detail {

struct LeastSquaresFit {
  std::vector<double> coef;  // one per column; 0 for a column left unresolved
  bool full_rank = true;     // false: some column is (numerically) a combination of the others
};

// Least squares for y ~ X c over the rows of X (each row as wide as the first; at most 8 columns), by the normal
// equations solved by Gauss-Jordan elimination with partial pivoting. Each column is first scaled to a unit
// diagonal of X^T X, so that the tolerance means the same for columns of any magnitude (1, b, L, b L, b L^2 span
// six decades). A column whose pivot falls below kSingularPivot of its scaled diagonal is left unresolved: its
// coefficient is 0 and the others solve the system without it. No rows: every coefficient 0, not full rank.
LeastSquaresFit least_squares(const std::vector<std::vector<double>>& rows, const std::vector<double>& y);

// A pivot this small against the column's own scaled diagonal (1) is rounding, not information: with exact
// collinearity the scaled pivot comes out near machine epsilon (1e-16); a real column keeps a pivot many orders
// above it.
inline constexpr double kSingularPivot = 1e-13;

}  // namespace gpucast::detail
