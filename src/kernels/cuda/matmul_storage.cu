// Reduced-precision weight storage on the GPU: f16, bf16 and fp8-e4m3 (per-channel scales).
// Weights are packed once, transposed to [N][Kp] so one warp streams one output column's
// weights with 16-byte loads; products and sums are f32 FFMA (the spec's f16-storage path:
// fewer bytes, same arithmetic). The reference is Ops::matmul (the canonical f32 path).
//
// M <= 8 (decode, short prompts) runs a GEMV-style kernel: a warp per output column, every row
// of the input against the same loaded weights, a shuffle reduction; the cost is the weight
// bytes over memory bandwidth. M > 8 runs a shared-memory tiled kernel that widens the weights
// to f32 as it stages them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <mutex>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_paths.h"

namespace ptllm::cuda {

namespace {

enum class Fmt { F16, BF16, FP8 };

template <Fmt F>
__host__ __device__ constexpr int elemBytes() {
  return F == Fmt::FP8 ? 1 : 2;
}
// Elements in one 16-byte vector.
template <Fmt F>
__host__ __device__ constexpr int perVec() {
  return 16 / elemBytes<F>();
}

// Widening without the conversion unit (quarter rate): the f16/e4m3 exponent-and-mantissa bits
// are moved into an f32's, which reads them as 2^-112 (f16) or 2^-120 (e4m3) times the value,
// subnormals included (they land on f32 denormals); one exact f32 multiply restores the scale.
// Inf/NaN never reach here (the packs refuse or saturate them). bf16 is the high half of an
// f32: a shift.
__device__ inline float f16BitsToF32(uint32_t h) {  // h: 16 bits
  const uint32_t bits = ((h & 0x7fffu) << 13) | ((h & 0x8000u) << 16);
  return __uint_as_float(bits) * 0x1p112f;
}
__device__ inline float e4m3BitsToF32(uint32_t q) {  // q: 8 bits
  const uint32_t bits = ((q & 0x7fu) << 20) | ((q & 0x80u) << 24);
  return __uint_as_float(bits) * 0x1p120f;
}

template <Fmt F>
__device__ inline void unpackVec(const uint4& v, float* f) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t w = words[i];
    if constexpr (F == Fmt::F16) {
      f[2 * i] = f16BitsToF32(w & 0xffffu);
      f[2 * i + 1] = f16BitsToF32(w >> 16);
    } else if constexpr (F == Fmt::BF16) {
      f[2 * i] = __uint_as_float(w << 16);
      f[2 * i + 1] = __uint_as_float(w & 0xffff0000u);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) f[4 * i + j] = e4m3BitsToF32((w >> (8 * j)) & 0xffu);
    }
  }
}

// A streamed weight load: read once per call, so keep it out of L1 and ask L2 for the whole
// 256-byte sector group (the next lanes' bytes arrive with it).
__device__ inline uint4 loadStreaming(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

template <Fmt F>
__device__ inline float loadElem(const unsigned char* row, int k) {
  if constexpr (F == Fmt::F16) {
    return __half2float(reinterpret_cast<const __half*>(row)[k]);
  } else if constexpr (F == Fmt::BF16) {
    return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row)[k]);
  } else {
    return e4m3BitsToF32(row[k]);
  }
}

__device__ inline float warpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---- GEMV: M <= MR rows, a warp per output column ----
constexpr int kGemvWarps = 8;
// U: 16-byte weight loads in flight per lane. 8 measured better than 4 at 16384^2 and better
// than 16 at 4096^2 (fewer registers, more resident warps) on the H200.
template <Fmt F, int MR, bool kVecX, int U = 8>
__global__ void __launch_bounds__(kGemvWarps * 32)
    gemvKernel(float* __restrict__ out, const float* __restrict__ in,
               const unsigned char* __restrict__ w, const float* __restrict__ scales,
               const float* __restrict__ bias, int M, int K, int N, int Kp) {
  constexpr int E = perVec<F>();
  const int lane = threadIdx.x & 31;
  const int n = blockIdx.x * kGemvWarps + (threadIdx.x >> 5);
  if (n >= N) return;
  const uint4* wrow = reinterpret_cast<const uint4*>(w + size_t(n) * Kp * elemBytes<F>());
  const int nvec = Kp / E;
  float acc[MR];
#pragma unroll
  for (int m = 0; m < MR; ++m) acc[m] = 0.f;

  for (int v0 = lane; v0 < nvec; v0 += 32 * U) {
    uint4 wv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + u * 32;
      wv[u] = v < nvec ? loadStreaming(wrow + v) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k0 = (v0 + u * 32) * E;
      if (k0 >= K) continue;  // padding (zeros) or past the row
      float wf[E];
      unpackVec<F>(wv[u], wf);
#pragma unroll
      for (int m = 0; m < MR; ++m) {
        if (m >= M) continue;
        const float* x = in + size_t(m) * K + k0;
        if (k0 + E <= K) {
          if constexpr (kVecX) {
#pragma unroll
            for (int j = 0; j < E; j += 4) {
              const float4 xv = __ldg(reinterpret_cast<const float4*>(x + j));
              acc[m] = fmaf(xv.x, wf[j], acc[m]);
              acc[m] = fmaf(xv.y, wf[j + 1], acc[m]);
              acc[m] = fmaf(xv.z, wf[j + 2], acc[m]);
              acc[m] = fmaf(xv.w, wf[j + 3], acc[m]);
            }
          } else {
#pragma unroll
            for (int j = 0; j < E; ++j) acc[m] = fmaf(__ldg(x + j), wf[j], acc[m]);
          }
        } else {
          for (int j = 0; j < E && k0 + j < K; ++j) acc[m] = fmaf(__ldg(x + j), wf[j], acc[m]);
        }
      }
    }
  }
  const float s = F == Fmt::FP8 ? scales[n] : 1.f;
  const float b = bias ? bias[n] : 0.f;
