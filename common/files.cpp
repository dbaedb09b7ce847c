// Whole-file reads and atomic writes (gpucast/files.h).
#include "gpucast/files.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "gpucast/error.h"

namespace gpucast {
namespace {

// A name beside `path` that no other writer in this or another process picks: pid and a per-process counter.
std::string temporary_name(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  return fmt::format("{}.tmp.{}.{}", path, static_cast<long>(::getpid()), counter.fetch_add(1));
}

// fsync the file's data so that the rename cannot expose an empty file after a crash of the machine.
void sync_file(const std::string& tmp) {
  const int fd = ::open(tmp.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;  // the data is written; only the crash guarantee is lost
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

void write_file_atomically(const std::string& path, const std::function<void(std::ostream&)>& write) {
  const std::string tmp = temporary_name(path);
  auto fail = [&](const std::string& why) {
    std::remove(tmp.c_str());
    GPUCAST_USER_ERROR("cannot write '{}': {}; the file there, if any, is unchanged", path, why);
  };
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) {
      GPUCAST_USER_ERROR("cannot write '{}': {}; give a path in a writable directory", path, std::strerror(errno));
    }
    try {
      write(out);
    } catch (const std::exception& e) {
      out.close();
      fail(e.what());
    }
    out.flush();
    if (!out) fail(std::strerror(errno != 0 ? errno : EIO));
    out.close();
    if (!out) fail(std::strerror(errno != 0 ? errno : EIO));
  }
  sync_file(tmp);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) fail(std::strerror(errno));
}

void write_file_atomically(const std::string& path, std::string_view text) {
  write_file_atomically(path, [&](std::ostream& out) { out.write(text.data(), static_cast<std::streamsize>(text.size())); });
}

}  // namespace gpucast
