// The f16-storage matmul path: w[K,N] packed once to IEEE binary16 (2 bytes an element),
// products and sums in f32.
// Packed layout (private to this file, f16PackedAt and matmul.cpp's PackB<BSrc::kF16>):
// panel-major [ceil(N/NB)][K][NB], NB = detail::kF16PanelCols columns a panel, the tail
// panel zero padded past N. Panel p holds columns [p*NB, p*NB+NB) for every k, so element
// (k, n) sits at (n/NB)*K*NB + k*NB + n%NB and consecutive panels are contiguous.
//   M <= 4 (decode GEMV, bandwidth-bound): each thread streams its run of whole panels (one
//   contiguous region) once, keeping the R x NB accumulators in registers over the whole K
//   loop (k-blocked column chunks on targets with too few registers), promoting f16 -> f32 in
//   registers (F16C / AVX-512) with software prefetch a few KiB ahead.
//   M > 4: the f32 GEMM of matmul.cpp, whose B packing promotes the f16 panels to f32.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/half.h"
#include "core/thread_pool.h"
#include "kernels/cpu/cpu_kernels.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/matmul_f16.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/targets.h>

HWY_BEFORE_NAMESPACE();
namespace ptllm::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

constexpr int kNB = detail::kF16PanelCols;
constexpr int kL = int(HWY_LANES(float));
static_assert(kNB % kL == 0, "panel width must be a multiple of the vector length");
constexpr int kPV = kNB / kL;  // vectors across a panel
#if HWY_TARGET <= HWY_AVX3
constexpr int kAccBudget = 16;  // accumulators of 32 zmm registers
#else
constexpr int kAccBudget = 8;  // of 16 ymm/xmm registers
#endif
// Vectors per column chunk for R rows: the largest divisor of kPV with R * CV <= budget.
constexpr int ChunkVecs(int R) {
  int cv = kPV;
  while (cv > 1 && (R * cv > kAccBudget || kPV % cv != 0)) --cv;
  return cv;
}
constexpr int kPrefetchK = 64;  // software prefetch distance in k steps (x NB*2 bytes = 8 KiB)

HWY_INLINE VF LoadF16(const uint16_t* p) {
  const DF d;
  const hn::Rebind<hwy::float16_t, DF> dh;
  return hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(p)));
}

// acc[R][CV] += in[R, k0:k1] @ chunk[k0:k1][CV*L], chunk = panel + column offset (row stride NB).
template <int R, int CV>
HWY_INLINE void ChunkDot(VF (&acc)[R][CV], const float* HWY_RESTRICT in, int K,
                         const uint16_t* HWY_RESTRICT chunk, int k0, int k1) {
  const DF d;
  for (int k = k0; k < k1; ++k) {
    const uint16_t* p = chunk + (int64_t)k * kNB;
    if constexpr (CV == kPV) {  // whole panel row: 2 cache lines at NB = 64
      __builtin_prefetch(p + kPrefetchK * kNB, 0, 0);
      if constexpr (kNB * 2 > 64) __builtin_prefetch(p + kPrefetchK * kNB + 32, 0, 0);
    }
    VF w[CV];
#pragma GCC unroll 16
    for (int v = 0; v < CV; ++v) w[v] = LoadF16(p + v * kL);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const VF x = hn::Set(d, in[(int64_t)r * K + k]);
#pragma GCC unroll 16
      for (int v = 0; v < CV; ++v) acc[r][v] = hn::MulAdd(x, w[v], acc[r][v]);
    }
  }
}

// out[r, n0 + c] (= bias + | +=) acc for the valid columns c < cols of a CV*L-wide chunk.
template <int R, int CV>
HWY_INLINE void ChunkStore(const VF (&acc)[R][CV], float* out, const float* bias, int N, int n0,
                           int cols, bool add) {
  const DF d;
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    float* o = out + (int64_t)r * N + n0;
#pragma GCC unroll 16
    for (int v = 0; v < CV; ++v) {
      const int c = v * kL;
      if (c + kL <= cols) {
        const VF base = add    ? hn::LoadU(d, o + c)
                        : bias ? hn::LoadU(d, bias + n0 + c)
                               : hn::Zero(d);
        hn::StoreU(hn::Add(base, acc[r][v]), d, o + c);
      } else if (c < cols) {
        HWY_ALIGN float tmp[kL];
        hn::Store(acc[r][v], d, tmp);
        for (int j = 0; j < cols - c; ++j)
          o[c + j] = (add ? o[c + j] : bias ? bias[n0 + c + j] : 0.0f) + tmp[j];
      }
    }
  }
}

