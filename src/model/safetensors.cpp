#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>

#include "core/error.h"
#include "core/file_io.h"

static_assert(std::endian::native == std::endian::little,
              "safetensors I/O assumes a little-endian host");

namespace ptllm::safetensors {

namespace {

using json = nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // 100 MiB
constexpr int kMaxJsonDepth = 8;                    // valid headers need 3
constexpr size_t kChunkElems = 1 << 16;             // conversion buffer, in elements

// Every dtype name of the format, with its element size in bytes.
struct KnownDType {
  const char* name;
  uint64_t size;
};
constexpr KnownDType kKnownDTypes[] = {
    {"F64", 8},  {"F32", 4},     {"F16", 2},     {"BF16", 2},    {"I64", 8}, {"I32", 4},
    {"I16", 2},  {"I8", 1},      {"U64", 8},     {"U32", 4},     {"U16", 2}, {"U8", 1},
    {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"F8_E8M0", 1},
};

const KnownDType* findKnownDType(const std::string& s) {
  for (const auto& k : kKnownDTypes)
    if (s == k.name) return &k;
  return nullptr;
}

// Makes untrusted text safe for a one-line message: control bytes escaped, length capped.
std::string printable(std::string_view s, size_t kMax = 80) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < kMax; ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f)
      out += fmt::format("\\x{:02x}", c);
    else
      out += static_cast<char>(c);
  }
  if (s.size() > kMax) out += "...";
  return out;
}

std::string quoteName(std::string_view s) {
  return fmt::format("'{}'", printable(s));
}

std::string shapeStr(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// Strict UTF-8 validation (no overlongs, no surrogates, max U+10FFFF). Returns the offset of the
// first bad byte, or npos.
size_t firstInvalidUtf8(std::string_view s) {
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    int len;
    uint32_t cp;
    if ((c & 0xe0) == 0xc0) {
      len = 2;
      cp = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      len = 3;
      cp = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      len = 4;
      cp = c & 0x07;
    } else {
      return i;
    }
    if (i + static_cast<size_t>(len) > n) return i;
    for (int k = 1; k < len; ++k) {
      unsigned char cc = static_cast<unsigned char>(s[i + static_cast<size_t>(k)]);
      if ((cc & 0xc0) != 0x80) return i;
      cp = (cp << 6) | (cc & 0x3f);
    }
    static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[len] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return i;
    i += static_cast<size_t>(len);
  }
  return std::string_view::npos;
}

