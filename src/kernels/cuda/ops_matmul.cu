// f32 matmuls: a register-blocked SGEMM for M > 8 and GEMV-style kernels for M <= 8 (decode).
// Plain FFMA in f32 (no tensor cores, no TF32). Arbitrary M, K, N (K may be 0): every tile load
// and store is bounds-checked; float4 global loads only when every row of the operand starts
// 16-byte aligned.
#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_reduce.cuh"
#include "kernels/cuda/ops_kernels.cuh"

namespace ptllm::cuda {
namespace {

// ---- SGEMM: out[M,N] (+=) A(m,k) B(k,n) (+ bias[n]) ----
// Operand layouts: A is [M,K] (kAKContig: contiguous along k) or [K,M]; B is [N,K] (kBKContig)
// or [K,N]. Block tile BM x BN, depth kBK; each thread a TM x TN micro-tile made of 4x4 pieces
// spread over the tile (rows g*4*TY + ty*4 + r), so shared-memory float4 reads of a warp are
// contiguous (conflict-free) or broadcasts.
template <int BM, int BN, int TM, int TN>
struct GemmCfg {
  static constexpr int kBM = BM, kBN = BN, kBK = 8, kTM = TM, kTN = TN;
  static constexpr int kTX = BN / TN, kTY = BM / TM, kThreads = kTX * kTY;
  static constexpr int kPad = 4;  // keeps rows 16-byte aligned, spreads transposed stores
  static_assert(TM % 4 == 0 && TN % 4 == 0 && kThreads == 256, "4x4 pieces, 256 threads");
};
using BigTile = GemmCfg<128, 128, 8, 8>;
using SmallTile = GemmCfg<64, 64, 4, 4>;

// Four consecutive elements of row r (of `rows`), columns c..c+3 (of `cols`, the row length);
// zeros outside. kVec: rows are 16-byte aligned and cols % 4 == 0 (so c < cols covers c+3).
template <bool kVec>
__device__ __forceinline__ float4 load4(const float* g, int r, int c, int rows, int cols) {
  float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (r >= rows) return v;
  const float* p = g + (int64_t)r * cols + c;
  if (kVec) {
    if (c < cols) v = __ldg(reinterpret_cast<const float4*>(p));
  } else {
    if (c < cols) v.x = __ldg(p);
    if (c + 1 < cols) v.y = __ldg(p + 1);
    if (c + 2 < cols) v.z = __ldg(p + 2);
    if (c + 3 < cols) v.w = __ldg(p + 3);
  }
  return v;
}

// Loads the kBK x BD tile at (k0, d0) of an operand into S[k][d]. kKContig: the operand is
// [D, K] (rows along d, contiguous along k) and the tile is transposed on the way in.
template <class Cfg, int BD, bool kKContig, bool kVec>
__device__ __forceinline__ void loadTile(float (*S)[BD + Cfg::kPad], const float* g, int d0, int k0,
                                         int D, int K) {
  constexpr int kBK = Cfg::kBK;
  if (kKContig) {
    for (int i = threadIdx.x; i < BD * kBK / 4; i += Cfg::kThreads) {
      const int r = i / (kBK / 4), c = (i % (kBK / 4)) * 4;
      const float4 v = load4<kVec>(g, d0 + r, k0 + c, D, K);
      S[c][r] = v.x;
      S[c + 1][r] = v.y;
      S[c + 2][r] = v.z;
      S[c + 3][r] = v.w;
    }
  } else {
    for (int i = threadIdx.x; i < BD * kBK / 4; i += Cfg::kThreads) {
      const int r = i / (BD / 4), c = (i % (BD / 4)) * 4;
      *reinterpret_cast<float4*>(&S[r][c]) = load4<kVec>(g, k0 + r, d0 + c, K, D);
    }
  }
}

template <class Cfg, bool kAKContig, bool kBKContig, bool kVec>
__global__ void __launch_bounds__(256)
    sgemmKernel(float* out, const float* A, const float* B, const float* bias, int M, int K, int N,
                bool accumulate, bool vecOut) {
  constexpr int BM = Cfg::kBM, BN = Cfg::kBN, BK = Cfg::kBK, TM = Cfg::kTM, TN = Cfg::kTN;
  constexpr int TX = Cfg::kTX, TY = Cfg::kTY;
  __shared__ __align__(16) float As[BK][BM + Cfg::kPad];
  __shared__ __align__(16) float Bs[BK][BN + Cfg::kPad];
  const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;

  float acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;

  for (int k0 = 0; k0 < K; k0 += BK) {
    loadTile<Cfg, BM, kAKContig, kVec>(As, A, m0, k0, M, K);
    loadTile<Cfg, BN, kBKContig, kVec>(Bs, B, n0, k0, N, K);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
      float a[TM], b[TN];
#pragma unroll
      for (int g = 0; g < TM / 4; ++g) {
        const float4 v = *reinterpret_cast<const float4*>(&As[kk][g * 4 * TY + ty * 4]);
        a[g * 4] = v.x;
        a[g * 4 + 1] = v.y;
        a[g * 4 + 2] = v.z;
        a[g * 4 + 3] = v.w;
      }
#pragma unroll
      for (int g = 0; g < TN / 4; ++g) {
        const float4 v = *reinterpret_cast<const float4*>(&Bs[kk][g * 4 * TX + tx * 4]);
        b[g * 4] = v.x;
        b[g * 4 + 1] = v.y;
        b[g * 4 + 2] = v.z;
        b[g * 4 + 3] = v.w;
      }
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }

  // Epilogue: + bias, + the old value when accumulating; float4 stores where possible.
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const int m = m0 + (i / 4) * 4 * TY + ty * 4 + i % 4;
    if (m >= M) continue;
    float* row = out + (int64_t)m * N;
#pragma unroll
    for (int g = 0; g < TN / 4; ++g) {
      const int n = n0 + g * 4 * TX + tx * 4;
      if (n >= N) continue;
      float v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = acc[i][g * 4 + j];
      if (vecOut) {  // N % 4 == 0 and out 16-byte aligned: n..n+3 all in range
        float4* p = reinterpret_cast<float4*>(row + n);
        float4 o = make_float4(v[0], v[1], v[2], v[3]);
        if (bias) {
          o.x += bias[n];
          o.y += bias[n + 1];
          o.z += bias[n + 2];
          o.w += bias[n + 3];
        }
        if (accumulate) {
          const float4 old = *p;
          o.x += old.x;
          o.y += old.y;
          o.z += old.z;
          o.w += old.w;
        }
        *p = o;
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (n + j >= N) break;
          float o = v[j];
          if (bias) o += bias[n + j];
          if (accumulate) o += row[n + j];
          row[n + j] = o;
        }
      }
    }
  }
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

template <class Cfg, bool kAKContig, bool kBKContig>
void sgemmWith(float* out, const float* A, const float* B, const float* bias, int M, int K, int N,
               bool accumulate) {
  // float4 loads need every row of both operands 16-byte aligned: aligned base, row length % 4.
  const bool vecA = aligned16(A) && (kAKContig ? K : M) % 4 == 0;
  const bool vecB = aligned16(B) && (kBKContig ? K : N) % 4 == 0;
  const bool vecOut = aligned16(out) && N % 4 == 0;
  const dim3 grid(ceilDiv(N, Cfg::kBN), ceilDiv(M, Cfg::kBM));
  if (vecA && vecB)
    sgemmKernel<Cfg, kAKContig, kBKContig, true>
        <<<grid, Cfg::kThreads, 0, stream()>>>(out, A, B, bias, M, K, N, accumulate, vecOut);
  else
    sgemmKernel<Cfg, kAKContig, kBKContig, false>
        <<<grid, Cfg::kThreads, 0, stream()>>>(out, A, B, bias, M, K, N, accumulate, vecOut);
  PTLLM_CUDA_LAUNCH_CHECK();
}

template <bool kAKContig, bool kBKContig>
void sgemm(float* out, const float* A, const float* B, const float* bias, int M, int K, int N,
           bool accumulate, int sms) {
  // 128x128 tiles once they alone fill every SM; 64x64 (4x more blocks) below that.
  const long long bigTiles = (long long)ceilDiv(M, BigTile::kBM) * ceilDiv(N, BigTile::kBN);
  if (bigTiles >= sms)
    sgemmWith<BigTile, kAKContig, kBKContig>(out, A, B, bias, M, K, N, accumulate);
  else
    sgemmWith<SmallTile, kAKContig, kBKContig>(out, A, B, bias, M, K, N, accumulate);
}

// ---- GEMV for M <= 8: out[m,n] (+=) sum_k A(m,k) w[k,n] (+ bias[n]) ----
// Block: 8 warps x 32 columns. Lane = column (w read coalesced along n), warp = k phase
// (k = warp, warp + 8, ...); the 8 partial sums meet in shared memory, added in warp order.
// A(m,k) = a[m*K + k], or a[k*M + m] when kATrans (matmulAtb with small M).
constexpr int kGemvMaxM = 8, kGemvWarps = 8;

template <bool kATrans>
__global__ void __launch_bounds__(32 * kGemvWarps)
    gemvKernel(float* out, const float* a, const float* w, const float* bias, int M, int K, int N,
               bool accumulate) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n = blockIdx.x * 32 + lane;
  float acc[kGemvMaxM];
#pragma unroll
  for (int m = 0; m < kGemvMaxM; ++m) acc[m] = 0.0f;
  if (n < N) {
#pragma unroll 4
    for (int k = warp; k < K; k += kGemvWarps) {
      const float wv = __ldg(w + (int64_t)k * N + n);
#pragma unroll
      for (int m = 0; m < kGemvMaxM; ++m)
        if (m < M) {
          const float av = kATrans ? __ldg(a + (int64_t)k * M + m) : __ldg(a + (int64_t)m * K + k);
          acc[m] = fmaf(av, wv, acc[m]);
        }
    }
  }
  __shared__ float red[kGemvWarps][kGemvMaxM][33];
#pragma unroll
  for (int m = 0; m < kGemvMaxM; ++m) red[warp][m][lane] = acc[m];
  __syncthreads();
  const int m = warp;  // warp m finishes row m
  if (m < M && n < N) {
    float s = 0.0f;
#pragma unroll
    for (int p = 0; p < kGemvWarps; ++p) s += red[p][m][lane];
    if (bias) s += bias[n];
    float* o = out + (int64_t)m * N + n;
    if (accumulate) s += *o;
    *o = s;
  }
}

