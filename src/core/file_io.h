// File helpers: whole-file reads with errors that name the file, and atomic writes
// (temp file in the same directory, fsync, rename, fsync the directory) so that a crash or
// Ctrl-C never leaves a half-written checkpoint or report behind.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ptllm {

// A text input (training data, a config): at most maxBytes, else an error naming the file.
inline constexpr size_t kMaxTextBytes = size_t(1) << 30;
std::string readTextFile(const std::string& path, size_t maxBytes = kMaxTextBytes);
std::vector<uint8_t> readBinaryFile(const std::string& path);

// Writes `data` to `path` atomically. Throws ptllm::Error naming the path on failure.
void writeFileAtomic(const std::string& path, std::string_view data);

// Streams chunks to a temp file and renames it over `path` on commit(); the temp file is
// removed if the writer is destroyed without commit().
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::string path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  void write(const void* data, size_t bytes);
  void commit();

 private:
  std::string path_, tmp_;
  int fd_ = -1;
};

bool fileExists(const std::string& path);
// mkdir -p with mode 0755; false when the directory does not exist afterwards.
bool makeDirs(const std::string& dir);
bool isDirectory(const std::string& path);
// Whether two paths name one file: the same inode where both exist, else the same path once
// symbolic links and dot segments are resolved.
bool sameFile(const std::string& a, const std::string& b);

}  // namespace ptllm
