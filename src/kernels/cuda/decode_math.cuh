// Per-element arithmetic that the op kernels and the fused decode step (decode_step.cu) share:
// the LayerNorm statistics and normalisation, GELU, and the greedy pick's order. One definition, so
// the fused step computes every element exactly as the op-by-op step does (bit-identical logits).
// Rounding steps are written as explicit intrinsics, so no kernel can contract them differently;
// each one is the instruction sequence the op kernels compiled to before they shared it (read off
// their PTX). C++17 (nvcc).
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/cuda_reduce.cuh"
#include "kernels/greedy_pick.h"  // the greedy pick's order: pickConsider, pickMerge, pickToken

namespace ptllm::cuda {

// LayerNorm statistics of one row x[C] (eps 1e-5, biased variance), by one warp: two passes
// (mean, then the centred variance) as the reference does, lane-strided sums in order, then
// the butterfly warp sum. Every lane gets mu and rstd.
__device__ __forceinline__ void layernormRowStats(const float* x, int C, int lane, float& mu,
                                                  float& rstd) {
  // Unrolled so the loads issue together; the additions stay one chain in order.
  float s = 0.0f;
#pragma unroll 8
  for (int c = lane; c < C; c += 32) s += x[c];
  mu = warpSum(s) / C;
  float q = 0.0f;
#pragma unroll 8
  for (int c = lane; c < C; c += 32) {
    const float d = x[c] - mu;
    q = fmaf(d, d, q);
  }
  rstd = 1.0f / sqrtf(warpSum(q) / C + 1e-5f);
}

// y = (x - mu) * rstd * w + b: the centred value and its scaling rounded, then one FMA.
__device__ __forceinline__ float layernormApply(float x, float mu, float rstd, float w, float b) {
  return __fmaf_rn(__fmul_rn(__fsub_rn(x, mu), rstd), w, b);
}

// GELU, tanh approximation (kernels/ref/gelu.cpp), in f32 with the accurate tanhf:
// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), x^3 * c + x as one FMA.
constexpr float kGeluSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluC = 0.044715f;

__device__ __forceinline__ float geluTanh(float x) {
  const float cx3 = __fmul_rn(__fmul_rn(x, kGeluC), x);  // (c x) x; times x in the FMA below
  const float u = __fmul_rn(__fmaf_rn(x, cx3, x), kGeluSqrt2OverPi);
  return __fmul_rn(__fmul_rn(x, 0.5f), __fadd_rn(tanhf(u), 1.0f));
}

}  // namespace ptllm::cuda
