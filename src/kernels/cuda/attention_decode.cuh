// One query row of causal attention against a KV cache (decode, Tq == 1), by one block of
// decode::kThreads threads: a thread per key for the scores, a block-wide max-subtracted
// softmax, then warp w sums the values of keys j = w (mod 8) with a lane per channel and the 8
// partial rows are added in order. Used by the decode attention kernels (ops_attention.cu) and
// by the fused decode step (decode_step.cu), so both compute every element identically.
// C++17 (nvcc).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/cuda_reduce.cuh"

namespace ptllm::cuda::decode {

constexpr int kThreads = 256;  // the block; 8 warps
constexpr int kWarps = kThreads / 32;
constexpr int kMaxHs = 128;   // 4 channels per lane in the value sum
constexpr int kMaxTk = 4096;  // scores kept in shared memory (16 KB)

struct Smem {
  float q[kMaxHs];
  float s[kMaxTk];
  float partial[kWarps][kMaxHs];
  float red[32];  // softmaxScores: the max's slots [0, kWarps), the sum's [kWarps, 2 kWarps)
};

// The scores sm.s[0, Tk) (this thread's maximum in mx) become probabilities in place and in
// attRow: block-wide max, exp, block-wide sum (blockReduceOnce, cuda_reduce.cuh), one multiply
// by its inverse. The maximum's zero sign may differ from blockReduce's in some lanes;
// s - (+0) and s - (-0) have the same exp.
inline __device__ void softmaxScores(Smem& sm, float* attRow, int Tk, float mx) {
  mx = blockReduceOnce<kWarps>(mx, MaxOp{}, sm.red);
  float sum = 0.0f;
  for (int j = threadIdx.x; j < Tk; j += kThreads) {
    const float e = expf(sm.s[j] - mx);
    sm.s[j] = e;
    sum += e;
  }
  const float inv = 1.0f / blockReduceOnce<kWarps>(sum, SumOp{}, sm.red + kWarps);
  for (int j = threadIdx.x; j < Tk; j += kThreads) {
    sm.s[j] *= inv;
    attRow[j] = sm.s[j];
  }
  __syncthreads();
}

// Channel d of the output: the warps' partial value sums sm.partial[*][d], added in warp order.
inline __device__ float channelSum(const Smem& sm, int d) {
  float o = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) o += sm.partial[w][d];
  return o;
}

// out[d] = channelSum(d) for d < hs, once the warps' partials are stored.
inline __device__ void sumPartials(Smem& sm, float* out, int hs) {
  __syncthreads();
  for (int d = threadIdx.x; d < hs; d += kThreads) out[d] = channelSum(sm, d);
}

