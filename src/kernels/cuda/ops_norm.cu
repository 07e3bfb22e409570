// LayerNorm (eps 1e-5, biased variance): forward and the input gradient one warp per row; the
// weight and bias gradients as a deterministic column reduction over rows (no atomics).
#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_reduce.cuh"
#include "kernels/cuda/decode_math.cuh"
#include "kernels/cuda/ops_kernels.cuh"

namespace ptllm::cuda {
namespace {

constexpr int kRowsPerBlock = 8;  // one warp per row

// Two passes over the row (mean, then the centred variance), as the reference does
// (decode_math.cuh: shared with the fused decode step).
__global__ void __launch_bounds__(32 * kRowsPerBlock)
    layernormForwardKernel(float* out, float* mean, float* rstd, const float* in, const float* w,
                           const float* b, int M, int C) {
  const int lane = threadIdx.x & 31;
  const int m = blockIdx.x * kRowsPerBlock + (threadIdx.x >> 5);
  if (m >= M) return;
  const float* x = in + (int64_t)m * C;
  float mu, rs;
  layernormRowStats(x, C, lane, mu, rs);
  float* y = out + (int64_t)m * C;
  for (int c = lane; c < C; c += 32) y[c] = layernormApply(x[c], mu, rs, w[c], b[c]);
  if (lane == 0) {
    if (mean) mean[m] = mu;
    if (rstd) rstd[m] = rs;
  }
}

// din[m,c] += (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd, dnorm = w * dout.
__global__ void __launch_bounds__(32 * kRowsPerBlock)
    layernormBackwardInputKernel(float* din, const float* dout, const float* in, const float* w,
                                 const float* mean, const float* rstd, int M, int C) {
  const int lane = threadIdx.x & 31;
  const int m = blockIdx.x * kRowsPerBlock + (threadIdx.x >> 5);
  if (m >= M) return;
  const float* x = in + (int64_t)m * C;
  const float* dy = dout + (int64_t)m * C;
  const float mu = mean[m], rs = rstd[m];
  float sd = 0.0f, sdn = 0.0f;
  for (int c = lane; c < C; c += 32) {
    const float norm = (x[c] - mu) * rs, dnorm = w[c] * dy[c];
    sd += dnorm;
    sdn = fmaf(dnorm, norm, sdn);
  }
  const float dnormMean = warpSum(sd) / C, dnormNormMean = warpSum(sdn) / C;
  float* dx = din + (int64_t)m * C;
  for (int c = lane; c < C; c += 32) {
    const float norm = (x[c] - mu) * rs, dnorm = w[c] * dy[c];
    dx[c] += (dnorm - dnormMean - norm * dnormNormMean) * rs;
  }
}

// dw[c] += sum_m norm[m,c] * dout[m,c] ; db[c] += sum_m dout[m,c]
struct LayernormParamGradSource {
  const float *dout, *in, *mean, *rstd;
  int C;
  __device__ void operator()(int m, int c, float* s) const {
    const int64_t i = (int64_t)m * C + c;
    const float dy = dout[i];
    s[0] = fmaf((in[i] - mean[m]) * rstd[m], dy, s[0]);
    s[1] += dy;
  }
};

}  // namespace

void launchLayernormForward(float* out, float* mean, float* rstd, const float* in, const float* w,
                            const float* b, int M, int C) {
  if (M <= 0) return;
  layernormForwardKernel<<<ceilDiv(M, kRowsPerBlock), 32 * kRowsPerBlock, 0, stream()>>>(
      out, mean, rstd, in, w, b, M, C);
  PTLLM_CUDA_LAUNCH_CHECK();
}

void launchLayernormBackward(float* din, float* dw, float* db, const float* dout, const float* in,
                             const float* w, const float* mean, const float* rstd, int M, int C,
                             int sms, DeviceScratch& scratch) {
  if (M <= 0 || C <= 0) return;
  layernormBackwardInputKernel<<<ceilDiv(M, kRowsPerBlock), 32 * kRowsPerBlock, 0, stream()>>>(
      din, dout, in, w, mean, rstd, M, C);
  PTLLM_CUDA_LAUNCH_CHECK();
  columnReduce<2>(ColOutputs<2>{{dw, db}}, LayernormParamGradSource{dout, in, mean, rstd, C}, M, C,
                  sms, scratch);
}

}  // namespace ptllm::cuda
