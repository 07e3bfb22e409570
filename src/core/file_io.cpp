#include "core/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace ptllm {

namespace {

// An input file opened for reading, or an error naming it (a directory, or why it won't open).
std::ifstream openInput(const std::string& path) {
  if (isDirectory(path)) fail("{}: is a directory, expected a file", path);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open: {}", path, std::strerror(errno));
  return in;
}

}  // namespace

std::vector<uint8_t> readBinaryFile(const std::string& path) {
  std::ifstream in = openInput(path);
  std::vector<uint8_t> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) fail("{}: read error", path);
  return data;
}

std::string readTextFile(const std::string& path, size_t maxBytes) {
  std::ifstream in = openInput(path);
  // Read in chunks up to the limit: a device such as /dev/zero or a runaway pipe ends with an
  // error instead of filling memory.
  std::string text;
  std::vector<char> chunk(size_t(1) << 20);
  while (in) {
    in.read(chunk.data(), std::streamsize(chunk.size()));
    const size_t got = size_t(in.gcount());
    if (text.size() + got > maxBytes)
      fail("{}: larger than {} MiB; text inputs are limited to that", path, maxBytes >> 20);
    text.append(chunk.data(), got);
  }
  if (in.bad()) fail("{}: read error", path);
  return text;
}

AtomicFileWriter::AtomicFileWriter(std::string path) : path_(std::move(path)) {
  tmp_ = path_ + ".tmp." + std::to_string(::getpid());
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("{}: cannot create temp file {}: {}", path_, tmp_, std::strerror(errno));
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void AtomicFileWriter::write(const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = ::write(fd_, p, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("{}: write failed: {}", path_, std::strerror(errno));
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void AtomicFileWriter::commit() {
  if (::fsync(fd_) != 0) fail("{}: fsync failed: {}", path_, std::strerror(errno));
  if (::close(fd_) != 0) {
    fd_ = -1;
    fail("{}: close failed: {}", path_, std::strerror(errno));
  }
  fd_ = -1;
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    int e = errno;
    ::unlink(tmp_.c_str());
    fail("{}: rename from {} failed: {}", path_, tmp_, std::strerror(e));
  }
  // Make the rename durable.
  std::string dir = ".";
  if (auto slash = path_.rfind('/'); slash != std::string::npos)
    dir = slash == 0 ? "/" : path_.substr(0, slash);
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

void writeFileAtomic(const std::string& path, std::string_view data) {
  AtomicFileWriter w(path);
  w.write(data.data(), data.size());
  w.commit();
}

bool fileExists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

bool makeDirs(const std::string& dir) {
  if (dir.empty()) return false;
  for (size_t pos = 1; pos <= dir.size(); ++pos) {
    if (pos != dir.size() && dir[pos] != '/') continue;
    const std::string part = dir.substr(0, pos);
    if (::mkdir(part.c_str(), 0755) != 0 && errno != EEXIST) return false;
  }
  return isDirectory(dir);
}

bool sameFile(const std::string& a, const std::string& b) {
  struct stat sa, sb;
  if (::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0)
    return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
  std::error_code ea, eb;
  const auto ca = std::filesystem::weakly_canonical(a, ea);
  const auto cb = std::filesystem::weakly_canonical(b, eb);
  return !ea && !eb && ca == cb;
}

bool isDirectory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

}  // namespace ptllm
