// Reduced-precision weight storage on the GPU: f16, bf16 and fp8-e4m3 (per-channel scales).
// Weights are packed once, transposed to [N][Kp] so one warp streams one output column's
// weights with 16-byte loads; products and sums are f32 FFMA (the spec's f16-storage path:
// fewer bytes, same arithmetic). The reference is Ops::matmul (the canonical f32 path).
//
// M <= 8 (decode, short prompts) runs a GEMV-style kernel: a warp per output column, every row
// of the input against the same loaded weights, a shuffle reduction; the cost is the weight
// bytes over memory bandwidth. f16 at M = 1 runs the fastest of the schedule variants below
// (several columns per warp sharing each read of x; the same arithmetic). M > 8 runs a
// shared-memory tiled kernel that widens the weights to f32 as it stages them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <mutex>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_paths.h"
#include "kernels/cuda/storage_formats.cuh"

namespace ptllm::cuda {

namespace {

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

// ---- M = 1 GEMV variants (benchmarks: which schedule streams 16384^2 and 4096^2 fastest) ----
// Each is gemvKernel<F16, 1>'s arithmetic: a warp per output column, lane l accumulating
// vectors l, l+32, ... of the packed row in increasing order, elements in order, the butterfly
// sum, fmaf(sum, 1, bias). Only the schedule differs: warps per block (WPB), loads in flight per
// lane and column (U), columns per warp at once (CPW: one float4 read of x serves them all),
// kPipe (the next round's weight loads issued before this round's arithmetic, two register
// buffers), a persistent grid (as many blocks as fit, columns grid-strided), and MINB (resident
// blocks per SM the register allocation must allow).
template <int WPB, int U, int CPW, bool kPipe, bool kPersistent, int MINB>
__global__ void __launch_bounds__(WPB * 32, MINB)
    gemvF16VariantKernel(float* __restrict__ out, const float* __restrict__ in,
                         const unsigned char* __restrict__ w, const float* __restrict__ bias, int K,
                         int N, int Kp) {
  constexpr int E = perVec<Fmt::F16>();
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * WPB + (threadIdx.x >> 5);
  const int step = kPersistent ? gridDim.x * WPB * CPW : N;  // non-persistent: one round
  const int nvec = Kp / E;
  const bool vecX = K % 4 == 0 && (reinterpret_cast<uintptr_t>(in) & 15) == 0;
  for (int n0 = gw * CPW; n0 < N; n0 += step) {
    const uint4* rows[CPW];
#pragma unroll
    for (int c = 0; c < CPW; ++c)
      rows[c] = reinterpret_cast<const uint4*>(w + size_t(n0 + c < N ? n0 + c : 0) * Kp * 2);
    auto load = [&](uint4(&wv)[CPW][U], int v0) {
#pragma unroll
      for (int c = 0; c < CPW; ++c)
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int v = v0 + u * 32;
          wv[c][u] = n0 + c < N && v < nvec ? loadStreaming(rows[c] + v) : make_uint4(0, 0, 0, 0);
        }
    };
    float acc[CPW];
#pragma unroll
    for (int c = 0; c < CPW; ++c) acc[c] = 0.f;
    auto compute = [&](const uint4(&wv)[CPW][U], int v0) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int k0 = (v0 + u * 32) * E;
        if (k0 >= K) continue;
        float x[E];
        if (vecX && k0 + E <= K) {
#pragma unroll
          for (int j = 0; j < E; j += 4) {
            const float4 xv = __ldg(reinterpret_cast<const float4*>(in + k0 + j));
            x[j] = xv.x;
            x[j + 1] = xv.y;
            x[j + 2] = xv.z;
            x[j + 3] = xv.w;
          }
        } else {
#pragma unroll
          for (int j = 0; j < E; ++j) x[j] = k0 + j < K ? __ldg(in + k0 + j) : 0.f;
        }
#pragma unroll
        for (int c = 0; c < CPW; ++c) {
          float wf[E];
          unpackVec<Fmt::F16>(wv[c][u], wf);
#pragma unroll
          for (int j = 0; j < E; ++j)
            if (k0 + j < K) acc[c] = fmaf(x[j], wf[j], acc[c]);
        }
      }
    };
    if constexpr (kPipe) {
      uint4 a[CPW][U], b[CPW][U];
      int v0 = lane;
      load(a, v0);
      while (true) {
        if (v0 + 32 * U < nvec) load(b, v0 + 32 * U);
        compute(a, v0);
        v0 += 32 * U;
        if (v0 >= nvec) break;
        if (v0 + 32 * U < nvec) load(a, v0 + 32 * U);
        compute(b, v0);
        v0 += 32 * U;
        if (v0 >= nvec) break;
      }
    } else {
      for (int v0 = lane; v0 < nvec; v0 += 32 * U) {
        uint4 wv[CPW][U];
        load(wv, v0);
        compute(wv, v0);
      }
    }
#pragma unroll
    for (int c = 0; c < CPW; ++c) {
      const int n = n0 + c;
      const float sum = warpSum(acc[c]);
      if (lane == 0 && n < N) out[n] = fmaf(sum, 1.f, bias ? bias[n] : 0.f);
    }
  }
}

