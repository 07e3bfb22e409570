// Canonical CPU f32 matmuls (f32 multiply, f32 FMA accumulate), Highway runtime dispatch.
//
// GEMM (M > kGemvRows, and all of matmulAbt/matmulAtb): GotoBLAS-style blocking. Per thread,
// a KC x NC block of B is packed into NR-wide k-major panels (zero padded past N) and an
// MC x KC block of A into MR-row panels (zero padded past M; row-major or k-major, whichever
// the source copies straight into, see PackA; row-major A whose rows are not 4 KiB multiples
// apart is read in place, DirectA); an MR x NR register tile
// (MR rows x NV vectors) then runs over each panel pair. Packing absorbs the transposes of
// matmulAbt (B = b^T) and matmulAtb (A = a^T), and the f16 -> f32 promotion of matmulF16's
// B, so one micro-kernel serves all of them. Work is split over the pool by rows of C or by
// columns of C, whichever duplicates less packing.
// GEMV (matmul with M <= kGemvRows, the decode path): streams w[K,N] once, row after row,
// accumulating into the output rows (kept in L1 by 1024-column sub-blocks); the columns are
// split over the pool.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/half.h"
#include "core/thread_pool.h"
#include "kernels/cpu/cpu_kernels.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/matmul.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#ifndef PTLLM_KERNELS_CPU_MATMUL_ONCE
#define PTLLM_KERNELS_CPU_MATMUL_ONCE
#include "kernels/cpu/scratch.h"

namespace ptllm::cpu::detail {

// Where B comes from: row-major [K,N] f32, transposed ([N,K], matmulAbt) or f16 in
// matmul_f16.cpp's panel-major layout ([ceil(N/NB)][K][NB], NB = kF16PanelCols).
enum class BSrc { kRowMajor, kTransposed, kF16 };

inline thread_local Scratch tlsA, tlsB;  // per-thread packed panels of A and B
inline thread_local Scratch tlsC;        // matmulAtb's per-thread partial products

}  // namespace ptllm::cpu::detail
#endif

HWY_BEFORE_NAMESPACE();
namespace ptllm::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using detail::BSrc;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

#if HWY_TARGET <= HWY_AVX3
constexpr int kMR = 8, kNV = 2;  // 16 accumulators of 32 zmm registers
#else
constexpr int kMR = 6, kNV = 2;  // 12 accumulators of 16 ymm/xmm registers
#endif
constexpr int kKC = 256;   // k depth of a block: A panel MR*KC*4 = 8 KiB, B panel KC*NR*4 in L1
constexpr int kNC = 1536;  // B block KC x NC <= 1.5 MiB, streamed from L2/L3 panel by panel
constexpr int kMC = kMR * 16;
constexpr int kGemvRows = 4;

// A(m,k) = a[m*am + k*ak] for rows [m0, m0+mc), k in [k0, k0+kc) -> MR-row panels, zero
// padded past mc, laid out as the source makes a straight copy: row-major A (ak == 1: matmul,
// matmulAbt) as row panels ap[panel][MR][kc] (each row one memcpy), column-major A (am == 1:
// matmulAtb) as k-major panels ap[panel][kc][MR] (MR contiguous values per k). The
// micro-kernel broadcasts from either (kRowPanel); an element-wise transpose here cost ~15%
// of the GEMM time.
HWY_NOINLINE void PackA(float* HWY_RESTRICT ap, const float* HWY_RESTRICT a, int64_t am, int64_t ak,
                        int m0, int mc, int k0, int kc) {
  if (ak == 1) {
    for (int p = 0; p < mc; p += kMR) {
      float* dst = ap + (int64_t)p * kc;
      const int rows = std::min(kMR, mc - p);
      for (int i = 0; i < rows; ++i)
        std::memcpy(dst + (int64_t)i * kc, a + (int64_t)(m0 + p + i) * am + k0, sizeof(float) * kc);
      std::fill(dst + (int64_t)rows * kc, dst + (int64_t)kMR * kc, 0.0f);
    }
    return;
  }
  // am == 1 (matmulAtb): the k row's values of all the panels are one contiguous source run,
  // read once front to back (panel by panel, each source line was read twice, kc rows apart).
  for (int k = 0; k < kc; ++k) {
    const float* src = a + (int64_t)(k0 + k) * ak + m0;
    int p = 0;
    for (; p + kMR <= mc; p += kMR)
      std::memcpy(ap + (int64_t)p * kc + k * kMR, src + p, sizeof(float) * kMR);
    if (p < mc) {
      float* d = ap + (int64_t)p * kc + k * kMR;
      for (int i = 0; i < mc - p; ++i) d[i] = src[p + i];
      for (int i = mc - p; i < kMR; ++i) d[i] = 0.0f;
    }
  }
}

