// Whole-file reads and atomic writes (gpucast/files.h).
#include "gpucast/files.h"

#include <fcntl.h>
#include <sys/stat.h>
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

namespace {

std::string errno_text(int err) { return std::string(std::strerror(err)); }

}  // namespace

std::string append_line_problem(const std::string& path) {
  if (path.empty()) return "the path is empty";
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (!S_ISREG(st.st_mode)) return "not a regular file (gpucast appends logs to regular files only)";
    if (::access(path.c_str(), W_OK) != 0) return errno_text(errno);
    return "";
  }
  if (errno != ENOENT) return errno_text(errno);
  const size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  if (::stat(dir.c_str(), &st) != 0) return fmt::format("its folder '{}': {}", dir, errno_text(errno));
  if (!S_ISDIR(st.st_mode)) return fmt::format("'{}' is not a folder", dir);
  if (::access(dir.c_str(), W_OK | X_OK) != 0) return fmt::format("its folder '{}': {}", dir, errno_text(errno));
  return "";
}

void append_line(const std::string& path, std::string_view line) {
  auto fail = [&](const std::string& why) {
    GPUCAST_USER_ERROR_CODE("file-write", "cannot append to '{}': {}", path, why);
  };
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    fail("not a regular file (gpucast appends logs to regular files only)");
  }
  const int fd = ::open(path.c_str(), O_RDWR | O_APPEND | O_CREAT | O_NONBLOCK | O_CLOEXEC, 0644);
  if (fd < 0) fail(errno_text(errno));
  std::string text;
  if (::fstat(fd, &st) == 0 && !S_ISREG(st.st_mode)) {  // replaced between the two looks
    ::close(fd);
    fail("not a regular file (gpucast appends logs to regular files only)");
  }
  char last = '\n';
  if (st.st_size > 0 && ::pread(fd, &last, 1, st.st_size - 1) == 1 && last != '\n') text.push_back('\n');
  text.append(line);
  text.push_back('\n');
  const ssize_t n = ::write(fd, text.data(), text.size());
  const int err = errno;
  ::close(fd);
  if (n < 0) fail(errno_text(err));
  if (static_cast<size_t>(n) != text.size()) fail(fmt::format("wrote {} of {} bytes", n, text.size()));
}

}  // namespace gpucast
