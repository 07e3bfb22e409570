#include "core/tensor.h"

#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace ptllm {

const char* deviceName(Device d) {
  return d == Device::CPU ? "cpu" : "cuda";
}

std::shared_ptr<Buffer> allocHost(size_t bytes) {
  auto buf = std::make_shared<Buffer>();
  const size_t rounded = (bytes + 63) / 64 * 64;
  buf->ptr = std::aligned_alloc(64, rounded ? rounded : 64);
  if (!buf->ptr) fail("out of memory allocating {} bytes", bytes);
  std::memset(buf->ptr, 0, rounded ? rounded : 64);
  buf->bytes = bytes;
  buf->device = Device::CPU;
  buf->free = [](void* p) { std::free(p); };
  return buf;
}

int64_t numelOf(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

std::string shapeString(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

Tensor::Tensor(Shape shape) : shape_(std::move(shape)) {
  for (int64_t d : shape_) PTLLM_ASSERT(d >= 0, "negative dimension in {}", shapeString(shape_));
  buf_ = allocHost(static_cast<size_t>(numel()) * sizeof(float));
}

Tensor::Tensor(Shape shape, std::shared_ptr<Buffer> buf)
    : shape_(std::move(shape)), buf_(std::move(buf)) {
  PTLLM_ASSERT(buf_ && buf_->bytes >= bytes(), "buffer too small for {}", shapeString(shape_));
}

float& Tensor::operator[](int64_t i) {
  PTLLM_ASSERT(device() == Device::CPU && i >= 0 && i < numel());
  return data()[i];
}
float Tensor::operator[](int64_t i) const {
  PTLLM_ASSERT(device() == Device::CPU && i >= 0 && i < numel());
  return data()[i];
}

void Tensor::zero() {
  PTLLM_ASSERT(device() == Device::CPU);
  if (buf_) std::memset(buf_->ptr, 0, bytes());
}

Tensor Tensor::clone() const {
  PTLLM_ASSERT(device() == Device::CPU);
  Tensor t(shape_);
  if (numel()) std::memcpy(t.data(), data(), bytes());
  return t;
}

}  // namespace ptllm
