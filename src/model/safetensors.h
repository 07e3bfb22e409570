// safetensors: a defensive reader and an atomic writer of the safetensors format.
//
// Layout: an 8-byte little-endian u64 header length N, then N bytes of UTF-8 JSON, then the data
// area. The JSON is an object mapping tensor name -> {"dtype": "F32", "shape": [..],
// "data_offsets": [begin, end]} (offsets relative to the first byte of the data area), plus an
// optional "__metadata__" object of string -> string.
//
// The reader never trusts the file: every malformed input (short file, bad header length, header
// that is not UTF-8 / JSON / an object, duplicate keys, bad entries, shape overflow, offsets out of
// range, sizes that do not match the shape, overlapping tensors, bad __metadata__) is reported at
// open() as a one-line ptllm::Error "PATH: safetensors: PROBLEM". open() reads only the header,
// so inspecting a large file is cheap; tensor data is read on demand with pread. Gaps between
// tensors and trailing bytes after the last tensor are tolerated.
//
// Any dtype of the format (F64, F32, F16, BF16, I64 ... U8, BOOL, F8_E4M3, F8_E5M2) is accepted by
// open(); only F32, F16 and BF16 can be read as f32 — reading another is an error naming the
// tensor and its dtype. An unknown dtype string is an error at open().
//
// The writer lays tensors out contiguously in the given order, pads the header with spaces to a
// multiple of 8 bytes, converts f32 to F16/BF16 with round-to-nearest-even (NaN stays NaN,
// overflow becomes inf), and writes through AtomicFileWriter: on any error the previous file at
// the path, if any, is left untouched.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/half.h"

namespace ptllm::safetensors {

// The dtypes this engine can read and write as f32.
enum class DType { F32, F16, BF16 };

const char* dtypeName(DType d);                         // "F32", "F16", "BF16"
std::optional<DType> parseDType(const std::string& s);  // nullopt for any other string
size_t dtypeSize(DType d);                              // 4, 2, 2

// The conversions the reader and writer use (core/half.h).
using ptllm::bf16ToF32;
using ptllm::f16ToF32;
using ptllm::f32ToBf16;
using ptllm::f32ToF16;

struct TensorInfo {
  std::string name;
  std::string dtypeName;       // as written in the file, e.g. "F32", "I64"
  std::optional<DType> dtype;  // nullopt: a known safetensors dtype this engine cannot convert
  std::vector<int64_t> shape;  // empty = scalar
  int64_t numel = 0;
  uint64_t begin = 0, end = 0;  // byte range relative to the start of the data area
};

class File {
 public:
  // Opens `path`, reads and validates the header. Throws ptllm::Error on any problem.
  static File open(const std::string& path);

  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // All tensors, ordered by their position in the data area (= write order for our writer).
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(const std::string& name) const;  // nullptr if absent
  uint64_t headerBytes() const { return headerBytes_; }   // N, the JSON header length
  uint64_t fileBytes() const { return fileBytes_; }

  // Reads tensor `name` converted to f32. Throws if absent, unsupported dtype or read error.
  std::vector<float> readF32(const std::string& name) const;
  // Same, into caller memory; `count` must equal the tensor's numel.
  void readF32Into(const std::string& name, float* out, size_t count) const;

 private:
  File() = default;
  void readBytes(uint64_t offset, void* dst, size_t bytes) const;  // offset from file start

  std::string path_;
  std::shared_ptr<int> fd_;  // shared so File is cheap to copy; closes on last owner
  uint64_t fileBytes_ = 0, headerBytes_ = 0;
  std::map<std::string, std::string> metadata_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> index_;
};

struct TensorToWrite {
  std::string name;
  std::vector<int64_t> shape;
  const float* data = nullptr;  // numel floats, row-major
  DType storeAs = DType::F32;
};

// Writes a safetensors file atomically. Validates names (non-empty, unique, not "__metadata__"),
// shapes and data pointers before anything touches the disk. Throws ptllm::Error naming `path`.
void write(const std::string& path, const std::vector<TensorToWrite>& tensors,
           const std::map<std::string, std::string>& metadata = {});

}  // namespace ptllm::safetensors