// B(k,n) for k in [k0, k0+kc), n in [n0, n0+nc) -> NR-wide panels bp[panel][k][NR], zero
// padded past nc. ldb: row stride of the source ([K,N]: N; transposed [N,K]: K); for kF16 the
// source's K (its panels hold ldb * kF16PanelCols elements). colsum (kRowMajor only, may be
// null): colsum[0:nc) += sum over the kc rows of B, summed in f32 per block, then added.
template <BSrc kSrc>
HWY_NOINLINE void PackB(float* HWY_RESTRICT bp, const void* HWY_RESTRICT bsrc, int64_t ldb, int n0,
                        int nc, int k0, int kc, float* HWY_RESTRICT colsum) {
  const DF d;
  const int L = (int)hn::Lanes(d);
  const int NR = kNV * L;
  if constexpr (kSrc == BSrc::kRowMajor) {
    // Row k's run [n0, n0+nc) is read once, front to back, and dealt out to the panels. (Panel
    // by panel, each k row of B was a new page when N >= 1024, and GCC turned the per-row copy
    // into a memcpy call: ~13% of matmulAtb.)
    // With colsum, the rows pass through registers anyway: the bias gradient of matmulAtbBias
    // costs no extra pass over B.
    const int full = nc / NR * NR;
    HWY_ALIGN float sums[kNC];
    if (colsum) std::fill(sums, sums + nc, 0.0f);
    for (int k = 0; k < kc; ++k) {
      const float* src = static_cast<const float*>(bsrc) + (int64_t)(k0 + k) * ldb + n0;
      for (int p = 0; p < full; p += NR) {
        float* drow = bp + (int64_t)p * kc + (int64_t)k * NR;
#pragma GCC unroll 4
        for (int v = 0; v < kNV; ++v) {
          const VF x = hn::LoadU(d, src + p + v * L);
          hn::Store(x, d, drow + v * L);
          if (colsum) hn::Store(hn::Add(hn::Load(d, sums + p + v * L), x), d, sums + p + v * L);
        }
      }
      if (full < nc) {
        float* drow = bp + (int64_t)full * kc + (int64_t)k * NR;
        int j = 0;
        for (; j < nc - full; ++j) drow[j] = src[full + j];
        for (; j < NR; ++j) drow[j] = 0.0f;
        if (colsum)
          for (j = 0; j < nc - full; ++j) sums[full + j] += src[full + j];
      }
    }
    if (colsum)
      for (int j = 0; j < nc; ++j) colsum[j] += sums[j];
    return;
  }
  for (int p = 0; p < nc; p += NR) {
    float* dst = bp + (int64_t)p * kc;
    const int cols = std::min(NR, nc - p);
    if constexpr (kSrc == BSrc::kTransposed) {
      const float* b = static_cast<const float*>(bsrc);
      for (int j = 0; j < cols; ++j) {
        const float* src = b + (int64_t)(n0 + p + j) * ldb + k0;
        for (int k = 0; k < kc; ++k) dst[k * NR + j] = src[k];
      }
      if (cols < NR)
        for (int k = 0; k < kc; ++k)
          for (int j = cols; j < NR; ++j) dst[k * NR + j] = 0.0f;
    } else {  // f16 panels: column n of row k at (n/NB)*ldb*NB + k*NB + n%NB
      constexpr int NB = detail::kF16PanelCols;
      const hn::Rebind<hwy::float16_t, DF> dh;
      const uint16_t* b16 = static_cast<const uint16_t*>(bsrc);
      for (int j = 0; j < cols;) {  // runs of columns within one f16 panel
        const int n = n0 + p + j;
        const int run = std::min(cols - j, NB - n % NB);
        const uint16_t* src = b16 + (int64_t)(n / NB) * ldb * NB + (int64_t)k0 * NB + n % NB;
        const int vrun = run / L * L;
        for (int k = 0; k < kc; ++k) {
          const uint16_t* s = src + (int64_t)k * NB;
          float* drow = dst + (int64_t)k * NR + j;
          int t = 0;
          for (; t < vrun; t += L)
            hn::StoreU(
                hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(s + t))), d,
                drow + t);
          for (; t < run; ++t) drow[t] = f16ToF32(s[t]);
        }
        j += run;
      }
      if (cols < NR)
        for (int k = 0; k < kc; ++k)
          for (int j = cols; j < NR; ++j) dst[k * NR + j] = 0.0f;
    }
  }
}