// The query row of one head at position Tk-1 over keys/values 0..Tk-1; `base` points at the
// head's channels of row 0 of a [*, 3C] fused qkv (q | k | v), rows `stride` floats apart.
// Writes out[hs] and attRow[Tk] (the probabilities). Any head size 1..kMaxHs.
inline __device__ void queryAnyHs(Smem& sm, float* out, float* attRow, const float* base,
                                  int64_t stride, int Tk, int C, int hs) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float scale = 1.0f / sqrtf(float(hs));
  for (int d = threadIdx.x; d < hs; d += kThreads) sm.q[d] = base[(Tk - 1) * stride + d];
  __syncthreads();
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < Tk; j += kThreads) {
    const float* k = base + j * stride + C;
    float dot = 0.0f;
    for (int d = 0; d < hs; ++d) dot = fmaf(sm.q[d], k[d], dot);
    sm.s[j] = scale * dot;
    mx = fmaxf(mx, sm.s[j]);
  }
  softmaxScores(sm, attRow, Tk, mx);
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int j = warp; j < Tk; j += kWarps) {
    const float* v = base + j * stride + 2 * C;
    const float p = sm.s[j];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int d = lane + 32 * r;
      if (d < hs) acc[r] = fmaf(p, v[d], acc[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int d = lane + 32 * r;
    if (d < hs) sm.partial[warp][d] = acc[r];
  }
  sumPartials(sm, out, hs);
}

// Where queryFixedHs reads key and value rows j: from the fused [*, 3C] qkv rows in global
// memory (GlobalKv), or from copies in shared memory (SharedKv: the fused decode step stages a
// head's rows there). The arithmetic does not depend on it.
struct GlobalKv {
  const float* base;  // the head's channels of row 0
  int64_t stride;
  int C;
  __device__ const float* key(int j) const { return base + j * stride + C; }
  __device__ const float* value(int j) const { return base + j * stride + 2 * C; }
};
struct SharedKv {
  const float *k, *v;  // row j's key at k + j * rs, its value at v + j * rs
  int rs;
  __device__ const float* key(int j) const { return k + j * rs; }
  __device__ const float* value(int j) const { return v + j * rs; }
};

constexpr int kValueAhead = 16;  // Tk <= 128: every value row a warp sums in one round trip

// queryAnyHs for a head size known at compile time (a multiple of 32) and 16-byte aligned
// rows: the same arithmetic in the same order, only the loads differ — a thread's whole key row
// in flight at once (float4), and kValueAhead keys' values in flight per warp — so the scores
// and the value sums wait for one memory round trip instead of one per few channels. The query
// is qRow[0, HS) (global memory), or, qRow null, already in sm.q (the fused decode step puts it
// there). queryFixedHsTo hands the output to emit(copy, d, o) instead of storing it: every thread t
// adds the partial sums of channel d = t % HS (the same order, so the same bits) and calls it
// with copy = t / HS, 0 .. kThreads / HS - 1 — kThreads / HS copies of each channel in
// registers, which the fused decode step sends to the cluster's blocks without first storing
// the row and waiting on a block barrier.
template <int HS, class Kv, class Emit>
__device__ void queryFixedHsTo(Smem& sm, Emit&& emit, float* attRow, const float* qRow,
                               const Kv& kv, int Tk, int hs) {
  static_assert(kThreads % HS == 0, "whole copies of the row");
  static_assert(HS % 32 == 0 && HS <= kMaxHs, "a multiple of 32 channels");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float scale = 1.0f / sqrtf(float(hs));
  if (qRow)
    for (int d = threadIdx.x; d < HS; d += kThreads) sm.q[d] = qRow[d];
  __syncthreads();
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < Tk; j += kThreads) {
    const float4* k = reinterpret_cast<const float4*>(kv.key(j));
    float4 kr[HS / 4];
#pragma unroll
    for (int i = 0; i < HS / 4; ++i) kr[i] = k[i];
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < HS / 4; ++i) {
      dot = fmaf(sm.q[4 * i], kr[i].x, dot);
      dot = fmaf(sm.q[4 * i + 1], kr[i].y, dot);
      dot = fmaf(sm.q[4 * i + 2], kr[i].z, dot);
      dot = fmaf(sm.q[4 * i + 3], kr[i].w, dot);
    }
    sm.s[j] = scale * dot;
    mx = fmaxf(mx, sm.s[j]);
  }
  softmaxScores(sm, attRow, Tk, mx);
  float acc[HS / 32];
#pragma unroll
  for (int r = 0; r < HS / 32; ++r) acc[r] = 0.0f;
  for (int j0 = warp; j0 < Tk; j0 += kWarps * kValueAhead) {
    float v[kValueAhead][HS / 32];
#pragma unroll
    for (int i = 0; i < kValueAhead; ++i) {
      const int j = j0 + kWarps * i;
#pragma unroll
      for (int r = 0; r < HS / 32; ++r) v[i][r] = j < Tk ? kv.value(j)[lane + 32 * r] : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kValueAhead; ++i) {
      const int j = j0 + kWarps * i;
      if (j >= Tk) break;
      const float p = sm.s[j];
#pragma unroll
      for (int r = 0; r < HS / 32; ++r) acc[r] = fmaf(p, v[i][r], acc[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < HS / 32; ++r) sm.partial[warp][lane + 32 * r] = acc[r];
  __syncthreads();
  const int d = int(threadIdx.x) % HS;
  emit(int(threadIdx.x) / HS, d, channelSum(sm, d));
}

// queryFixedHsTo storing out[d] (copy 0).
template <int HS, class Kv>
__device__ void queryFixedHs(Smem& sm, float* out, float* attRow, const float* qRow, const Kv& kv,
                             int Tk, int hs) {
  queryFixedHsTo<HS>(
      sm,
      [out](int copy, int d, float o) {
        if (copy == 0) out[d] = o;
      },
      attRow, qRow, kv, Tk, hs);
}

// The decode attention of one head (the choice depends only on the arguments, so every caller
// with the same arguments runs the same code).
inline __device__ void query(Smem& sm, float* out, float* attRow, const float* base, int64_t stride,
                             int Tk, int C, int hs) {
  const bool aligned =
      (reinterpret_cast<uintptr_t>(base) & 15) == 0 && stride % 4 == 0 && C % 4 == 0;
  const GlobalKv kv{base, stride, C};
  const float* qRow = base + (Tk - 1) * stride;
  if (aligned && hs == 64)
    queryFixedHs<64>(sm, out, attRow, qRow, kv, Tk, hs);
  else if (aligned && hs == 32)
    queryFixedHs<32>(sm, out, attRow, qRow, kv, Tk, hs);
  else
    queryAnyHs(sm, out, attRow, base, stride, Tk, C, hs);
}

}  // namespace ptllm::cuda::decode