struct GemvVariant {
  const char* name;
  void (*launch)(float*, const float*, const unsigned char*, const float*, int, int, int);
};

template <int WPB, int U, int CPW, bool kPipe, bool kPersistent, int MINB = 1>
void launchGemvVariant(float* out, const float* in, const unsigned char* w, const float* bias,
                       int K, int N, int Kp) {
  auto kernel = gemvF16VariantKernel<WPB, U, CPW, kPipe, kPersistent, MINB>;
  const int cols = WPB * CPW;
  unsigned blocks = ceilDiv(N, cols);
  if constexpr (kPersistent) {
    static const unsigned resident = [kernel] {  // asked once: not inside the timed calls
      int perSm = 0, dev = 0, sms = 0;
      PTLLM_CUDA_CHECK(cudaGetDevice(&dev));
      PTLLM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
      PTLLM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&perSm, kernel, WPB * 32, 0));
      return unsigned(std::max(1, perSm * sms));
    }();
    blocks = std::min(blocks, resident);
  }
  kernel<<<blocks, WPB * 32, 0, stream()>>>(out, in, w, bias, K, N, Kp);
  PTLLM_CUDA_LAUNCH_CHECK();
}

const GemvVariant kGemvVariants[] = {
    {"8w-u8", launchGemvVariant<8, 8, 1, false, false>},  // gemvKernel (M = 2..8, bf16, fp8)
    {"8w-u8-2col", launchGemvVariant<8, 8, 2, false, false>},
    {"8w-u4-2col", launchGemvVariant<8, 4, 2, false, false>},
    {"8w-u4-4col", launchGemvVariant<8, 4, 4, false, false>},
    {"8w-u2-4col", launchGemvVariant<8, 2, 4, false, false>},
    {"8w-u8-pipe", launchGemvVariant<8, 8, 1, true, false>},
    {"8w-u4-pipe", launchGemvVariant<8, 4, 1, true, false>},
    {"8w-u4-2col-pipe", launchGemvVariant<8, 4, 2, true, false>},
    {"8w-u2-4col-pipe", launchGemvVariant<8, 2, 4, true, false>},
    {"4w-u8-pipe", launchGemvVariant<4, 8, 1, true, false>},
    {"8w-u16", launchGemvVariant<8, 16, 1, false, false>},
    {"8w-u4-2col-pipe-persistent", launchGemvVariant<8, 4, 2, true, true>},
    {"8w-u8-pipe-b3", launchGemvVariant<8, 8, 1, true, false, 3>},
    {"8w-u4-2col-pipe-b4", launchGemvVariant<8, 4, 2, true, false, 4>},
    {"8w-u4-pipe-b4", launchGemvVariant<8, 4, 1, true, false, 4>},
};

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
  if constexpr (F == Fmt::F16) {
    if (M == 1) {
      // The sweep's fastest schedules on the H200 (bench/results/cuda-20261203-1343.txt):
      // four columns per warp, two loads each in flight, pipelined, at 16384^2 (3.88 TB/s);
      // two columns, four loads each, at 4096^2 (17.6 us). Same arithmetic as gemvKernel.
      if (int64_t(K) * N >= (int64_t(1) << 26))
        launchGemvVariant<8, 2, 4, true, false>(out, in, wb, bias, K, N, Kp);
      else
        launchGemvVariant<8, 4, 2, false, false>(out, in, wb, bias, K, N, Kp);
      return;
    }
  }
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

int gemvF16VariantCount() {
  return int(sizeof(kGemvVariants) / sizeof(kGemvVariants[0]));
}
const char* gemvF16VariantName(int v) {
  return kGemvVariants[v].name;
}
void gemvF16Variant(int v, float* out, const float* in, const void* w, const float* bias, int K,
                    int N) {
  if (N <= 0) return;
  kGemvVariants[v].launch(out, in, static_cast<const unsigned char*>(w), bias, K, N, paddedK(K));
}

}  // namespace ptllm::cuda