// C[rows<=MR, cols<=NR] (=/+=) A @ bp[kc][NR], A the panel ap[MR][kc] (kRowPanel) or
// ap[kc][MR]. add: C += acc; else C = acc (+ bias).
template <bool kRowPanel>
HWY_INLINE void MicroKernel(const float* HWY_RESTRICT ap, int64_t lda, const float* HWY_RESTRICT bp,
                            int kc, float* HWY_RESTRICT c, int64_t ldc, int rows, int cols,
                            bool add, const float* HWY_RESTRICT bias) {
  const DF d;
  const int L = (int)hn::Lanes(d);
  const int NR = kNV * L;
  VF acc[kMR][kNV];
#pragma GCC unroll 16
  for (int i = 0; i < kMR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) acc[i][v] = hn::Zero(d);
  for (int k = 0; k < kc; ++k) {
    VF b[kNV];
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) b[v] = hn::Load(d, bp + (int64_t)k * NR + v * L);
#pragma GCC unroll 16
    for (int i = 0; i < kMR; ++i) {
      const VF a = hn::Set(d, kRowPanel ? ap[i * lda + k] : ap[k * kMR + i]);
#pragma GCC unroll 4
      for (int v = 0; v < kNV; ++v) acc[i][v] = hn::MulAdd(a, b[v], acc[i][v]);
    }
  }
  if (cols == NR) {
    VF bv[kNV];
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) bv[v] = bias ? hn::LoadU(d, bias + v * L) : hn::Zero(d);
#pragma GCC unroll 16
    for (int i = 0; i < kMR; ++i) {
      if (i >= rows) break;
      float* cr = c + i * ldc;
#pragma GCC unroll 4
      for (int v = 0; v < kNV; ++v) {
        const VF base = add ? hn::LoadU(d, cr + v * L) : bv[v];
        hn::StoreU(hn::Add(base, acc[i][v]), d, cr + v * L);
      }
    }
  } else {  // partial columns: through a buffer, touching nothing past cols. (Highway's
            // MaskedLoad / BlendedStore load and store whole vectors on SSE4/SSSE3: they read
            // past the end of C and rewrote columns that another thread owns.)
    HWY_ALIGN float tmp[kNV * HWY_LANES(float)];
#pragma GCC unroll 16
    for (int i = 0; i < kMR; ++i) {
      if (i >= rows) break;
      float* cr = c + i * ldc;
#pragma GCC unroll 4
      for (int v = 0; v < kNV; ++v) hn::Store(acc[i][v], d, tmp + v * L);
      for (int j = 0; j < cols; ++j) cr[j] = (add ? cr[j] : bias ? bias[j] : 0.0f) + tmp[j];
    }
  }
}

