// GPU detection and the backend's stream.
#include <fmt/format.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_device.h"

namespace ptllm {

namespace {
CudaDeviceInfo detect() {
  CudaDeviceInfo d;
  d.built = true;
  cudaRuntimeGetVersion(&d.runtimeVersion);
  cudaDriverGetVersion(&d.driverVersion);
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    d.reason = fmt::format("no usable CUDA device ({})", cudaGetErrorString(err));
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return d;
  }
  if (count == 0) {
    d.reason = "no CUDA device";
    return d;
  }
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) {
    d.reason = "cudaGetDeviceProperties failed";
    cudaGetLastError();
    return d;
  }
  d.name = p.name;
  d.ccMajor = p.major;
  d.ccMinor = p.minor;
  d.multiprocessors = p.multiProcessorCount;
  d.totalMemBytes = p.totalGlobalMem;
  d.l2Bytes = static_cast<size_t>(p.l2CacheSize);
  const int cc = p.major * 10 + p.minor;
  d.tensorCoresF16 = cc >= 80;  // the kernels use mma.sync m16n8k16 (sm_80+)
  d.fp8 = cc >= 89;             // e4m3 conversions and tensor cores (Ada, Hopper)
  d.wgmma = cc == 90;           // matmul_tensor_core_sm90a.cu is sm_90a machine code only
  if (cc < 70) {
    d.reason = fmt::format("compute capability {}.{} is below the backend's 7.0", p.major, p.minor);
    return d;
  }
  d.available = true;
  return d;
}
}  // namespace

const CudaDeviceInfo& cudaDeviceInfo() {
  static const CudaDeviceInfo info = detect();
  return info;
}

void cudaSynchronize() {
  if (cudaDeviceInfo().available) PTLLM_CUDA_CHECK(cudaStreamSynchronize(cuda::stream()));
}

double cudaMedianMs(const std::function<void()>& fn, int iters, int warmup) {
  if (!cudaDeviceInfo().available) fail("cudaMedianMs: {}", cudaDeviceInfo().reason);
  cudaStream_t s = cuda::stream();
  for (int i = 0; i < warmup; ++i) fn();
  cudaEvent_t a, b;
  PTLLM_CUDA_CHECK(cudaEventCreate(&a));
  PTLLM_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int i = 0; i < std::max(1, iters); ++i) {
    PTLLM_CUDA_CHECK(cudaEventRecord(a, s));
    fn();
    PTLLM_CUDA_CHECK(cudaEventRecord(b, s));
    PTLLM_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    PTLLM_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

namespace cuda {
namespace {
thread_local cudaStream_t tThreadStream = nullptr;
cudaStream_t sharedStream() {
  static cudaStream_t s = [] {
    cudaStream_t st = nullptr;
    PTLLM_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    return st;
  }();
  return s;
}
}  // namespace

cudaStream_t stream() {
  return tThreadStream ? tThreadStream : sharedStream();
}
void setThreadStream(cudaStream_t s) {
  tThreadStream = s;
}
}  // namespace cuda

}  // namespace ptllm
