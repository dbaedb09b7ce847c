// Whole-file reads and atomic writes (gpucast/files.h): a failed write leaves the file that was there.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>

#include <sys/stat.h>

#include "gpucast/error.h"
#include "gpucast/files.h"
#include "gpucast/json_input.h"

namespace fs = std::filesystem;
using namespace gpucast;

namespace {

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

class Files : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("gpucast_files_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
                                        "_" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  int entries() const { return static_cast<int>(std::distance(fs::directory_iterator(dir_), fs::directory_iterator())); }
  fs::path dir_;
};

TEST_F(Files, WritesAndReadsBack) {
  const std::string p = (dir_ / "t.json").string();
  write_file_atomically(p, std::string_view("{\"a\": 1}"));
  EXPECT_EQ(read_text_file(p), "{\"a\": 1}");
  write_file_atomically(p, std::string_view("[]"));  // replaces
  EXPECT_EQ(read_text_file(p), "[]");
  EXPECT_EQ(entries(), 1);  // no temporary file left beside it
}

TEST_F(Files, AFailedWriteLeavesTheOldFileAndNoTemporary) {
  const std::string p = (dir_ / "t.json").string();
  write_file_atomically(p, std::string_view("old trace"));
  try {
    write_file_atomically(p, [](std::ostream& out) {
      out << "half of a new";
      throw std::runtime_error("disk full");
    });
    FAIL();
  } catch (const UserError& e) {
    EXPECT_EQ(std::string(e.what()), "cannot write '" + p + "': disk full; the file there, if any, is unchanged");
  }
  EXPECT_EQ(read_text_file(p), "old trace");
  EXPECT_EQ(entries(), 1);
}

TEST_F(Files, UnwritableAndUnreadablePathsAreNamed) {
  try {
    write_file_atomically("/nonexistent-dir/t.json", std::string_view("{}"));
    FAIL();
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(),
                 "cannot write '/nonexistent-dir/t.json': No such file or directory; give a path in a writable directory");
  }
  try {
    parse_json_file((dir_ / "missing.json").string(), nullptr);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_EQ(std::string(e.what()), "cannot read '" + (dir_ / "missing.json").string() + "': No such file or directory");
  }
}

// A file is checked in 1 MiB pieces: a UTF-8 sequence that straddles two pieces is whole, a bad byte or deep
// nesting anywhere is named by its byte, as for a text.
TEST_F(Files, JsonFilesAreCheckedPieceByPiece) {
  const std::string p = (dir_ / "big.json").string();
  std::string text = "[\"" + std::string((size_t{1} << 20) - 3, 'a') + "\xc3\xa9\"]";  // the é at bytes 2^20-1, 2^20
  write_file_atomically(p, std::string_view(text));
  EXPECT_EQ(parse_json_file(p, nullptr)[0].get<std::string>().size(), (size_t{1} << 20) - 1);
  text[text.size() - 4] = '\xff';  // the é's lead byte, the last of the first piece
  write_file_atomically(p, std::string_view(text));
  try {
    parse_json_file(p, nullptr);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_EQ(std::string(e.what()), p + ": malformed JSON at byte " + std::to_string(text.size() - 3) +
                                         ": not UTF-8 (byte 0xFF)");
  }
  write_file_atomically(p, std::string(70, '[') + std::string(70, ']'));
  try {
    parse_json_file(p, nullptr);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_EQ(std::string(e.what()), p + ": malformed JSON at byte 65: nested more than 64 levels deep");
  }
}


TEST_F(Files, AppendLineAddsOneLineAndMendsATornOne) {
  const std::string path = (dir_ / "log.jsonl").string();
  append_line(path, R"({"a": 1})");
  append_line(path, R"({"b": 2})");
  EXPECT_EQ(read_text_file(path), "{\"a\": 1}\n{\"b\": 2}\n");
  {  // a writer killed mid-line
    std::ofstream out(path, std::ios::app | std::ios::binary);
    out << "{\"c\": ";
  }
  append_line(path, R"({"d": 4})");
  EXPECT_EQ(read_text_file(path), "{\"a\": 1}\n{\"b\": 2}\n{\"c\": \n{\"d\": 4}\n");
  EXPECT_EQ(append_line_problem(path), "");
  EXPECT_EQ(append_line_problem((dir_ / "new.jsonl").string()), "");  // creatable: not created by the check
  EXPECT_FALSE(fs::exists(dir_ / "new.jsonl"));
}

TEST_F(Files, AppendLineRefusesWhatIsNotARegularFileWithoutBlocking) {
  const std::string fifo = (dir_ / "log.fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);  // no reader: a blocking open for writing would wait forever
  EXPECT_EQ(append_line_problem(fifo), "not a regular file (gpucast appends logs to regular files only)");
  try {
    append_line(fifo, "{}");
    FAIL();
  } catch (const UserError& e) {
    EXPECT_EQ(std::string(e.what()), "[gpucast:file-write] cannot append to '" + fifo +
                                         "': not a regular file (gpucast appends logs to regular files only)");
  }
  const std::string missing = (dir_ / "no" / "log.jsonl").string();
  EXPECT_EQ(append_line_problem(missing), "its folder '" + (dir_ / "no").string() + "': No such file or directory");
  EXPECT_THROW(append_line(missing, "{}"), UserError);
}

}  // namespace