// Whether row-major A is read in place by the micro-kernel instead of packed: rows whose
// stride puts MR of them in few L1 sets (multiples of 4 KiB) conflict with the B panel.
inline bool DirectA(int64_t am) {
  return (am * (int64_t)sizeof(float)) % 4096 != 0;
}

// C[m0:m1, n0:n1] (=/+=) A @ B (+ bias), A(m,k) = a[m*am + k*ak], B as kSrc. colsum
// (kRowMajor, may be null): colsum[n0:n1) += column sums of B, by the range that holds row 0
// (every column is in exactly one such range).
template <BSrc kSrc>
void GemmRange(float* c, const float* a, int64_t am, int64_t ak, const void* b, int64_t ldb,
               const float* bias, int M, int K, int N, bool accumulate, int m0, int m1, int n0,
               int n1, float* colsum) {
  (void)M;
  const DF d;
  const int NR = kNV * (int)hn::Lanes(d);
  const int kcMax = std::min(K, kKC);
  const int ncMax = std::min(n1 - n0, kNC);
  float* bp = detail::tlsB.get((size_t)kcMax * ((ncMax + NR - 1) / NR * NR));
  float* ap = detail::tlsA.get((size_t)kcMax * std::min(kMC, (m1 - m0 + kMR - 1) / kMR * kMR));
  for (int nc0 = n0; nc0 < n1; nc0 += kNC) {
    const int nc = std::min(kNC, n1 - nc0);
    for (int k0 = 0; k0 < K; k0 += kKC) {
      const int kc = std::min(kKC, K - k0);
      const bool add = accumulate || k0 > 0;
      const float* bb = (k0 == 0 && bias) ? bias : nullptr;
      PackB<kSrc>(bp, b, ldb, nc0, nc, k0, kc, colsum && m0 == 0 ? colsum + nc0 : nullptr);
      for (int mc0 = m0; mc0 < m1; mc0 += kMC) {
        const int mc = std::min(kMC, m1 - mc0);
        // Row-major A with whole MR-row panels is read in place (rows am apart).
        const bool direct = ak == 1 && mc % kMR == 0 && DirectA(am);
        if (!direct) PackA(ap, a, am, ak, mc0, mc, k0, kc);
        for (int jp = 0; jp < nc; jp += NR) {
          const float* bpan = bp + (int64_t)jp * kc;
          const int cols = std::min(NR, nc - jp);
          for (int ip = 0; ip < mc; ip += kMR) {
            float* ct = c + (int64_t)(mc0 + ip) * N + nc0 + jp;
            const int rows = std::min(kMR, mc - ip);
            const float* bt = bb ? bb + nc0 + jp : nullptr;
            if (direct)
              MicroKernel<true>(a + (int64_t)(mc0 + ip) * am + k0, am, bpan, kc, ct, N, rows, cols,
                                add, bt);
            else if (ak == 1)
              MicroKernel<true>(ap + (int64_t)ip * kc, kc, bpan, kc, ct, N, rows, cols, add, bt);
            else
              MicroKernel<false>(ap + (int64_t)ip * kc, kc, bpan, kc, ct, N, rows, cols, add, bt);
          }
        }
      }
    }
  }
}

