// AdamW (bias-corrected, decoupled weight decay), vectorised with Highway and threaded.
// Reference: kernels/ref/adamw.cpp. The update is elementwise and memory-bound (4 streams in,
// 3 out); the baseline build's scalar-or-SSE2 loop left AVX-512 unused.
#include <cmath>
#include <cstdint>

#include "core/thread_pool.h"
#include "kernels/cpu/cpu_kernels.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/adamw.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace ptllm::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

void AdamwT(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1,
            float beta2, float eps, float wd, float c1, float c2) {
  pool().parallelFor(n, 1 << 14, [&](int64_t b, int64_t e) {
    const hn::ScalableTag<float> d;
    const int64_t L = int64_t(hn::Lanes(d));
    const auto vb1 = hn::Set(d, beta1), vb2 = hn::Set(d, beta2), va1 = hn::Set(d, 1.0f - beta1),
               va2 = hn::Set(d, 1.0f - beta2), vic1 = hn::Set(d, 1.0f / c1),
               vic2 = hn::Set(d, 1.0f / c2), veps = hn::Set(d, eps), vlr = hn::Set(d, lr),
               vwd = hn::Set(d, wd);
    int64_t i = b;
    for (; i + L <= e; i += L) {
      const auto gi = hn::LoadU(d, g + i);
      const auto mi = hn::MulAdd(vb1, hn::LoadU(d, m + i), hn::Mul(va1, gi));
      const auto vi = hn::MulAdd(vb2, hn::LoadU(d, v + i), hn::Mul(va2, hn::Mul(gi, gi)));
      hn::StoreU(mi, d, m + i);
      hn::StoreU(vi, d, v + i);
      const auto pi = hn::LoadU(d, p + i);
      const auto step = hn::MulAdd(
          vwd, pi, hn::Div(hn::Mul(mi, vic1), hn::Add(hn::Sqrt(hn::Mul(vi, vic2)), veps)));
      hn::StoreU(hn::NegMulAdd(vlr, step, pi), d, p + i);
    }
    for (; i < e; ++i) {
      m[i] = beta1 * m[i] + (1.0f - beta1) * g[i];
      v[i] = beta2 * v[i] + (1.0f - beta2) * g[i] * g[i];
      p[i] -= lr * ((m[i] / c1) / (std::sqrt(v[i] / c2) + eps) + wd * p[i]);
    }
  });
}

}  // namespace ptllm::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ptllm::cpu {
HWY_EXPORT(AdamwT);

void adamw(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1,
           float beta2, float eps, float wd, int t) {
  const float c1 = float(1.0 - std::pow(double(beta1), t));
  const float c2 = float(1.0 - std::pow(double(beta2), t));
  HWY_DYNAMIC_DISPATCH(AdamwT)(p, g, m, v, n, lr, beta1, beta2, eps, wd, c1, c2);
}
}  // namespace ptllm::cpu
#endif
