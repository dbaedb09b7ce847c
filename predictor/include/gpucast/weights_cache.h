// gpucast/weights_cache.h: a learned model loaded once per weights file and modification time.
//
// Both learned models (job_model.h, step_gnn.h) are asked many times per process; their weights files are read
// once, and read again only when the file changes. A file that fails to load is remembered the same way, so the
// error is not paid for on every call. Building the network draws its initial weights from torch's default
// generator before the file's replace them: the caller's random stream is put back as it was.
#pragma once

#include <sys/stat.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

namespace gpucast {

// The model in `path` (load(path) the first time, and after the file changed); null with *why set to the load
// error when it does not load.
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
    cache[path] = {mtime, model};
    return model;
  } catch (const std::exception& e) {
    *why = e.what();
    failures[path] = {mtime, *why};
    return nullptr;
  }
}

}  // namespace gpucast