template <BSrc kSrc>
void Gemm(float* c, const float* a, int64_t am, int64_t ak, const void* b, int64_t ldb,
          const float* bias, int M, int K, int N, bool accumulate, float* colsum = nullptr) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {  // empty sum: C = bias (or 0), or unchanged when accumulating
    if (!accumulate)
      for (int m = 0; m < M; ++m)
        for (int n = 0; n < N; ++n) c[(int64_t)m * N + n] = bias ? bias[n] : 0.0f;
    return;
  }
  const DF d;
  const int NR = kNV * (int)hn::Lanes(d);
  const int T = threadCount();
  const int mPanels = (M + kMR - 1) / kMR, nPanels = (N + NR - 1) / NR;
  const double flops = 2.0 * M * N * K;
  // Split columns when rows are fewer (each thread then packs only its share of B; it packs
  // all of A), rows otherwise.
  const bool splitN = (M < N && nPanels >= 2 * T) || mPanels < 2 * T;
  const int64_t units = (T == 1 || flops < 2e6) ? 1 : (splitN ? nPanels : mPanels);
  pool().parallelFor(units, 1, [&](int64_t u0, int64_t u1) {
    if (units == 1)
      GemmRange<kSrc>(c, a, am, ak, b, ldb, bias, M, K, N, accumulate, 0, M, 0, N, colsum);
    else if (splitN)
      GemmRange<kSrc>(c, a, am, ak, b, ldb, bias, M, K, N, accumulate, 0, M, (int)u0 * NR,
                      (int)std::min<int64_t>(u1 * NR, N), colsum);
    else
      GemmRange<kSrc>(c, a, am, ak, b, ldb, bias, M, K, N, accumulate, (int)u0 * kMR,
                      (int)std::min<int64_t>(u1 * kMR, M), 0, N, colsum);
  });
}

// out[R,N] = in[R,K] @ w[K,N] + bias for R <= kGemvRows: streams w once, four k rows at a time.
template <int R>
void GemvRows(float* out, const float* in, const float* w, const float* bias, int K, int N) {
  const DF d;
  const int L = (int)hn::Lanes(d);
  constexpr int kCB = 1024;  // output sub-block: R x 4 KiB stays in L1 while w streams through
  const int64_t nBlocks = (N + 63) / 64;
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max(K, 1));  // >= ~256K MACs a task
  pool().parallelFor(nBlocks, grain, [&](int64_t b0, int64_t b1) {
    const int nb = (int)(b0 * 64), ne = (int)std::min<int64_t>(b1 * 64, N);
    for (int s0 = nb; s0 < ne; s0 += kCB) {
      const int s1 = std::min(ne, s0 + kCB);
      const int vend = s0 + (s1 - s0) / L * L;
      for (int r = 0; r < R; ++r)
        for (int n = s0; n < s1; ++n) out[(int64_t)r * N + n] = bias ? bias[n] : 0.0f;
      int k = 0;
      for (; k + 4 <= K; k += 4) {
        const float* w0 = w + (int64_t)k * N;
        const float* w1 = w0 + N;
        const float* w2 = w1 + N;
        const float* w3 = w2 + N;
        VF x[R][4];
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < 4; ++j) x[r][j] = hn::Set(d, in[(int64_t)r * K + k + j]);
        for (int n = s0; n < vend; n += L) {
          const VF v0 = hn::LoadU(d, w0 + n), v1 = hn::LoadU(d, w1 + n);
          const VF v2 = hn::LoadU(d, w2 + n), v3 = hn::LoadU(d, w3 + n);
          for (int r = 0; r < R; ++r) {
            float* o = out + (int64_t)r * N + n;
            VF acc = hn::MulAdd(x[r][0], v0, hn::LoadU(d, o));
            acc = hn::MulAdd(x[r][1], v1, acc);
            acc = hn::MulAdd(x[r][2], v2, acc);
            hn::StoreU(hn::MulAdd(x[r][3], v3, acc), d, o);
          }
        }
        for (int n = vend; n < s1; ++n)
          for (int r = 0; r < R; ++r) {
            const float* xr = in + (int64_t)r * K + k;
            out[(int64_t)r * N + n] +=
                xr[0] * w0[n] + xr[1] * w1[n] + xr[2] * w2[n] + xr[3] * w3[n];
          }
      }
      for (; k < K; ++k) {
        const float* w0 = w + (int64_t)k * N;
        for (int r = 0; r < R; ++r) {
          const float xv = in[(int64_t)r * K + k];
          const VF x = hn::Set(d, xv);
          float* o = out + (int64_t)r * N;
          int n = s0;
          for (; n < vend; n += L)
            hn::StoreU(hn::MulAdd(x, hn::LoadU(d, w0 + n), hn::LoadU(d, o + n)), d, o + n);
          for (; n < s1; ++n) o[n] += xv * w0[n];
        }
      }
    }
  });
}