// ---- M <= 8 for A·Bᵀ: out[m,n] (+=) sum_k a[m,k] b[n,k]; one warp per column n ----
// Lanes stride over k (a and b rows read coalesced), then a butterfly sum per row.
__global__ void __launch_bounds__(32 * kGemvWarps)
    gemvAbtKernel(float* out, const float* a, const float* b, int M, int K, int N,
                  bool accumulate) {
  const int lane = threadIdx.x & 31;
  const int n = blockIdx.x * kGemvWarps + (threadIdx.x >> 5);
  if (n >= N) return;  // whole warps leave together: no block-level sync below
  const float* brow = b + (int64_t)n * K;
  float acc[kGemvMaxM];
#pragma unroll
  for (int m = 0; m < kGemvMaxM; ++m) acc[m] = 0.0f;
#pragma unroll 4
  for (int k = lane; k < K; k += 32) {
    const float bv = __ldg(brow + k);
#pragma unroll
    for (int m = 0; m < kGemvMaxM; ++m)
      if (m < M) acc[m] = fmaf(__ldg(a + (int64_t)m * K + k), bv, acc[m]);
  }
#pragma unroll
  for (int m = 0; m < kGemvMaxM; ++m) {
    if (m >= M) break;
    const float s = warpSum(acc[m]);
    if (lane == m) {
      float* o = out + (int64_t)m * N + n;
      *o = accumulate ? *o + s : s;
    }
  }
}

