// gpucast/files.h: the one way gpucast writes whole files (gpucast/json_input.h reads them).
//
// A write never leaves a half-written file where the user's was: it goes to a temporary file in the same folder,
// is flushed to disk, and replaces the target by rename(2), which POSIX makes atomic within a file system. On any
// failure the temporary file is removed, the target is untouched, and a UserError names the path and the reason.
#pragma once

#include <functional>
#include <ostream>
#include <string>
#include <string_view>

namespace gpucast {

// Writes what `write` puts on the stream (which it may fill piece by piece: nothing is held in memory whole) to
// `path`, atomically.
void write_file_atomically(const std::string& path, const std::function<void(std::ostream&)>& write);
void write_file_atomically(const std::string& path, std::string_view text);

}  // namespace gpucast
