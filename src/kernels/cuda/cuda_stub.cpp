// Built instead of the CUDA backend when nvcc is absent or PTLLM_CUDA=OFF: no CUDA paths, no
// device, and --device cuda is a clear error, so no call site needs an #ifdef.
#include "core/error.h"
#include "kernels/cuda/cuda_device.h"
#include "kernels/cuda/cuda_paths.h"
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

// The raw kernels of cuda_paths.h (benchmarks and GPU tests call them directly): without the
// backend there is no device memory to hand them, so each one is the same clear error.
namespace ptllm::cuda {

namespace {
[[noreturn]] void unavailable(const char* what) {
  fail("{}: {}", what, cudaDeviceInfo().reason);
}
}  // namespace

bool packF16(void*, const float*, int, int) {
  unavailable("cuda::packF16");
}
bool packBf16(void*, const float*, int, int) {
  unavailable("cuda::packBf16");
}
bool packFp8(void*, const float*, int, int) {
  unavailable("cuda::packFp8");
}
bool packF16Truncated(void*, const float*, int, int) {
  unavailable("cuda::packF16Truncated");
}
void matmulF16(float*, const float*, const void*, const float*, int, int, int) {
  unavailable("cuda::matmulF16");
}
void matmulBf16(float*, const float*, const void*, const float*, int, int, int) {
  unavailable("cuda::matmulBf16");
}
void matmulFp8(float*, const float*, const void*, const float*, int, int, int) {
  unavailable("cuda::matmulFp8");
}
int gemvF16VariantCount() {
  return 0;
}
const char* gemvF16VariantName(int) {
  unavailable("cuda::gemvF16VariantName");
}
void gemvF16Variant(int, float*, const float*, const void*, const float*, int, int) {
  unavailable("cuda::gemvF16Variant");
}
void matmulTensorCoreF16(float*, const float*, const void*, const float*, int, int, int) {
  unavailable("cuda::matmulTensorCoreF16");
}
void gemmF16TensorCore(float*, const void*, const void*, int, int, int) {
  unavailable("cuda::gemmF16TensorCore");
}
int gemmF16VariantCount() {
  return 0;
}
const char* gemmF16VariantName(int) {
  unavailable("cuda::gemmF16VariantName");
}
void gemmF16Variant(int, float*, const void*, const void*, const float*, const float*, int, int,
                    int) {
  unavailable("cuda::gemmF16Variant");
}
void matmulCublasLtF16(float*, const float*, const void*, const float*, int, int, int) {
  unavailable("cuda::matmulCublasLtF16");
}
void gemmF16CublasLt(float*, const void*, const void*, int, int, int) {
  unavailable("cuda::gemmF16CublasLt");
}

}  // namespace ptllm::cuda
