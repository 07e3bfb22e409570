// Built instead of the CUDA backend when nvcc is absent or PTLLM_CUDA=OFF: no CUDA paths, no
// device, and --device cuda is a clear error, so no call site needs an #ifdef.
#include "core/error.h"
#include "kernels/cuda/cuda_device.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

namespace ptllm {

std::vector<PathEntry> cudaPaths() {
  return {};
}

const CudaDeviceInfo& cudaDeviceInfo() {
  static const CudaDeviceInfo info = [] {
    CudaDeviceInfo d;
    d.reason = "this binary was built without the CUDA backend";
    return d;
  }();
  return info;
}

void cudaSynchronize() {}

double cudaMedianMs(const std::function<void()>&, int, int) {
  fail("cudaMedianMs: {}", cudaDeviceInfo().reason);
}

std::unique_ptr<Ops> makeCudaOps() {
  fail("--device cuda: {}", cudaDeviceInfo().reason);
}

}  // namespace ptllm
