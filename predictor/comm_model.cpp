#include "gpucast/comm_model.h"

#include <cmath>
#include <sstream>

#include "gpucast/error.h"

namespace gpucast {

double allreduce_us(double bytes, int64_t ranks, const Link& link, Algorithm algo) {
  if (ranks <= 1 || bytes <= 0) return 0.0;
  const double n = static_cast<double>(ranks);
  if (algo == Algorithm::Tree) {
    return bytes / link.bytes_per_us + 2.0 * std::log2(n) * link.alpha_us;
  }
  return 2.0 * (n - 1.0) / n * bytes / link.bytes_per_us + 2.0 * (n - 1.0) * link.alpha_us;
}

double reduce_scatter_us(double bytes, int64_t ranks, const Link& link) {
  if (ranks <= 1 || bytes <= 0) return 0.0;
  const double n = static_cast<double>(ranks);
  return (n - 1.0) / n * bytes / link.bytes_per_us + (n - 1.0) * link.alpha_us;
}

double all_gather_us(double bytes, int64_t ranks, const Link& link) { return reduce_scatter_us(bytes, ranks, link); }

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
  if (std::abs(det) < 1e-300) GPUCAST_USER_ERROR("fit: the all-reduce samples do not determine a link");
  const double x = (sut * svv - svt * suv) / det;
  const double a = (suu * svt - suv * sut) / det;
  if (x <= 0) GPUCAST_USER_ERROR("fit: the all-reduce samples give a non-positive bandwidth");
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

}  // namespace gpucast
