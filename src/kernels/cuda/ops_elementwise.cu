// Elementwise ops (fill, add, scale, GELU forward/backward, AdamW) as grid-stride loops, and the
// bias gradient as a deterministic column reduction. Outputs may alias inputs where ops.h
// allows it (add, GELU): every kernel reads an element before writing the same element, so no
// pointer here is __restrict__.
#include <cmath>
#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_reduce.cuh"
#include "kernels/cuda/decode_math.cuh"
#include "kernels/cuda/ops_kernels.cuh"

namespace ptllm::cuda {
namespace {

constexpr int kThreads = 256;

// Blocks for a grid-stride loop over n elements: enough to fill the GPU, capped.
unsigned gridFor(int64_t n) {
  const long long blocks = ceilDiv(n, kThreads);
  return static_cast<unsigned>(blocks < 8192 ? blocks : 8192);
}

#define PTLLM_GRID_STRIDE(i, n)                                             \
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
       i += (int64_t)gridDim.x * blockDim.x)

__global__ void fillKernel(float* dst, float value, int64_t n) {
  PTLLM_GRID_STRIDE(i, n) dst[i] = value;
}

__global__ void addKernel(float* out, const float* a, const float* b, int64_t n) {
  PTLLM_GRID_STRIDE(i, n) out[i] = a[i] + b[i];
}

__global__ void scaleKernel(float* x, float s, int64_t n) {
  PTLLM_GRID_STRIDE(i, n) x[i] *= s;
}

// GELU, tanh approximation (decode_math.cuh: shared with the fused decode step).
constexpr float kSqrt2OverPi = kGeluSqrt2OverPi;

__global__ void geluForwardKernel(float* out, const float* in, int64_t n) {
  PTLLM_GRID_STRIDE(i, n) out[i] = geluTanh(in[i]);
}

__global__ void geluBackwardKernel(float* din, const float* in, const float* dout, int64_t n) {
  PTLLM_GRID_STRIDE(i, n) {
    const float x = in[i];
    const float u = kSqrt2OverPi * (x + kGeluC * x * x * x);
    const float th = tanhf(u);
    const float sech2 = 1.0f - th * th;
    const float grad =
        0.5f * (1.0f + th) + 0.5f * x * sech2 * kSqrt2OverPi * (1.0f + 3.0f * kGeluC * x * x);
    din[i] = grad * dout[i];
  }
}

// AdamW as in kernels/ref/adamw.cpp: the moments in f32 with the reference's rounding order
// (explicit _rn intrinsics: no contraction into FMA), the update in double.
__global__ void adamwKernel(float* p, const float* g, float* m, float* v, int64_t n, float lr,
                            float beta1, float beta2, float eps, float wd, double c1, double c2) {
  PTLLM_GRID_STRIDE(i, n) {
    const float gi = g[i];
    const float mi = __fadd_rn(__fmul_rn(beta1, m[i]), __fmul_rn(1.0f - beta1, gi));
    const float vi = __fadd_rn(__fmul_rn(beta2, v[i]), __fmul_rn(__fmul_rn(1.0f - beta2, gi), gi));
    m[i] = mi;
    v[i] = vi;
    const double mhat = mi / c1, vhat = vi / c2, pi = p[i];
    p[i] = float(pi - double(lr) * (mhat / (sqrt(vhat) + double(eps)) + double(wd) * pi));
  }
}

#undef PTLLM_GRID_STRIDE

// dbias[n] += sum_m dout[m, n]
struct BiasGradSource {
  const float* dout;
  int N;
  __device__ void operator()(int m, int n, float* s) const { s[0] += dout[(int64_t)m * N + n]; }
};

}  // namespace

void launchFill(float* dst, float value, int64_t n) {
  if (n <= 0) return;
  if (value == 0.0f && !std::signbit(value)) {
    PTLLM_CUDA_CHECK(cudaMemsetAsync(dst, 0, size_t(n) * sizeof(float), stream()));
    return;
  }
  fillKernel<<<gridFor(n), kThreads, 0, stream()>>>(dst, value, n);
  PTLLM_CUDA_LAUNCH_CHECK();
}

void launchAdd(float* out, const float* a, const float* b, int64_t n) {
  if (n <= 0) return;
  addKernel<<<gridFor(n), kThreads, 0, stream()>>>(out, a, b, n);
  PTLLM_CUDA_LAUNCH_CHECK();
}

void launchScale(float* x, float s, int64_t n) {
  if (n <= 0) return;
  scaleKernel<<<gridFor(n), kThreads, 0, stream()>>>(x, s, n);
  PTLLM_CUDA_LAUNCH_CHECK();
}

void launchGeluForward(float* out, const float* in, int64_t n) {
  if (n <= 0) return;
  geluForwardKernel<<<gridFor(n), kThreads, 0, stream()>>>(out, in, n);
  PTLLM_CUDA_LAUNCH_CHECK();
}

void launchGeluBackward(float* din, const float* in, const float* dout, int64_t n) {
  if (n <= 0) return;
  geluBackwardKernel<<<gridFor(n), kThreads, 0, stream()>>>(din, in, dout, n);
  PTLLM_CUDA_LAUNCH_CHECK();
}

void launchAdamw(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1,
                 float beta2, float eps, float wd, int t) {
  if (n <= 0) return;
  const double c1 = 1.0 - std::pow(double(beta1), t), c2 = 1.0 - std::pow(double(beta2), t);
  adamwKernel<<<gridFor(n), kThreads, 0, stream()>>>(p, g, m, v, n, lr, beta1, beta2, eps, wd, c1,
                                                     c2);
  PTLLM_CUDA_LAUNCH_CHECK();
}

void launchBiasBackward(float* dbias, const float* dout, int M, int N, int sms,
                        DeviceScratch& scratch) {
  columnReduce<1>(ColOutputs<1>{{dbias}}, BiasGradSource{dout, N}, M, N, sms, scratch);
}

}  // namespace ptllm::cuda
