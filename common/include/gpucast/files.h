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

// Appends `line` (no newline of its own) as one line to the JSON Lines file at `path`, created if missing, in one
// write(2) with O_APPEND: concurrent appenders do not interleave within a line. Only regular files: a FIFO, a device
// or a socket is refused, and the file is opened without blocking, so that a log path never stalls the caller. A
// last line cut short (a killed writer) gets a newline first, so the new line is never glued onto it. Throws
// UserError naming the path and the reason.
void append_line(const std::string& path, std::string_view line);
// Whether append_line could write `path` now, without creating or opening it: "" if so, else why not.
std::string append_line_problem(const std::string& path);

}  // namespace gpucast
