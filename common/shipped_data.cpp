#include "gpucast/shipped_data.h"

#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>

namespace gpucast {

std::string shipped_data_file(const char* env, const char* name) {
  if (const char* v = env != nullptr ? std::getenv(env) : nullptr; v != nullptr && *v != '\0') return v;
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&shipped_data_file), &info) == 0 || info.dli_fname == nullptr) return "";
  std::error_code ec;
  const std::filesystem::path lib = std::filesystem::weakly_canonical(info.dli_fname, ec);
  return (lib.parent_path().parent_path() / "data" / name).string();
}

}  // namespace gpucast