#pragma unroll
  for (int m = 0; m < MR; ++m) {
    const float sum = warpSum(acc[m]);
    if (lane == 0 && m < M) out[size_t(m) * N + n] = fmaf(sum, s, b);
  }
}

// ---- tiled: M > 8 ----
constexpr int kTile = 64, kTileK = 32;

template <Fmt F>
__global__ void __launch_bounds__(256)
    tiledKernel(float* __restrict__ out, const float* __restrict__ in,
                const unsigned char* __restrict__ w, const float* __restrict__ scales,
                const float* __restrict__ bias, int M, int K, int N, int Kp) {
  __shared__ __align__(16) float As[kTileK][kTile + 4];  // [k][m]
  __shared__ __align__(16) float Bs[kTileK][kTile + 4];  // [k][n]
  const int tid = threadIdx.x;
  const int m0 = blockIdx.y * kTile, n0 = blockIdx.x * kTile;
  const int tm = (tid / 16) * 4, tn = (tid % 16) * 4;
  float acc[4][4] = {};
  for (int k0 = 0; k0 < K; k0 += kTileK) {
#pragma unroll
    for (int i = 0; i < kTile * kTileK / 256; ++i) {
      const int idx = tid + i * 256;
      const int r = idx / kTileK, kk = idx % kTileK, k = k0 + kk;
      const int m = m0 + r, n = n0 + r;
      As[kk][r] = (m < M && k < K) ? in[size_t(m) * K + k] : 0.f;
      Bs[kk][r] = (n < N && k < K) ? loadElem<F>(w + size_t(n) * Kp * elemBytes<F>(), k) : 0.f;
    }
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < kTileK; ++kk) {
      const float4 a = *reinterpret_cast<const float4*>(&As[kk][tm]);
      const float4 b = *reinterpret_cast<const float4*>(&Bs[kk][tn]);
      const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = m0 + tm + i;
    if (m >= M) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int n = n0 + tn + j;
      if (n >= N) continue;
      const float s = F == Fmt::FP8 ? scales[n] : 1.f;
      out[size_t(m) * N + n] = fmaf(acc[i][j], s, bias ? bias[n] : 0.f);
    }
  }
}

template <Fmt F>
void matmulStorage(float* out, const float* in, const void* w, const float* bias, int M, int K,
                   int N) {
  if (M <= 0 || N <= 0) return;
  const int Kp = paddedK(K);
  const auto* wb = static_cast<const unsigned char*>(w);
  const float* scales =
      F == Fmt::FP8 ? reinterpret_cast<const float*>(wb + size_t(N) * Kp) : nullptr;
  cudaStream_t s = stream();
  if (M <= 8) {
    const bool vecX = K % 4 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0;
    const dim3 grid(ceilDiv(N, kGemvWarps)), block(kGemvWarps * 32);
#define PTLLM_GEMV(MR)                                                                           \
  (vecX ? gemvKernel<F, MR, true><<<grid, block, 0, s>>>(out, in, wb, scales, bias, M, K, N, Kp) \
        : gemvKernel<F, MR, false><<<grid, block, 0, s>>>(out, in, wb, scales, bias, M, K, N, Kp))
    if (M == 1)
      PTLLM_GEMV(1);
    else if (M == 2)
      PTLLM_GEMV(2);
    else if (M <= 4)
      PTLLM_GEMV(4);
    else
      PTLLM_GEMV(8);
#undef PTLLM_GEMV
  } else {
    const dim3 grid(ceilDiv(N, kTile), ceilDiv(M, kTile));
    tiledKernel<F><<<grid, 256, 0, s>>>(out, in, wb, scales, bias, M, K, N, Kp);
  }
  PTLLM_CUDA_LAUNCH_CHECK();
}

// ---- packing ----
// Column max |w[:, n]| (fp8 scales): a thread per column, coalesced across the warp.
__global__ void columnScalesKernel(float* __restrict__ scales, const float* __restrict__ w, int K,
                                   int N) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  float amax = 0.f;
  for (int k = 0; k < K; ++k) amax = fmaxf(amax, fabsf(w[size_t(k) * N + n]));  // NaN dropped
  scales[n] = amax > 0.f ? amax / 448.f : 1.f;  // e4m3's largest finite value is 448
}

