// Device helpers shared by the backend's kernels: warp and block reductions, and a deterministic
// two-stage column reduction (sum over rows of f(m, n) per column n, fixed summation order).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/ops_kernels.cuh"

namespace ptllm::cuda {

constexpr unsigned kFullMask = 0xffffffffu;

// Butterfly reductions: every lane ends with the same (bitwise identical) value.
template <class T>
__device__ __forceinline__ T warpSum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ float warpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

struct SumOp {
  template <class T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Reduces v over the whole block (blockDim.x a multiple of 32, <= 1024); every thread gets the
// result. `shared` holds 32 T. Safe to call repeatedly with the same `shared`.
template <class T, class Op>
__device__ T blockReduce(T v, Op op, T identity, T* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nWarps = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(kFullMask, v, o));
  __syncthreads();  // a previous call's readers are done with `shared`
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < nWarps ? shared[lane] : identity;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// blockReduce's value for a block of Warps warps (blockDim.x == 32 * Warps, a power of two) with
// one block barrier instead of two: each warp's lane 0 writes its butterfly result to
// slots[warp], and every thread combines the Warps slots pairwise as blockReduce's second
// butterfly does for lane 0 (o = Warps/2, ..., 1: v[i] = op(v[i], v[i + o])); its levels above
// Warps combine with the identity, which leaves a sum of non-negative terms or a maximum
// unchanged, and the butterfly gives every lane lane 0's bits. No leading barrier: callers give
// each reduction its own Warps slots, so no previous call's readers can still be on them.
template <int Warps, class Op>
__device__ __forceinline__ float blockReduceOnce(float v, Op op, float* slots) {
  static_assert((Warps & (Warps - 1)) == 0 && Warps <= 32, "a butterfly over the warps");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(kFullMask, v, o));
  if (lane == 0) slots[warp] = v;
  __syncthreads();
  float w[Warps];
#pragma unroll
  for (int i = 0; i < Warps; ++i) w[i] = slots[i];
#pragma unroll
  for (int o = Warps / 2; o > 0; o >>= 1)
#pragma unroll
    for (int i = 0; i < o; ++i) w[i] = op(w[i], w[i + o]);
  return w[0];
}

// ---- column reduction: out_o[n] += sum over m < M of f(m, n)[o], o < kOut ----
// Stage 1: grid (ceil(N/32), chunks), block (32, 8): lane = column, warp = row phase; each
// block sums its chunk of rows into partial[o][chunk][n]. Stage 2 adds the chunks in order.
// f(m, n, s) adds its kOut values into s[]. The order of every sum depends only on M and N.
constexpr int kColWarps = 8;

template <int kOut, class F>
__global__ void __launch_bounds__(32 * kColWarps)
    colPartialKernel(float* partial, F f, int M, int N, int rowsPerChunk) {
  const int lane = threadIdx.x, warp = threadIdx.y;
  const int n = blockIdx.x * 32 + lane, chunk = blockIdx.y, chunks = gridDim.y;
  const int m0 = chunk * rowsPerChunk, m1 = min(M, m0 + rowsPerChunk);
  float s[kOut];
#pragma unroll
  for (int o = 0; o < kOut; ++o) s[o] = 0.0f;
  if (n < N)
    for (int m = m0 + warp; m < m1; m += kColWarps) f(m, n, s);
  __shared__ float red[kOut][kColWarps][33];
#pragma unroll
  for (int o = 0; o < kOut; ++o) red[o][warp][lane] = s[o];
  __syncthreads();
  if (warp == 0 && n < N) {
#pragma unroll
    for (int o = 0; o < kOut; ++o) {
      float t = 0.0f;
#pragma unroll
      for (int w = 0; w < kColWarps; ++w) t += red[o][w][lane];
      partial[((int64_t)o * chunks + chunk) * N + n] = t;
    }
  }
}

template <int kOut>
struct ColOutputs {
  float* p[kOut];
};

template <int kOut>
__global__ void colFinishKernel(ColOutputs<kOut> outs, const float* partial, int chunks, int N) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
#pragma unroll
  for (int o = 0; o < kOut; ++o) {
    float t = 0.0f;
    for (int c = 0; c < chunks; ++c) t += partial[((int64_t)o * chunks + c) * N + n];
    outs.p[o][n] += t;
  }
}

// Host side of the column reduction: outs.p[o][n] += sum over m < M of f(m, n)[o].
template <int kOut, class F>
void columnReduce(ColOutputs<kOut> outs, F f, int M, int N, int sms, DeviceScratch& scratch) {
  if (M <= 0 || N <= 0) return;
  // Enough blocks to fill the GPU (about 2 per SM), chunks of at least 64 rows.
  const int colBlocks = static_cast<int>(ceilDiv(N, 32));
  const int chunks =
      std::max(1, std::min(static_cast<int>(ceilDiv(M, 64)),
                           static_cast<int>(ceilDiv(2 * std::max(sms, 1), colBlocks))));
  const int rowsPerChunk = static_cast<int>(ceilDiv(M, chunks));
  float* partial = scratch.as<float>(static_cast<size_t>(kOut) * chunks * N);
  colPartialKernel<kOut, F><<<dim3(colBlocks, chunks), dim3(32, kColWarps), 0, stream()>>>(
      partial, f, M, N, rowsPerChunk);
  PTLLM_CUDA_LAUNCH_CHECK();
  colFinishKernel<kOut><<<ceilDiv(N, 256), 256, 0, stream()>>>(outs, partial, chunks, N);
  PTLLM_CUDA_LAUNCH_CHECK();
}

}  // namespace ptllm::cuda