template <bool kATrans>
void gemv(float* out, const float* a, const float* w, const float* bias, int M, int K, int N,
          bool accumulate) {
  gemvKernel<kATrans>
      <<<ceilDiv(N, 32), 32 * kGemvWarps, 0, stream()>>>(out, a, w, bias, M, K, N, accumulate);
  PTLLM_CUDA_LAUNCH_CHECK();
}

}  // namespace

void launchMatmul(float* out, const float* in, const float* w, const float* bias, int M, int K,
                  int N, int sms) {
  if (M <= 0 || N <= 0) return;
  if (M <= kGemvMaxM)
    gemv<false>(out, in, w, bias, M, K, N, false);
  else
    sgemm<true, false>(out, in, w, bias, M, K, N, false, sms);
}

void launchMatmulAbt(float* out, const float* a, const float* b, int M, int K, int N,
                     bool accumulate, int sms) {
  if (M <= 0 || N <= 0) return;
  if (M <= kGemvMaxM) {
    gemvAbtKernel<<<ceilDiv(N, kGemvWarps), 32 * kGemvWarps, 0, stream()>>>(out, a, b, M, K, N,
                                                                            accumulate);
    PTLLM_CUDA_LAUNCH_CHECK();
  } else {
    sgemm<true, true>(out, a, b, nullptr, M, K, N, accumulate, sms);
  }
}

void launchMatmulAtb(float* out, const float* a, const float* b, int M, int K, int N,
                     bool accumulate, int sms) {
  if (M <= 0 || N <= 0) return;
  if (M <= kGemvMaxM)
    gemv<true>(out, a, b, nullptr, M, K, N, accumulate);
  else
    sgemm<false, false>(out, a, b, nullptr, M, K, N, accumulate, sms);
}

}  // namespace ptllm::cuda
