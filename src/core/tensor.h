// Tensor storage. A Tensor owns (shares) a Buffer allocated by a backend; the Buffer records
// the device it lives on, so a backend can keep weights, activations and KV caches in device
// memory while the model only sees shapes and pointers. Host buffers are 64-byte aligned.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace ptllm {

enum class Device { CPU, CUDA };
const char* deviceName(Device d);

// One contiguous allocation. `free` releases it with the allocator that made it.
struct Buffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  Device device = Device::CPU;
  std::function<void(void*)> free;
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    if (ptr && free) free(ptr);
  }
};

std::shared_ptr<Buffer> allocHost(size_t bytes);  // zero-filled, 64-byte aligned

using Shape = std::vector<int64_t>;
int64_t numelOf(const Shape& s);
std::string shapeString(const Shape& s);  // "[3, 4]"

// An f32 tensor: a shape over a buffer. Copying a Tensor shares the buffer.
class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(Shape shape);  // host, zero-filled
  Tensor(Shape shape, std::shared_ptr<Buffer> buf);

  float* data() { return static_cast<float*>(buf_ ? buf_->ptr : nullptr); }
  const float* data() const { return static_cast<const float*>(buf_ ? buf_->ptr : nullptr); }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_.at(static_cast<size_t>(i)); }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const { return numelOf(shape_); }
  size_t bytes() const { return static_cast<size_t>(numel()) * sizeof(float); }
  Device device() const { return buf_ ? buf_->device : Device::CPU; }
  bool empty() const { return !buf_; }

  // Host-only conveniences (asserts the tensor is on the host).
  float& operator[](int64_t i);
  float operator[](int64_t i) const;
  void zero();
  Tensor clone() const;

 private:
  Shape shape_;
  std::shared_ptr<Buffer> buf_;
};

}  // namespace ptllm
