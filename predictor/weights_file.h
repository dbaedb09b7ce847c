// weights_file.h (predictor, private): the versioned file the learned models' weights live in (the job-level
// memory model's and the step graph network's), read and written in plain C++.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gpucast {

// Layout (little-endian): 8 bytes magic "GPUCASTJ"; uint32 format version (kWeightsFormatVersion); uint32 header
// length and the header (JSON: model name, feature version, hyperparameters, normalisation, training metadata);
// uint32 tensor count; per tensor: uint32 name length, name, uint32 rank, int64 dims, float32 data; uint64 FNV-1a
// checksum of everything before it.
inline constexpr uint32_t kWeightsFormatVersion = 1;

struct WeightsTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> data;
};

struct WeightsFile {
  std::string header_json;           // free-form JSON object (the model's own fields are checked by the model)
  std::vector<WeightsTensor> tensors;
};

// Writes atomically (a temporary file renamed over `path`).
void write_weights_file(const std::string& path, const WeightsFile& w);
// Validates magic, version, sizes and checksum; errors name the path, what was expected and what was found,
// and say how to get a good file.
WeightsFile read_weights_file(const std::string& path);

}  // namespace gpucast
