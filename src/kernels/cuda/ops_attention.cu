// Causal multi-head attention over a fused qkv[B,Tk,3C] (head h: channels [h*hs, (h+1)*hs) of
// q, k and v; scores scaled by 1/sqrt(hs); queries are the last Tq of the Tk positions).
//
// One block (8 warps) per (query tile of 16 rows, head, batch). Both directions are built from
// two block-level steps over key tiles of 32 rows staged in shared memory:
//   scores:  S[i][j] = scale * X_i . Y_j for j <= pos(i), written to a [rows, ldS] global matrix
//            (the att output itself in the forward; a scratch matrix in the backward);
//   product: O_i = alpha * sum_j M[i][j] Y_j (or M[j][i] transposed), every output row owned by
//            exactly one block, so no atomics and a fixed summation order.
// The softmax (forward) and its backward are a warp per query row over the row in global
// memory (L2-resident: the block wrote it just before). Head size <= 128.
#include <cmath>
#include <cstdint>

#include "core/error.h"
#include "kernels/cuda/attention_decode.cuh"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_reduce.cuh"
#include "kernels/cuda/ops_kernels.cuh"

namespace ptllm::cuda {
namespace {

constexpr int kQ = 16;       // query rows per block (output rows of a product)
constexpr int kJ = 32;       // key rows per shared tile
constexpr int kWarps = 8;    // 256 threads; warp w owns rows w and w + 8 of the tile
constexpr int kMaxHs = 128;  // 4 channels per lane in a product
constexpr int kThreads = 32 * kWarps;
static_assert(kQ == 2 * kWarps && kJ == 32 && kMaxHs == 4 * 32, "tile shape");

struct Smem {
  float x[kQ][kMaxHs];      // the tile's query rows (scores)
  float y[kJ][kMaxHs + 1];  // key / value rows; +1: lane-per-row reads are conflict-free
  float p[kQ][kJ + 1];      // a tile of M (products)
};

// Rows r of a matrix embedded in a larger one: base + r * stride (the head offset included).
struct Rows {
  const float* base;
  int64_t stride;
  __device__ const float* operator[](int r) const { return base + (int64_t)r * stride; }
};

// S[i][j] = scale * X_i . Y_j for the tile's rows i in [i0, i0+nq), j <= posBase + i.
// Ends with a __syncthreads (S visible to the whole block).
__device__ void tileScores(Smem& sm, float* S, int64_t ldS, Rows X, Rows Y, int i0, int nq,
                           int posBase, int hs, float scale) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int idx = threadIdx.x; idx < nq * hs; idx += kThreads) {
    const int qi = idx / hs, d = idx % hs;
    sm.x[qi][d] = X[i0 + qi][d];
  }
  const int maxPos = posBase + i0 + nq - 1;  // the last row's position: the keys it sees
  for (int j0 = 0; j0 <= maxPos; j0 += kJ) {
    __syncthreads();  // the previous tile's readers are done (and x is loaded)
    for (int idx = threadIdx.x; idx < kJ * hs; idx += kThreads) {
      const int jj = idx / hs, d = idx % hs;
      sm.y[jj][d] = j0 + jj <= maxPos ? Y[j0 + jj][d] : 0.0f;
    }
    __syncthreads();
    const int j = j0 + lane;
    for (int qi = warp; qi < nq; qi += kWarps) {
      if (j > posBase + i0 + qi) continue;
      float s = 0.0f;
      for (int d = 0; d < hs; ++d) s = fmaf(sm.x[qi][d], sm.y[lane][d], s);
      S[(int64_t)(i0 + qi) * ldS + j] = s * scale;
    }
  }
  __syncthreads();
}

