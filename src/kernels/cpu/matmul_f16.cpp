// The f16-storage matmul path: w[K,N] packed once to IEEE binary16 (same row-major [K,N]
// layout, 2 bytes an element), products and sums in f32.
//   M <= 4 (decode GEMV, bandwidth-bound): stream the f16 rows once, four k rows at a time,
//   promote to f32 in registers (F16C / AVX-512), FMA into L1-resident output sub-blocks.
//   M > 4: the f32 GEMM of matmul.cpp, whose B packing promotes the f16 block to f32.
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

HWY_INLINE VF LoadF16(const uint16_t* p) {
  const DF d;
  const hn::Rebind<hwy::float16_t, DF> dh;
  return hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(p)));
}

// out[R,N] = in[R,K] @ f16(w)[K,N] + bias for R <= 4.
template <int R>
void GemvF16Rows(float* out, const float* in, const uint16_t* w, const float* bias, int K, int N) {
  const DF d;
  const int L = (int)hn::Lanes(d);
  constexpr int kCB = 4096;  // output sub-block: R x 16 KiB stays in L1 while w streams through
  const int64_t nBlocks = (N + 63) / 64;
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max(K, 1));
  pool().parallelFor(nBlocks, grain, [&](int64_t b0, int64_t b1) {
    const int nb = (int)(b0 * 64), ne = (int)std::min<int64_t>(b1 * 64, N);
    for (int s0 = nb; s0 < ne; s0 += kCB) {
      const int s1 = std::min(ne, s0 + kCB);
      const int vend = s0 + (s1 - s0) / L * L;
      for (int r = 0; r < R; ++r)
        for (int n = s0; n < s1; ++n) out[(int64_t)r * N + n] = bias ? bias[n] : 0.0f;
      int k = 0;
      for (; k + 4 <= K; k += 4) {
        const uint16_t* w0 = w + (int64_t)k * N;
        const uint16_t* w1 = w0 + N;
        const uint16_t* w2 = w1 + N;
        const uint16_t* w3 = w2 + N;
        VF x[R][4];
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < 4; ++j) x[r][j] = hn::Set(d, in[(int64_t)r * K + k + j]);
        for (int n = s0; n < vend; n += L) {
          const VF v0 = LoadF16(w0 + n), v1 = LoadF16(w1 + n);
          const VF v2 = LoadF16(w2 + n), v3 = LoadF16(w3 + n);
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
            out[(int64_t)r * N + n] += xr[0] * f16ToF32(w0[n]) + xr[1] * f16ToF32(w1[n]) +
                                       xr[2] * f16ToF32(w2[n]) + xr[3] * f16ToF32(w3[n]);
          }
      }
      for (; k < K; ++k) {
        const uint16_t* w0 = w + (int64_t)k * N;
        for (int r = 0; r < R; ++r) {
          const float xv = in[(int64_t)r * K + k];
          const VF x = hn::Set(d, xv);
          float* o = out + (int64_t)r * N;
          int n = s0;
          for (; n < vend; n += L)
            hn::StoreU(hn::MulAdd(x, LoadF16(w0 + n), hn::LoadU(d, o + n)), d, o + n);
          for (; n < s1; ++n) o[n] += xv * f16ToF32(w0[n]);
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

size_t f16PackedBytes(int K, int N) {
  return size_t(K) * size_t(N) * sizeof(uint16_t);
}

bool packF16(void* dst, const float* w, int K, int N) {
  auto* d = static_cast<uint16_t*>(dst);
  const int64_t n = int64_t(K) * N;
  std::atomic<bool> ok{true};
  pool().parallelFor(n, 1 << 16, [&](int64_t b, int64_t e) {
    bool good = true;
    for (int64_t i = b; i < e; ++i) {
      const uint16_t h = f32ToF16(w[i]);
      good &= (h & 0x7c00u) != 0x7c00u;  // NaN/Inf in, or overflow to inf
      d[i] = h;
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