// Maximum nesting of [] / {} outside strings (so a hostile header cannot exhaust the stack).
int maxJsonDepth(std::string_view s) {
  int depth = 0, maxDepth = 0;
  bool inString = false, escape = false;
  for (char c : s) {
    if (inString) {
      if (escape)
        escape = false;
      else if (c == '\\')
        escape = true;
      else if (c == '"')
        inString = false;
    } else if (c == '"') {
      inString = true;
    } else if (c == '{' || c == '[') {
      maxDepth = std::max(maxDepth, ++depth);
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return maxDepth;
}

// A JSON value that must be a non-negative integer; `what` describes it for the message.
uint64_t nonNegInt(const std::string& path, const json& j, const std::string& what) {
  if (j.is_number_unsigned()) return j.get<uint64_t>();
  if (j.is_number_integer()) {
    if (j.get<int64_t>() >= 0) return static_cast<uint64_t>(j.get<int64_t>());
    fail("{}: safetensors: {} is negative ({})", path, what, j.get<int64_t>());
  }
  if (j.is_number_float())
    fail("{}: safetensors: {} is not an integer ({})", path, what, printable(j.dump()));
  fail("{}: safetensors: {} must be an integer, got {}", path, what, j.type_name());
}

bool readFull(int fd, uint64_t offset, void* dst, size_t bytes, std::string* err) {
  char* p = static_cast<char*>(dst);
  while (bytes > 0) {
    size_t want = std::min<size_t>(bytes, size_t{1} << 30);
    ssize_t n = ::pread(fd, p, want, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      *err = std::strerror(errno);
      return false;
    }
    if (n == 0) {
      *err = "unexpected end of file (file truncated after open?)";
      return false;
    }
    p += n;
    offset += static_cast<uint64_t>(n);
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// dtypes and conversions

const char* dtypeName(DType d) {
  switch (d) {
    case DType::F32:
      return "F32";
    case DType::F16:
      return "F16";
    case DType::BF16:
      return "BF16";
  }
  return "?";
}

std::optional<DType> parseDType(const std::string& s) {
  if (s == "F32") return DType::F32;
  if (s == "F16") return DType::F16;
  if (s == "BF16") return DType::BF16;
  return std::nullopt;
}

size_t dtypeSize(DType d) {
  return d == DType::F32 ? 4 : 2;
}

// ---------------------------------------------------------------------------------------------
// Reader

File File::open(const std::string& path) {
  File f;
  f.path_ = path;
  int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) fail("{}: safetensors: cannot open: {}", path, std::strerror(errno));
  f.fd_ = std::shared_ptr<int>(new int(fd), [](int* p) {
    ::close(*p);
    delete p;
  });
  struct stat st {};
  if (::fstat(fd, &st) != 0) fail("{}: safetensors: cannot stat: {}", path, std::strerror(errno));
  if (!S_ISREG(st.st_mode)) fail("{}: safetensors: not a regular file", path);
  f.fileBytes_ = static_cast<uint64_t>(st.st_size);

  if (f.fileBytes_ < 8)
    fail("{}: safetensors: file too short ({} bytes) to hold the 8-byte header length", path,
         f.fileBytes_);
  unsigned char lenBytes[8];
  std::string err;
  if (!readFull(fd, 0, lenBytes, 8, &err)) fail("{}: safetensors: read failed: {}", path, err);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | lenBytes[i];
  if (n > kMaxHeaderBytes)
    fail("{}: safetensors: header length {} is too large (limit {} bytes)", path, n,
         kMaxHeaderBytes);
  if (n > f.fileBytes_ - 8)
    fail("{}: safetensors: header length {} runs past the end of the file ({} bytes)", path, n,
         f.fileBytes_);
  f.headerBytes_ = n;
  const uint64_t dataBytes = f.fileBytes_ - 8 - n;

  std::string text(static_cast<size_t>(n), '\0');
  if (!readFull(fd, 8, text.data(), text.size(), &err))
    fail("{}: safetensors: read failed: {}", path, err);
  if (size_t bad = firstInvalidUtf8(text); bad != std::string_view::npos)
    fail("{}: safetensors: header is not valid UTF-8 (bad byte at header offset {})", path, bad);
  if (maxJsonDepth(text) > kMaxJsonDepth)
    fail("{}: safetensors: header JSON is nested too deeply", path);

  // Parse, rejecting duplicate keys in any object (nlohmann would silently keep one).
  std::vector<std::set<std::string>> keyStack;
  std::string duplicate;
  json::parser_callback_t cb = [&](int, json::parse_event_t ev, json& parsed) {
    if (ev == json::parse_event_t::object_start) {
      keyStack.emplace_back();
    } else if (ev == json::parse_event_t::object_end) {
      if (!keyStack.empty()) keyStack.pop_back();
    } else if (ev == json::parse_event_t::key && !keyStack.empty() && duplicate.empty()) {
      if (!keyStack.back().insert(parsed.get<std::string>()).second)
        duplicate = parsed.get<std::string>();
    }
    return true;
  };
  json header;
  try {
    header = json::parse(text, cb);
  } catch (const json::exception& e) {
    std::string_view what = e.what();  // drop nlohmann's "[json.exception.x.y] " prefix
    if (auto close = what.find("] "); close != std::string_view::npos)
      what.remove_prefix(close + 2);
    fail("{}: safetensors: header is not valid JSON: {}", path, printable(what, 300));
  }
  if (!duplicate.empty())
    fail("{}: safetensors: header has a duplicate key {}", path, quoteName(duplicate));
  if (!header.is_object())
    fail("{}: safetensors: header is not a JSON object (got {})", path, header.type_name());

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object())
        fail("{}: safetensors: __metadata__ must be an object of string to string, got {}", path,
             v.type_name());
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          fail("{}: safetensors: __metadata__ value for key {} must be a string, got {}", path,
               quoteName(m.key()), m.value().type_name());
        f.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string qn = quoteName(name);
    if (name.empty()) fail("{}: safetensors: tensor with an empty name", path);
    if (!v.is_object())
      fail("{}: safetensors: tensor {} entry must be an object, got {}", path, qn, v.type_name());
    for (const char* key : {"dtype", "shape", "data_offsets"})
      if (!v.contains(key)) fail("{}: safetensors: tensor {} is missing \"{}\"", path, qn, key);

    TensorInfo t;
    t.name = name;
    const json& jd = v.at("dtype");
    if (!jd.is_string())
      fail("{}: safetensors: tensor {} dtype must be a string, got {}", path, qn, jd.type_name());
    t.dtypeName = jd.get<std::string>();
    const KnownDType* known = findKnownDType(t.dtypeName);
    if (!known)
      fail("{}: safetensors: tensor {} has unknown dtype {}", path, qn, quoteName(t.dtypeName));
    t.dtype = parseDType(t.dtypeName);

    const json& js = v.at("shape");
    if (!js.is_array())
      fail("{}: safetensors: tensor {} shape must be an array, got {}", path, qn, js.type_name());
    uint64_t numel = 1;
    bool overflow = false, zero = false;
    for (size_t i = 0; i < js.size(); ++i) {
      uint64_t d = nonNegInt(path, js[i], fmt::format("tensor {} shape dim {}", qn, i));
      if (d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        fail("{}: safetensors: tensor {} shape dim {} is too large ({})", path, qn, i, d);
      t.shape.push_back(static_cast<int64_t>(d));
      if (d == 0) zero = true;
      if (__builtin_mul_overflow(numel, d, &numel)) overflow = true;
    }
    uint64_t needBytes = 0;
    if (zero) {
      numel = 0;
    } else if (overflow || numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
               __builtin_mul_overflow(numel, known->size, &needBytes)) {
      fail("{}: safetensors: tensor {} shape {} element count overflows", path, qn,
           printable(js.dump()));
    }
    needBytes = numel * known->size;
    t.numel = static_cast<int64_t>(numel);

    const json& jo = v.at("data_offsets");
    if (!jo.is_array() || jo.size() != 2)
      fail("{}: safetensors: tensor {} data_offsets must be [begin, end], got {}", path, qn,
           printable(jo.dump()));
    t.begin = nonNegInt(path, jo[0], fmt::format("tensor {} data_offsets begin", qn));
    t.end = nonNegInt(path, jo[1], fmt::format("tensor {} data_offsets end", qn));
    if (t.begin > t.end)
      fail("{}: safetensors: tensor {} data_offsets begin {} > end {}", path, qn, t.begin, t.end);
    if (t.end > dataBytes)
      fail(
          "{}: safetensors: tensor {} data_offsets end {} is past the end of the data area ({} "
          "bytes; file truncated?)",
          path, qn, t.end, dataBytes);
    if (t.end - t.begin != needBytes)
      fail(
          "{}: safetensors: tensor {} size mismatch: data_offsets span {} bytes but {} {} needs {}",
          path, qn, t.end - t.begin, t.dtypeName, shapeStr(t.shape), needBytes);
    f.tensors_.push_back(std::move(t));
  }

  std::sort(f.tensors_.begin(), f.tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin
           : a.end != b.end   ? a.end < b.end
                              : a.name < b.name;
  });
  const TensorInfo* prev = nullptr;  // the non-empty tensor reaching furthest so far
  for (const auto& t : f.tensors_) {
    if (t.begin == t.end) continue;
    if (prev && t.begin < prev->end)
      fail("{}: safetensors: tensors {} [{}, {}) and {} [{}, {}) overlap", path,
           quoteName(prev->name), prev->begin, prev->end, quoteName(t.name), t.begin, t.end);
    if (!prev || t.end > prev->end) prev = &t;
  }
  for (size_t i = 0; i < f.tensors_.size(); ++i) f.index_[f.tensors_[i].name] = i;
  return f;
}

const TensorInfo* File::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

void File::readBytes(uint64_t offset, void* dst, size_t bytes) const {
  std::string err;
  if (!readFull(*fd_, offset, dst, bytes, &err))
    fail("{}: safetensors: read failed: {}", path_, err);
}

std::vector<float> File::readF32(const std::string& name) const {
  const TensorInfo* t = find(name);
  if (!t) fail("{}: safetensors: no tensor named {}", path_, quoteName(name));
  if (!t->dtype)
    fail("{}: safetensors: tensor {} has unsupported dtype {} (need F32, F16 or BF16)", path_,
         quoteName(name), t->dtypeName);
  std::vector<float> out(static_cast<size_t>(t->numel));
  readF32Into(name, out.data(), out.size());
  return out;
}

void File::readF32Into(const std::string& name, float* out, size_t count) const {
  const TensorInfo* t = find(name);
  if (!t) fail("{}: safetensors: no tensor named {}", path_, quoteName(name));
  if (!t->dtype)
    fail("{}: safetensors: tensor {} has unsupported dtype {} (need F32, F16 or BF16)", path_,
         quoteName(name), t->dtypeName);
  if (count != static_cast<size_t>(t->numel))
    fail("{}: safetensors: tensor {} has {} elements, caller expected {}", path_, quoteName(name),
         t->numel, count);
  const uint64_t base = 8 + headerBytes_ + t->begin;
  if (*t->dtype == DType::F32) {
    readBytes(base, out, count * sizeof(float));
    return;
  }
  const bool isF16 = *t->dtype == DType::F16;
  std::vector<uint16_t> buf(std::min(count, kChunkElems));
  for (size_t done = 0; done < count;) {
    const size_t n = std::min(count - done, kChunkElems);
    readBytes(base + done * 2, buf.data(), n * 2);
    for (size_t i = 0; i < n; ++i) out[done + i] = isF16 ? f16ToF32(buf[i]) : bf16ToF32(buf[i]);
    done += n;
  }
}

// ---------------------------------------------------------------------------------------------
// Writer

void write(const std::string& path, const std::vector<TensorToWrite>& tensors,
           const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  std::vector<uint64_t> numels;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    const std::string qn = quoteName(t.name);
    if (t.name.empty()) fail("{}: safetensors: cannot write a tensor with an empty name", path);
    if (t.name == "__metadata__")
      fail("{}: safetensors: cannot write a tensor named __metadata__", path);
    if (!names.insert(t.name).second)
      fail("{}: safetensors: cannot write duplicate tensor name {}", path, qn);
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0)
        fail("{}: safetensors: tensor {} has negative dim in {}", path, qn, shapeStr(t.shape));
      if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel) ||
          numel > (uint64_t{1} << 60))
        fail("{}: safetensors: tensor {} shape {} element count overflows", path, qn,
             shapeStr(t.shape));
    }
    if (numel > 0 && !t.data) fail("{}: safetensors: tensor {} has no data", path, qn);
    const uint64_t bytes = numel * dtypeSize(t.storeAs);
    header[t.name] = {{"dtype", dtypeName(t.storeAs)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    numels.push_back(numel);
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    fail("{}: safetensors: cannot encode header (tensor names and metadata must be UTF-8): {}",
         path, printable(e.what(), 300));
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  unsigned char lenBytes[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) lenBytes[i] = static_cast<unsigned char>(n >> (8 * i));

  AtomicFileWriter w(path);
  w.write(lenBytes, 8);
  w.write(text.data(), text.size());
  std::vector<uint16_t> buf;
  for (size_t ti = 0; ti < tensors.size(); ++ti) {
    const auto& t = tensors[ti];
    const size_t count = static_cast<size_t>(numels[ti]);
    if (count == 0) continue;
    if (t.storeAs == DType::F32) {
      w.write(t.data, count * sizeof(float));
      continue;
    }
    buf.resize(std::min(count, kChunkElems));
    for (size_t done = 0; done < count;) {
      const size_t m = std::min(count - done, kChunkElems);
      for (size_t i = 0; i < m; ++i)
        buf[i] = t.storeAs == DType::F16 ? f32ToF16(t.data[done + i]) : f32ToBf16(t.data[done + i]);
      w.write(buf.data(), m * 2);
      done += m;
    }
  }
  w.commit();
}

}  // namespace ptllm::safetensors
