// Growable 64-byte aligned per-thread scratch for the CPU kernels (pool workers are
// long-lived, so each keeps its buffers across calls instead of allocating per call).
#pragma once

#include <hwy/aligned_allocator.h>

#include <cstddef>

namespace ptllm::cpu::detail {

struct Scratch {
  float* get(size_t n) {
    if (n > cap) {
      buf = hwy::AllocateAligned<float>(n);
      cap = n;
    }
    return buf.get();
  }
  hwy::AlignedFreeUniquePtr<float[]> buf;
  size_t cap = 0;
};

}  // namespace ptllm::cpu::detail