void MatmulT(float* out, const float* in, const float* w, const float* bias, int M, int K, int N) {
  switch (M) {
    case 1:
      return GemvRows<1>(out, in, w, bias, K, N);
    case 2:
      return GemvRows<2>(out, in, w, bias, K, N);
    case 3:
      return GemvRows<3>(out, in, w, bias, K, N);
    case 4:
      return GemvRows<4>(out, in, w, bias, K, N);
    default:
      return Gemm<BSrc::kRowMajor>(out, in, K, 1, w, N, bias, M, K, N, false);
  }
}

// out[R,N] (+)= a[R,K] @ b[N,K]^T for R <= kGemvRows (decode logits): dot products, 4 b rows
// at a time, streaming b once.
template <int R>
void AbtRows(float* out, const float* a, const float* b, int K, int N, bool accumulate) {
  const DF d;
  const int L = (int)hn::Lanes(d);
  const int kend = K / L * L;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max(K, 1));
  pool().parallelFor(N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n += 4) {
      const int nn = (int)std::min<int64_t>(4, n1 - n);
      const float* br[4];
      for (int j = 0; j < 4; ++j) br[j] = b + (n + std::min(j, nn - 1)) * K;  // clamp: no OOB
      VF acc[R][4];
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) acc[r][j] = hn::Zero(d);
      for (int k = 0; k < kend; k += L) {
        VF bv[4];
        for (int j = 0; j < 4; ++j) bv[j] = hn::LoadU(d, br[j] + k);
        for (int r = 0; r < R; ++r) {
          const VF av = hn::LoadU(d, a + (int64_t)r * K + k);
          for (int j = 0; j < 4; ++j) acc[r][j] = hn::MulAdd(av, bv[j], acc[r][j]);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < nn; ++j) {
          float s = hn::GetLane(hn::SumOfLanes(d, acc[r][j]));
          for (int k = kend; k < K; ++k) s += a[(int64_t)r * K + k] * br[j][k];
          float& o = out[(int64_t)r * N + n + j];
          o = accumulate ? o + s : s;
        }
    }
  });
}

void MatmulAbtT(float* out, const float* a, const float* b, int M, int K, int N, bool accumulate) {
  switch (M) {
    case 1:
      return AbtRows<1>(out, a, b, K, N, accumulate);
    case 2:
      return AbtRows<2>(out, a, b, K, N, accumulate);
    case 3:
      return AbtRows<3>(out, a, b, K, N, accumulate);
    case 4:
      return AbtRows<4>(out, a, b, K, N, accumulate);
    default:
      return Gemm<BSrc::kTransposed>(out, a, K, 1, b, K, nullptr, M, K, N, accumulate);
  }
}

// matmulAtb's weight gradients have K (tokens) far above M and N: split K over the pool, each
// thread its own C. (Split by rows or columns of C, every thread packed all of A = in^T or all
// of B = dOut, MiBs, for a C of a few hundred KiB.) Thread t > 0 leaves its partial C (and
// column sums) in scratch; they are added into out (and dbias) in thread order afterwards.
bool AtbSplitsK(int M, int K, int N) {
  const int T = threadCount();
  return T > 1 && K >= 2 * T * kKC && K >= 4 * std::max(M, N);
}