// O_i = alpha * sum_{j in [jBegin, jEnd)} M(i, j) Y_j for the tile's rows i in [i0, i0+nq), with
// M(i, j) = Mat[i*ldM + j], or Mat[j*ldM + i] when trans. Channels d < hs of O are overwritten.
__device__ void tileProduct(Smem& sm, float* O, int64_t oStride, const float* Mat, int64_t ldM,
                            bool trans, Rows Y, int i0, int nq, int jBegin, int jEnd, int hs,
                            float alpha) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
  for (int j0 = jBegin; j0 < jEnd; j0 += kJ) {
    __syncthreads();  // the previous tile's readers are done
    for (int idx = threadIdx.x; idx < kJ * hs; idx += kThreads) {
      const int jj = idx / hs, d = idx % hs;
      sm.y[jj][d] = j0 + jj < jEnd ? Y[j0 + jj][d] : 0.0f;
    }
    for (int idx = threadIdx.x; idx < kQ * kJ; idx += kThreads) {
      // Consecutive threads read consecutive addresses of Mat.
      const int qi = trans ? idx % kQ : idx / kJ, jj = trans ? idx / kQ : idx % kJ;
      const int i = i0 + qi, j = j0 + jj;
      float v = 0.0f;
      if (qi < nq && j < jEnd) v = trans ? Mat[(int64_t)j * ldM + i] : Mat[(int64_t)i * ldM + j];
      sm.p[qi][jj] = v;
    }
    __syncthreads();
#pragma unroll 4
    for (int jj = 0; jj < kJ; ++jj) {
      const float p0 = sm.p[warp][jj], p1 = sm.p[warp + kWarps][jj];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float y = sm.y[jj][lane + 32 * r];  // d >= hs: unused lanes, never stored
        acc[0][r] = fmaf(p0, y, acc[0][r]);
        acc[1][r] = fmaf(p1, y, acc[1][r]);
      }
    }
  }
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int qi = warp + kWarps * rr;
    if (qi >= nq) continue;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int d = lane + 32 * r;
      if (d < hs) O[(int64_t)(i0 + qi) * oStride + d] = alpha * acc[rr][r];
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    attentionForwardKernel(float* out, float* att, const float* qkv, int Tq, int Tk, int C,
                           int NH) {
  __shared__ Smem sm;
  const int b = blockIdx.z, h = blockIdx.y, i0 = blockIdx.x * kQ;
  const int nq = min(kQ, Tq - i0), hs = C / NH, q0 = Tk - Tq;
  const float scale = 1.0f / sqrtf(float(hs));
  const float* base = qkv + (int64_t)b * Tk * 3 * C + h * hs;
  const Rows Q{base + (int64_t)q0 * 3 * C, 3 * C}, K{base + C, 3 * C}, V{base + 2 * C, 3 * C};
  float* S = att + ((int64_t)b * NH + h) * Tq * Tk;  // [Tq, Tk]
  tileScores(sm, S, Tk, Q, K, i0, nq, q0, hs, scale);

  // Softmax of each row over j <= pos (max-subtracted); masked entries 0.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int qi = warp; qi < nq; qi += kWarps) {
    const int pos = q0 + i0 + qi;
    float* row = S + (int64_t)(i0 + qi) * Tk;
    float mx = -INFINITY;
    for (int j = lane; j <= pos; j += 32) mx = fmaxf(mx, row[j]);
    mx = warpMax(mx);
    float sum = 0.0f;
    for (int j = lane; j <= pos; j += 32) {
      const float e = expf(row[j] - mx);
      row[j] = e;
      sum += e;
    }
    const float inv = 1.0f / warpSum(sum);
    for (int j = lane; j < Tk; j += 32) row[j] = j <= pos ? row[j] * inv : 0.0f;
  }
  // tileProduct starts with a __syncthreads: the probabilities are visible.
  tileProduct(sm, out + (int64_t)b * Tq * C + h * hs, C, S, Tk, false, V, i0, nq, 0, q0 + i0 + nq,
              hs, 1.0f);
}

// D[i][j] = a_ij * (datt_ij - sum_j' a_ij' datt_ij'), datt_ij = dout_i . v_j (j <= i); 0 above.
__global__ void __launch_bounds__(kThreads)
    attentionBackwardScoresKernel(float* D, const float* dout, const float* qkv, const float* att,
                                  int T, int C, int NH) {
  __shared__ Smem sm;
  const int b = blockIdx.z, h = blockIdx.y, i0 = blockIdx.x * kQ;
  const int nq = min(kQ, T - i0), hs = C / NH;
  const Rows dY{dout + (int64_t)b * T * C + h * hs, C};
  const Rows V{qkv + (int64_t)b * T * 3 * C + 2 * C + h * hs, 3 * C};
  const int64_t head = ((int64_t)b * NH + h) * T * T;
  float* Dh = D + head;
  tileScores(sm, Dh, T, dY, V, i0, nq, 0, hs, 1.0f);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int qi = warp; qi < nq; qi += kWarps) {
    const int i = i0 + qi;
    float* row = Dh + (int64_t)i * T;
    const float* a = att + head + (int64_t)i * T;
    float dot = 0.0f;
    for (int j = lane; j <= i; j += 32) dot = fmaf(a[j], row[j], dot);
    dot = warpSum(dot);
    for (int j = lane; j < T; j += 32) row[j] = j <= i ? a[j] * (row[j] - dot) : 0.0f;
  }
}

// dq_i = scale * sum_j D_ij k_j ; dk_j = scale * sum_i D_ij q_i ; dv_j = sum_i a_ij dout_i.
// blockIdx.y = head * 3 + part (0 q, 1 k, 2 v); every row of dqkv is written exactly once.
__global__ void __launch_bounds__(kThreads)
    attentionBackwardProductKernel(float* dqkv, const float* D, const float* dout, const float* qkv,
                                   const float* att, int T, int C, int NH) {
  __shared__ Smem sm;
  const int b = blockIdx.z, h = blockIdx.y / 3, part = blockIdx.y % 3, i0 = blockIdx.x * kQ;
  const int nq = min(kQ, T - i0), hs = C / NH;
  const float scale = 1.0f / sqrtf(float(hs));
  const float* base = qkv + (int64_t)b * T * 3 * C + h * hs;
  const int64_t head = ((int64_t)b * NH + h) * T * T;
  float* O = dqkv + (int64_t)b * T * 3 * C + part * C + h * hs;
  if (part == 0) {  // rows i of the tile see keys j < i0 + nq
    tileProduct(sm, O, 3 * C, D + head, T, false, Rows{base + C, 3 * C}, i0, nq, 0, i0 + nq, hs,
                scale);
  } else if (part == 1) {  // keys j of the tile are seen by queries i >= i0
    tileProduct(sm, O, 3 * C, D + head, T, true, Rows{base, 3 * C}, i0, nq, i0, T, hs, scale);
  } else {
    tileProduct(sm, O, 3 * C, att + head, T, true, Rows{dout + (int64_t)b * T * C + h * hs, C}, i0,
                nq, i0, T, hs, 1.0f);
  }
}