// w[K,N] -> dst[N][Kp] through a 32x32 shared tile (coalesced reads and writes). Sets *bad when
// a weight is not representable.
template <Fmt F, bool kTruncate>
__global__ void packKernel(unsigned char* __restrict__ dst, const float* __restrict__ w,
                           const float* __restrict__ scales, int K, int N, int Kp, int* bad) {
  __shared__ float tile[32][33];
  const int k0 = blockIdx.y * 32, n0 = blockIdx.x * 32;
  for (int j = threadIdx.y; j < 32; j += blockDim.y) {
    const int k = k0 + j, n = n0 + threadIdx.x;
    tile[j][threadIdx.x] = (k < K && n < N) ? w[size_t(k) * N + n] : 0.f;
  }
  __syncthreads();
  for (int j = threadIdx.y; j < 32; j += blockDim.y) {
    const int n = n0 + j, k = k0 + threadIdx.x;
    if (n >= N || k >= Kp) continue;
    const float v = tile[threadIdx.x][j];
    bool ok = isfinite(v);
    if constexpr (F == Fmt::F16) {
      __half h = __float2half_rn(v);
      ok = ok && !__hisinf(h);
      if constexpr (kTruncate) {
        const unsigned short bits = __half_as_ushort(h) & 0xFFC0u;
        h = __ushort_as_half(bits);
      }
      reinterpret_cast<__half*>(dst)[size_t(n) * Kp + k] = h;
    } else if constexpr (F == Fmt::BF16) {
      const __nv_bfloat16 h = __float2bfloat16_rn(v);
      ok = ok && !__hisinf(h);
      reinterpret_cast<__nv_bfloat16*>(dst)[size_t(n) * Kp + k] = h;
    } else {
      dst[size_t(n) * Kp + k] = __nv_cvt_float_to_fp8(v / scales[n], __NV_SATFINITE, __NV_E4M3);
    }
    if (!ok) atomicOr(bad, 1);
  }
}

std::mutex gPackMutex;
int* gBadFlag = nullptr;  // device int, guarded by gPackMutex

template <Fmt F, bool kTruncate = false>
bool pack(void* dst, const float* w, int K, int N) {
  if (K <= 0 || N <= 0) return true;
  std::lock_guard<std::mutex> lock(gPackMutex);
  if (!gBadFlag) PTLLM_CUDA_CHECK(cudaMalloc(&gBadFlag, sizeof(int)));
  cudaStream_t s = stream();
  PTLLM_CUDA_CHECK(cudaMemsetAsync(gBadFlag, 0, sizeof(int), s));
  const int Kp = paddedK(K);
  auto* d = static_cast<unsigned char*>(dst);
  float* scales = nullptr;
  if constexpr (F == Fmt::FP8) {
    scales = reinterpret_cast<float*>(d + size_t(N) * Kp);
    columnScalesKernel<<<ceilDiv(N, 256), 256, 0, s>>>(scales, w, K, N);
    PTLLM_CUDA_LAUNCH_CHECK();
  }
  packKernel<F, kTruncate><<<dim3(ceilDiv(N, 32), ceilDiv(Kp, 32)), dim3(32, 8), 0, s>>>(
      d, w, scales, K, N, Kp, gBadFlag);
  PTLLM_CUDA_LAUNCH_CHECK();
  int bad = 0;
  PTLLM_CUDA_CHECK(cudaMemcpyAsync(&bad, gBadFlag, sizeof(int), cudaMemcpyDeviceToHost, s));
  PTLLM_CUDA_CHECK(cudaStreamSynchronize(s));
  return bad == 0;
}

}  // namespace

bool packF16(void* dst, const float* w, int K, int N) {
  return pack<Fmt::F16>(dst, w, K, N);
}
bool packBf16(void* dst, const float* w, int K, int N) {
  return pack<Fmt::BF16>(dst, w, K, N);
}
bool packFp8(void* dst, const float* w, int K, int N) {
  return pack<Fmt::FP8>(dst, w, K, N);
}
bool packF16Truncated(void* dst, const float* w, int K, int N) {
  return pack<Fmt::F16, true>(dst, w, K, N);
}

void matmulF16(float* out, const float* in, const void* w, const float* bias, int M, int K, int N) {
  matmulStorage<Fmt::F16>(out, in, w, bias, M, K, N);
}
void matmulBf16(float* out, const float* in, const void* w, const float* bias, int M, int K,
                int N) {
  matmulStorage<Fmt::BF16>(out, in, w, bias, M, K, N);
}
void matmulFp8(float* out, const float* in, const void* w, const float* bias, int M, int K, int N) {
  matmulStorage<Fmt::FP8>(out, in, w, bias, M, K, N);
}

}  // namespace ptllm::cuda