// out[R,N] = in[R,K] @ f16(w)[K,N] + bias for R <= 4, w panel-major packed.
template <int R>
void GemvF16Rows(float* out, const float* in, const uint16_t* w, const float* bias, int K, int N) {
  const DF d;
  HWY_DASSERT((int)hn::Lanes(d) == kL);
  constexpr int CV = ChunkVecs(R);
  constexpr int kChunks = kPV / CV;
  constexpr int kKB = 128;  // k block when a panel is split into chunks: 16 KiB of f16 in L1
  const int64_t nPanels = (N + kNB - 1) / kNB;
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max(K, 1));  // >= ~256K MACs a task
  pool().parallelFor(nPanels, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const uint16_t* panel = w + p * (int64_t)K * kNB;
      const int n0 = (int)p * kNB;
      const int cols = std::min(kNB, N - n0);
      if constexpr (kChunks == 1) {
        VF acc[R][CV];
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < CV; ++v) acc[r][v] = hn::Zero(d);
        ChunkDot<R, CV>(acc, in, K, panel, 0, K);
        ChunkStore<R, CV>(acc, out, bias, N, n0, cols, false);
      } else {
        if (K == 0) {
          VF acc[R][CV];
          for (int r = 0; r < R; ++r)
            for (int v = 0; v < CV; ++v) acc[r][v] = hn::Zero(d);
          for (int c = 0; c < kChunks; ++c)
            ChunkStore<R, CV>(acc, out, bias, N, n0 + c * CV * kL, cols - c * CV * kL, false);
        }
        for (int k0 = 0; k0 < K; k0 += kKB) {
          const int k1 = std::min(K, k0 + kKB);
          for (int64_t e = (int64_t)k0 * kNB; e < (int64_t)k1 * kNB; e += 32)  // next block
            __builtin_prefetch(panel + (int64_t)kKB * kNB + e, 0, 0);
          for (int c = 0; c < kChunks; ++c) {
            VF acc[R][CV];
            for (int r = 0; r < R; ++r)
              for (int v = 0; v < CV; ++v) acc[r][v] = hn::Zero(d);
            ChunkDot<R, CV>(acc, in, K, panel + c * CV * kL, k0, k1);
            ChunkStore<R, CV>(acc, out, bias, N, n0 + c * CV * kL, cols - c * CV * kL, k0 > 0);
          }
        }
      }
    }
  });
}

void MatmulF16T(float* out, const float* in, const uint16_t* w, const float* bias, int M, int K,
                int N) {
  switch (M) {
    case 1:
      return GemvF16Rows<1>(out, in, w, bias, K, N);
    case 2:
      return GemvF16Rows<2>(out, in, w, bias, K, N);
    case 3:
      return GemvF16Rows<3>(out, in, w, bias, K, N);
    case 4:
      return GemvF16Rows<4>(out, in, w, bias, K, N);
    default:
      return detail::matmulF16Gemm(out, in, w, bias, M, K, N);
  }
}

const char* TargetNameT() {
  return hwy::TargetName(HWY_TARGET);
}

}  // namespace ptllm::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ptllm::cpu {

HWY_EXPORT(MatmulF16T);
HWY_EXPORT(TargetNameT);

namespace {
constexpr int kNB = detail::kF16PanelCols;
int64_t panelsOf(int N) {
  return (int64_t(N) + kNB - 1) / kNB;
}
}  // namespace

size_t f16PackedBytes(int K, int N) {
  if (K <= 0 || N <= 0) return 0;
  return size_t(panelsOf(N)) * kNB * size_t(K) * sizeof(uint16_t);
}

float f16PackedAt(const void* packed, int K, int N, int k, int n) {
  (void)N;
  const auto* p = static_cast<const uint16_t*>(packed);
  return f16ToF32(p[int64_t(n / kNB) * K * kNB + int64_t(k) * kNB + n % kNB]);
}

bool packF16(void* dst, const float* w, int K, int N) {
  if (K <= 0 || N <= 0) return true;
  auto* d = static_cast<uint16_t*>(dst);
  const int64_t nPanels = panelsOf(N);
  std::atomic<bool> ok{true};
  const int64_t grain = std::max<int64_t>(1, 8192 / K);  // >= ~512K elements a task
  pool().parallelFor(nPanels, grain, [&](int64_t p0, int64_t p1) {
    bool good = true;
    for (int64_t p = p0; p < p1; ++p) {
      const int n0 = int(p * kNB), cols = std::min(kNB, N - n0);
      uint16_t* panel = d + p * int64_t(K) * kNB;
      for (int k = 0; k < K; ++k) {
        const float* src = w + int64_t(k) * N + n0;
        uint16_t* row = panel + int64_t(k) * kNB;
        for (int j = 0; j < cols; ++j) {
          const uint16_t h = f32ToF16(src[j]);
          good &= (h & 0x7c00u) != 0x7c00u;  // NaN/Inf in, or overflow to inf
          row[j] = h;
        }
        for (int j = cols; j < kNB; ++j) row[j] = 0;  // +0.0: padding adds nothing
      }
    }
    if (!good) ok.store(false, std::memory_order_relaxed);
  });
  return ok.load();
}

void matmulF16(float* out, const float* in, const void* w16, const float* bias, int M, int K,
               int N) {
  if (M <= 0 || N <= 0) return;
  HWY_DYNAMIC_DISPATCH(MatmulF16T)(out, in, static_cast<const uint16_t*>(w16), bias, M, K, N);
}

const char* simdTargetName() {
  return HWY_DYNAMIC_DISPATCH(TargetNameT)();
}

}  // namespace ptllm::cpu
#endif  // HWY_ONCE
