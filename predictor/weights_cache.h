// weights_cache.h (predictor, private: it includes LibTorch, which no public header may): the learned models'
// weights in LibTorch: a network's parameters to and from a weights
// file (weights_file.h), and a model loaded once per weights file and modification time.
//
// Both learned models (job_model.h, step_gnn.h) are asked many times per process; their weights files are read
// once, and read again only when the file changes. A file that fails to load is remembered the same way, so the
// error is not paid for on every call. Building the network draws its initial weights from torch's default
// generator before the file's replace them: the caller's random stream is put back as it was.
#pragma once

#include <sys/stat.h>

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "gpucast/error.h"
#include "gpucast/json_input.h"
#include "weights_file.h"

namespace gpucast {

// A weights-file tensor holding `t` (float32).
inline WeightsTensor weights_tensor(const std::string& name, const torch::Tensor& t) {
  const torch::Tensor c = t.detach().contiguous();
  WeightsTensor wt;
  wt.name = name;
  wt.shape = c.sizes().vec();
  wt.data.assign(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  return wt;
}

// The largest weight magnitude a weights file may hold: a thousand times the largest in the shipped files (1.29 in
// job_memory.gcw, 1.22 in step_gnn.gcw; both trained with weight decay). A larger value is a corrupted or forged
// file whose checksum happens to match, and would turn the model's answer into garbage.
inline constexpr float kMaxWeightMagnitude = 1e3f;

// Copies the file's tensors into the network's parameters: one per parameter, by name, of the same shape, every
// value finite; errors name the path and the tensor and end with `fix` (how to get a good file).
inline void load_parameters(torch::nn::Module& net, const WeightsFile& w, const std::string& path,
                            const std::string& fix) {
  std::map<std::string, const WeightsTensor*> by_name;
  for (const auto& t : w.tensors) by_name[t.name] = &t;
  torch::NoGradGuard ng;
  auto params = net.named_parameters(/*recurse=*/true);
  if (params.size() != w.tensors.size()) {
    GPUCAST_USER_ERROR("weights file '{}' has {} tensors, the model has {}{}", path, w.tensors.size(), params.size(),
                       fix);
  }
  for (auto& p : params) {
    auto it = by_name.find(p.key());
    if (it == by_name.end()) GPUCAST_USER_ERROR("weights file '{}' lacks tensor '{}'{}", path, p.key(), fix);
    const WeightsTensor& t = *it->second;
    if (t.shape != p.value().sizes().vec()) {
      GPUCAST_USER_ERROR("weights file '{}': tensor '{}' has shape [{}], the model expects [{}]{}", path, p.key(),
                         fmt::join(t.shape, ","), fmt::join(p.value().sizes().vec(), ","), fix);
    }
    for (float v : t.data) {
      if (!std::isfinite(v) || std::abs(v) > kMaxWeightMagnitude) {
        GPUCAST_USER_ERROR("weights file '{}': tensor '{}' holds {}, outside what training produces (finite, at most "
                           "{:g} in magnitude){}", path, p.key(), v, kMaxWeightMagnitude, fix);
      }
    }
    p.value().copy_(torch::from_blob(const_cast<float*>(t.data.data()), p.value().sizes(), torch::kFloat32));
  }
}

// A feature normalisation from a weights file: `width` finite means and finite deviations > 0 (a zero deviation
// would divide by zero).
inline void check_normalisation(const std::string& path, const char* what, const std::vector<float>& mean,
                                const std::vector<float>& sd, size_t width, const std::string& fix) {
  if (mean.size() != width || sd.size() != width) {
    GPUCAST_USER_ERROR("weights file '{}': {} normalisation has {}/{} values, expected {}{}", path, what, mean.size(),
                       sd.size(), width, fix);
  }
  for (size_t j = 0; j < width; ++j) {
    if (!std::isfinite(mean[j]) || !std::isfinite(sd[j]) || sd[j] <= 0) {
      GPUCAST_USER_ERROR("weights file '{}': {} normalisation {} has mean {} and deviation {} (expected finite, "
                         "deviation > 0){}", path, what, j, mean[j], sd[j], fix);
    }
  }
}

// A weights file's JSON header, checked to hold `model` at `version`; field() returns a key the header must have.
// Errors name the path and end with `fix`.
class WeightsHeader {
 public:
  WeightsHeader(const WeightsFile& w, const std::string& path, const char* model, int version, std::string fix)
      : path_(path), fix_(std::move(fix)) {
    try {
      h_ = parse_json_input(w.header_json, "header");
    } catch (const UserError& e) {
      GPUCAST_USER_ERROR("weights file '{}': {}{}", path_, e.what(), fix_);
    }
    if (field("model") != model) {
      GPUCAST_USER_ERROR("weights file '{}' holds model {}, expected \"{}\"{}", path_, field("model").dump(), model,
                         fix_);
    }
    if (field("model_version") != version) {
      GPUCAST_USER_ERROR("weights file '{}' holds model version {}; this gpucast reads version {}{}", path_,
                         field("model_version").dump(), version, fix_);
    }
  }
  const nlohmann::json& field(const char* key) const {
    if (!h_.is_object() || !h_.contains(key)) {
      GPUCAST_USER_ERROR("weights file '{}': header lacks '{}'{}", path_, key, fix_);
    }
    return h_[key];
  }
  const nlohmann::json& json() const { return h_; }

 private:
  std::string path_, fix_;
  nlohmann::json h_;
};

// The storages (data pointers) of the tensors each loaded model holds, its parameters and buffers: gpucast's own
// memory, which the memory forecast leaves out of what a traced job holds (owned_storages() in job_model.h).
struct OwnedStorages {
  std::mutex mu;
  std::map<const void*, std::vector<int64_t>> by_model;
};
inline OwnedStorages& owned_storage_registry() {
  static OwnedStorages registry;
  return registry;
}
template <typename Net>
void remember_storages(const void* model, Net& net) {
  std::vector<int64_t> ptrs;
  for (const auto& t : net->parameters()) ptrs.push_back(reinterpret_cast<int64_t>(t.storage().data()));
  for (const auto& t : net->buffers()) ptrs.push_back(reinterpret_cast<int64_t>(t.storage().data()));
  OwnedStorages& r = owned_storage_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.by_model[model] = std::move(ptrs);
}
inline void forget_storages(const void* model) {
  OwnedStorages& r = owned_storage_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.by_model.erase(model);
}

// The model in `path` (load(path) the first time, and after the file changed); null with *why set to the load
// error when it does not load. Its tensors' storages are remembered (remember_storages) while it is cached.
template <typename Model>
std::shared_ptr<const Model> cached_model(const std::string& path,
                                          std::shared_ptr<const Model> (*load)(const std::string&), std::string* why) {
  static std::mutex mu;
  static std::map<std::string, std::pair<int64_t, std::shared_ptr<const Model>>> cache;
  static std::map<std::string, std::pair<int64_t, std::string>> failures;
  struct stat st {};
  const int64_t mtime =
      ::stat(path.c_str(), &st) == 0 ? int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec : -1;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find(path); it != cache.end() && it->second.first == mtime) return it->second.second;
  if (auto ft = failures.find(path); ft != failures.end() && ft->second.first == mtime) {
    *why = ft->second.second;
    return nullptr;
  }
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  at::Tensor rng;
  {
    std::lock_guard<std::mutex> g(gen.mutex());
    rng = gen.get_state();
  }
  struct Restore {
    at::Generator& gen;
    at::Tensor& rng;
    ~Restore() {
      std::lock_guard<std::mutex> g(gen.mutex());
      gen.set_state(rng);
    }
  } restore{gen, rng};
  try {
    std::shared_ptr<const Model> model = load(path);
    if (auto old = cache.find(path); old != cache.end()) forget_storages(old->second.second.get());
    remember_storages(model.get(), model->net);
    cache[path] = {mtime, model};
    return model;
  } catch (const std::exception& e) {
    *why = valid_utf8(e.what());  // it goes into a note that is returned as JSON
    failures[path] = {mtime, *why};
    return nullptr;
  }
}

}  // namespace gpucast
