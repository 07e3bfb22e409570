// Shared by every .cu file of the backend: error checks and the one stream all work goes on.
#pragma once

#include <cuda_runtime.h>

#include "core/error.h"

namespace ptllm::cuda {

// Every CUDA call is checked; a failure throws ptllm::Error naming the call and the error.
#define PTLLM_CUDA_CHECK(call)                                                 \
  do {                                                                         \
    cudaError_t err_ = (call);                                                 \
    if (err_ != cudaSuccess)                                                   \
      ::ptllm::fail("CUDA error in {} ({}:{}): {}", #call, __FILE__, __LINE__, \
                    cudaGetErrorString(err_));                                 \
  } while (0)

// After a launch: configuration errors surface here, not at the next sync.
#define PTLLM_CUDA_LAUNCH_CHECK() PTLLM_CUDA_CHECK(cudaGetLastError())

// The backend's stream (non-blocking, created on first use). Every kernel, copy and library
// call of the backend goes on it, so a decode step can be captured into a CUDA graph.
cudaStream_t stream();
// While a thread records a decode step (CudaOps::beginStepCapture) its work goes to a private
// capture stream, so work other threads put on the shared stream is never recorded. nullptr
// returns the thread to the shared stream.
void setThreadStream(cudaStream_t s);

inline unsigned ceilDiv(long long a, long long b) {
  return static_cast<unsigned>((a + b - 1) / b);
}

}  // namespace ptllm::cuda