void AtbSplitK(float* out, float* dbias, const float* a, const float* b, int M, int K, int N,
               bool accumulate) {
  const int T = threadCount();
  const int64_t mn = (int64_t)M * N;
  float* part = detail::tlsC.get((size_t)(T - 1) * (size_t)(mn + N));  // [T-1][M*N] C
  float* sums = part + (T - 1) * mn;                                   // [T-1][N] column sums
  if (dbias) std::fill(sums, sums + (int64_t)(T - 1) * N, 0.0f);
  const int blocks = (K + kKC - 1) / kKC;  // >= 2T: no thread's range is empty
  pool().run(T, [&](int t) {
    const int kb = (int)((int64_t)blocks * t / T) * kKC;
    const int ke = std::min(K, (int)((int64_t)blocks * (t + 1) / T) * kKC);
    float* c = t == 0 ? out : part + (t - 1) * mn;
    float* cs = !dbias ? nullptr : t == 0 ? dbias : sums + (int64_t)(t - 1) * N;
    GemmRange<BSrc::kRowMajor>(c, a + (int64_t)kb * M, 1, M, b + (int64_t)kb * N, N, nullptr, M,
                               ke - kb, N, t == 0 && accumulate, 0, M, 0, N, cs);
  });
  pool().parallelFor(mn, 1 << 14, [&](int64_t i0, int64_t i1) {
    for (int t = 1; t < T; ++t) {
      const float* p = part + (t - 1) * mn;
      for (int64_t i = i0; i < i1; ++i) out[i] += p[i];
    }
  });
  if (dbias)
    for (int t = 1; t < T; ++t)
      for (int n = 0; n < N; ++n) dbias[n] += sums[(int64_t)(t - 1) * N + n];
}

void MatmulAtbT(float* out, const float* a, const float* b, int M, int K, int N, bool accumulate) {
  if (AtbSplitsK(M, K, N)) return AtbSplitK(out, nullptr, a, b, M, K, N, accumulate);
  Gemm<BSrc::kRowMajor>(out, a, 1, M, b, N, nullptr, M, K, N, accumulate);
}

// matmulAtb and dbias[N] += column sums of b[K,N] (summed while B is packed). M, N, K >= 1.
void MatmulAtbBiasT(float* out, float* dbias, const float* a, const float* b, int M, int K, int N,
                    bool accumulate) {
  if (AtbSplitsK(M, K, N)) return AtbSplitK(out, dbias, a, b, M, K, N, accumulate);
  Gemm<BSrc::kRowMajor>(out, a, 1, M, b, N, nullptr, M, K, N, accumulate, dbias);
}

void MatmulF16GemmT(float* out, const float* in, const uint16_t* w16, const float* bias, int M,
                    int K, int N) {
  Gemm<BSrc::kF16>(out, in, K, 1, w16, K, bias, M, K, N, false);
}

// dbias[N] += column sums of dout[M,N]; columns split over the pool, rows summed in f32
// vectors 4 at a time.
void BiasBackwardT(float* dbias, const float* dout, int M, int N) {
  const DF d;
  const int L = (int)hn::Lanes(d);
  const int64_t nBlocks = (N + 63) / 64;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max(M, 1));
  pool().parallelFor(nBlocks, grain, [&](int64_t b0, int64_t b1) {
    const int nb = (int)(b0 * 64), ne = (int)std::min<int64_t>(b1 * 64, N);
    int n = nb;
    for (; n + L <= ne; n += L) {
      VF s0 = hn::Zero(d), s1 = hn::Zero(d), s2 = hn::Zero(d), s3 = hn::Zero(d);
      int m = 0;
      for (; m + 4 <= M; m += 4) {
        const float* p = dout + (int64_t)m * N + n;
        s0 = hn::Add(s0, hn::LoadU(d, p));
        s1 = hn::Add(s1, hn::LoadU(d, p + N));
        s2 = hn::Add(s2, hn::LoadU(d, p + 2 * N));
        s3 = hn::Add(s3, hn::LoadU(d, p + 3 * N));
      }
      for (; m < M; ++m) s0 = hn::Add(s0, hn::LoadU(d, dout + (int64_t)m * N + n));
      const VF s = hn::Add(hn::Add(s0, s1), hn::Add(s2, s3));
      hn::StoreU(hn::Add(s, hn::LoadU(d, dbias + n)), d, dbias + n);
    }
    for (; n < ne; ++n) {
      float s = 0;
      for (int m = 0; m < M; ++m) s += dout[(int64_t)m * N + n];
      dbias[n] += s;
    }
  });
}

