#include "weights_file.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>

#include "gpucast/error.h"
#include "gpucast/files.h"

namespace gpucast {

namespace {

constexpr char kMagic[8] = {'G', 'P', 'U', 'C', 'A', 'S', 'T', 'J'};

// The 64-bit FNV offset basis and prime (Fowler-Noll-Vo, IETF draft-eastlake-fnv).
uint64_t fnv1a(const char* p, size_t n, uint64_t h = 1469598103934665603ull) {
  for (size_t i = 0; i < n; ++i) {
    h ^= static_cast<unsigned char>(p[i]);
    h *= 1099511628211ull;
  }
  return h;
}

template <typename T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

}  // namespace

void write_weights_file(const std::string& path, const WeightsFile& w) {
  std::string out(kMagic, sizeof(kMagic));
  put<uint32_t>(out, kWeightsFormatVersion);
  put<uint32_t>(out, static_cast<uint32_t>(w.header_json.size()));
  out += w.header_json;
  put<uint32_t>(out, static_cast<uint32_t>(w.tensors.size()));
  for (const WeightsTensor& t : w.tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    if (n != static_cast<int64_t>(t.data.size())) {
      GPUCAST_USER_ERROR("weights tensor '{}': shape holds {} values, data has {}", t.name, n, t.data.size());
    }
    put<uint32_t>(out, static_cast<uint32_t>(t.name.size()));
    out += t.name;
    put<uint32_t>(out, static_cast<uint32_t>(t.shape.size()));
    for (int64_t d : t.shape) put<int64_t>(out, d);
    out.append(reinterpret_cast<const char*>(t.data.data()), t.data.size() * sizeof(float));
  }
  put<uint64_t>(out, fnv1a(out.data(), out.size()));
  write_file_atomically(path, out);
}

WeightsFile read_weights_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) GPUCAST_USER_ERROR("cannot open weights file '{}': {}", path, std::strerror(errno));
  const std::string data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const char* fix = "; retrain with gpucast-train or reinstall gpucast to get the shipped weights";
  if (data.size() < sizeof(kMagic) || std::memcmp(data.data(), kMagic, sizeof(kMagic)) != 0) {
    GPUCAST_USER_ERROR("'{}' is not a gpucast weights file (it does not start with \"GPUCASTJ\"){}", path, fix);
  }
  if (data.size() < sizeof(kMagic) + 8 + 8) {
    GPUCAST_USER_ERROR("weights file '{}' is truncated: {} bytes, shorter than any weights file{}", path, data.size(),
                       fix);
  }
  uint32_t version = 0;
  std::memcpy(&version, data.data() + sizeof(kMagic), 4);
  if (version != kWeightsFormatVersion) {
    GPUCAST_USER_ERROR("weights file '{}' has format version {}; this gpucast reads version {}{}", path, version,
                       kWeightsFormatVersion, fix);
  }
  // The checksum covers everything: a truncated file fails here before any size in it is trusted.
  const size_t body_end = data.size() - 8;
  uint64_t stored = 0;
  std::memcpy(&stored, data.data() + body_end, 8);
  if (stored != fnv1a(data.data(), body_end)) {
    GPUCAST_USER_ERROR("weights file '{}' is corrupt or truncated: its checksum does not match its {} bytes{}", path,
                       data.size(), fix);
  }
  size_t pos = sizeof(kMagic) + 4;
  auto take = [&](size_t n, const char* what) {
    if (body_end < pos || body_end - pos < n) {
      GPUCAST_USER_ERROR("weights file '{}' is corrupt: it ends inside the {}{}", path, what, fix);
    }
    const char* p = data.data() + pos;
    pos += n;
    return p;
  };
  auto u32 = [&](const char* what) {
    uint32_t v;
    std::memcpy(&v, take(4, what), 4);
    return v;
  };
  WeightsFile w;
  const uint32_t header_len = u32("header length");
  w.header_json.assign(take(header_len, "header"), header_len);
  const uint32_t count = u32("tensor count");
  for (uint32_t i = 0; i < count; ++i) {
    WeightsTensor t;
    const uint32_t name_len = u32("tensor name length");
    t.name.assign(take(name_len, "tensor name"), name_len);
    if (invalid_utf8_at(t.name) != std::string::npos) {
      GPUCAST_USER_ERROR("weights file '{}' is corrupt: tensor {}'s name '{}' is not UTF-8{}", path, i,
                         valid_utf8(t.name), fix);
    }
    const uint32_t ndim = u32("tensor rank");
    if (ndim > 8) GPUCAST_USER_ERROR("weights file '{}' is corrupt: tensor '{}' has rank {}{}", path, t.name, ndim, fix);
    // The element count, checked against the file's size after every dimension: no product can overflow.
    int64_t n = 1;
    for (uint32_t d = 0; d < ndim; ++d) {
      int64_t v;
      std::memcpy(&v, take(8, "tensor shape"), 8);
      if (v < 0 || v > (int64_t{1} << 32)) {
        GPUCAST_USER_ERROR("weights file '{}' is corrupt: tensor '{}' has dimension {}{}", path, t.name, v, fix);
      }
      t.shape.push_back(v);
      n *= v;
      if (n > static_cast<int64_t>(body_end)) {
        GPUCAST_USER_ERROR("weights file '{}' is corrupt: tensor '{}' claims more values than the file holds{}", path,
                           t.name, fix);
      }
    }
    const size_t bytes = static_cast<size_t>(n) * sizeof(float);
    const char* src = take(bytes, "tensor data");
    t.data.resize(static_cast<size_t>(n));
    if (n > 0) std::memcpy(t.data.data(), src, bytes);  // an empty vector's data() may be null
    w.tensors.push_back(std::move(t));
  }
  if (pos != body_end) {
    GPUCAST_USER_ERROR("weights file '{}' is corrupt: {} bytes after the last tensor{}", path, body_end - pos, fix);
  }
  return w;
}

}  // namespace gpucast