// Decode (Tq == 1): one block per (head, batch) and all of it on the one query row
// (attention_decode.cuh, shared with the fused decode step).
constexpr int kDecodeMaxTk = decode::kMaxTk;
static_assert(decode::kThreads == kThreads && decode::kMaxHs == kMaxHs, "one block shape");

__global__ void __launch_bounds__(kThreads)
    attentionDecodeKernel(float* out, float* att, const float* qkv, int Tk, int C, int NH) {
  __shared__ decode::Smem sm;
  const int b = blockIdx.y, h = blockIdx.x, hs = C / NH;
  const int64_t stride = 3 * (int64_t)C;
  decode::query(sm, out + (int64_t)b * C + h * hs, att + ((int64_t)b * NH + h) * Tk,
                qkv + (int64_t)b * Tk * stride + h * hs, stride, Tk, C, hs);
}

// The replayable decode step: the position comes from device memory (step[1]). Block h first
// stores head h's channels of the new row into the cache (heads own disjoint channels), then
// attends exactly like attentionDecodeKernel.
__global__ void __launch_bounds__(kThreads)
    attentionStepKernel(float* out, float* att, float* cache, const float* qkvNew, int C, int NH,
                        int maxT, const int32_t* step) {
  __shared__ decode::Smem sm;
  const int h = blockIdx.x, hs = C / NH, pos = step[1];
  const int64_t stride = 3 * (int64_t)C;
  for (int i = threadIdx.x; i < 3 * hs; i += kThreads) {
    const int part = i / hs, d = i % hs;
    cache[pos * stride + part * C + h * hs + d] = qkvNew[part * C + h * hs + d];
  }
  __syncthreads();  // the block's own stores are visible to it
  decode::query(sm, out + h * hs, att + (int64_t)h * maxT, cache + h * hs, stride, pos + 1, C, hs);
}

void checkHeads(int C, int NH) {
  if (NH <= 0 || C % NH != 0 || C / NH > kMaxHs || C / NH < 1)
    fail("CUDA attention: C={} over NH={} heads needs a head size in 1..{}", C, NH, kMaxHs);
}

}  // namespace

void launchAttentionForward(float* out, float* att, const float* qkv, int B, int Tq, int Tk, int C,
                            int NH) {
  checkHeads(C, NH);
  if (Tq > Tk || Tq < 0) fail("CUDA attention: Tq={} exceeds Tk={}", Tq, Tk);
  if (B <= 0 || Tq == 0) return;
  if (Tq == 1 && Tk <= kDecodeMaxTk) {
    attentionDecodeKernel<<<dim3(NH, B), kThreads, 0, stream()>>>(out, att, qkv, Tk, C, NH);
    PTLLM_CUDA_LAUNCH_CHECK();
    return;
  }
  const dim3 grid(ceilDiv(Tq, kQ), NH, B);
  attentionForwardKernel<<<grid, kThreads, 0, stream()>>>(out, att, qkv, Tq, Tk, C, NH);
  PTLLM_CUDA_LAUNCH_CHECK();
}

void launchAttentionStep(float* out, float* att, float* cache, const float* qkvNew, int C, int NH,
                         int maxT, const int32_t* step) {
  checkHeads(C, NH);
  if (maxT > kDecodeMaxTk) fail("CUDA attention step: context {} exceeds {}", maxT, kDecodeMaxTk);
  attentionStepKernel<<<NH, kThreads, 0, stream()>>>(out, att, cache, qkvNew, C, NH, maxT, step);
  PTLLM_CUDA_LAUNCH_CHECK();
}

void launchAttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* att,
                             int B, int T, int C, int NH, DeviceScratch& scratch) {
  checkHeads(C, NH);
  if (B <= 0 || T <= 0) return;
  float* D = scratch.as<float>(size_t(B) * NH * T * T);
  attentionBackwardScoresKernel<<<dim3(ceilDiv(T, kQ), NH, B), kThreads, 0, stream()>>>(
      D, dout, qkv, att, T, C, NH);
  PTLLM_CUDA_LAUNCH_CHECK();
  attentionBackwardProductKernel<<<dim3(ceilDiv(T, kQ), 3 * NH, B), kThreads, 0, stream()>>>(
      dqkv, D, dout, qkv, att, T, C, NH);
  PTLLM_CUDA_LAUNCH_CHECK();
}

}  // namespace ptllm::cuda