// The micro-kernel's ceiling: its kMR x kNV independent accumulators, one FMA each per step
// and nothing else, for `steps` steps. Stores a value that depends on every accumulator in
// *sink (so the loop is not dropped) and returns the flops done.
double FmaCeilingT(int64_t steps, float* sink) {
  const DF d;
  const VF b = hn::Set(d, 0.999999f), c = hn::Set(d, 1e-7f);
  VF acc[kMR][kNV];
  for (int i = 0; i < kMR; ++i)
    for (int v = 0; v < kNV; ++v) acc[i][v] = hn::Set(d, float(i * kNV + v));
  for (int64_t k = 0; k < steps; ++k) {
#pragma GCC unroll 16
    for (int i = 0; i < kMR; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < kNV; ++v) acc[i][v] = hn::MulAdd(acc[i][v], b, c);
  }
  VF sum = hn::Zero(d);
  for (int i = 0; i < kMR; ++i)
    for (int v = 0; v < kNV; ++v) sum = hn::Add(sum, acc[i][v]);
  *sink = hn::GetLane(hn::SumOfLanes(d, sum));
  return 2.0 * double(steps) * kMR * kNV * double(hn::Lanes(d));
}

}  // namespace ptllm::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ptllm::cpu {

HWY_EXPORT(MatmulT);
HWY_EXPORT(MatmulAbtT);
HWY_EXPORT(MatmulAtbT);
HWY_EXPORT(MatmulAtbBiasT);
HWY_EXPORT(MatmulF16GemmT);
HWY_EXPORT(BiasBackwardT);
HWY_EXPORT(FmaCeilingT);

void matmul(float* out, const float* in, const float* w, const float* bias, int M, int K, int N) {
  HWY_DYNAMIC_DISPATCH(MatmulT)(out, in, w, bias, M, K, N);
}
void matmulAbt(float* out, const float* a, const float* b, int M, int K, int N, bool accumulate) {
  HWY_DYNAMIC_DISPATCH(MatmulAbtT)(out, a, b, M, K, N, accumulate);
}
void matmulAtb(float* out, const float* a, const float* b, int M, int K, int N, bool accumulate) {
  HWY_DYNAMIC_DISPATCH(MatmulAtbT)(out, a, b, M, K, N, accumulate);
}
void matmulAtbBias(float* out, float* dbias, const float* a, const float* b, int M, int K, int N,
                   bool accumulate) {
  if (M <= 0 || K <= 0 || N <= 0) {  // nothing to pack B for: the two ops one after the other
    matmulAtb(out, a, b, M, K, N, accumulate);
    return biasBackward(dbias, b, K, N);
  }
  HWY_DYNAMIC_DISPATCH(MatmulAtbBiasT)(out, dbias, a, b, M, K, N, accumulate);
}
void biasBackward(float* dbias, const float* dout, int M, int N) {
  if (M <= 0 || N <= 0) return;
  HWY_DYNAMIC_DISPATCH(BiasBackwardT)(dbias, dout, M, N);
}

double fmaCeilingGflops(double seconds) {
  const int T = threadCount();
  std::vector<double> gflops(static_cast<size_t>(T));
  pool().run(T, [&](int t) {
    float sink = 0;
    int64_t steps = 1 << 16;
    double secs = 0, flops = 0;
    const auto t0 = std::chrono::steady_clock::now();
    while (secs < seconds) {  // doubling batches until the thread has run `seconds`
      flops += HWY_DYNAMIC_DISPATCH(FmaCeilingT)(steps, &sink);
      secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      steps *= 2;
    }
    gflops[size_t(t)] = flops / secs / 1e9;
  });
  double total = 0;
  for (double g : gflops) total += g;
  return total;
}

void detail::matmulF16Gemm(float* out, const float* in, const uint16_t* w16, const float* bias,
                           int M, int K, int N) {
  HWY_DYNAMIC_DISPATCH(MatmulF16GemmT)(out, in, w16, bias, M, K, N);
}

}  // namespace ptllm::cpu
#endif  // HWY_ONCE
