// GELU (tanh approximation), forward and backward, vectorised with Highway and threaded.
// Reference: kernels/ref/gelu.cpp. Scalar std::tanh here cost ~45% of a small model's training
// step; tanh is written through the logistic function (see GeluRange), a few ulp from it.
#include <algorithm>
#include <cstdint>

#include "core/thread_pool.h"
#include "kernels/cpu/cpu_kernels.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/gelu.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// (separate blocks: the order matters to Highway's per-target re-inclusion)
#include <hwy/highway.h>
// after highway.h
#include <hwy/contrib/math/math-inl.h>

HWY_BEFORE_NAMESPACE();
namespace ptllm::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// u = sqrt(2/pi) * (x + 0.044715 x^3); gelu = 0.5 x (1 + tanh u) = x * s, s = sigmoid(2u) =
// 1 / (1 + exp(-2u)) (one Exp and one division: about half the cost of the vector Tanh).
// gelu' = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
//       = s * (1 + 2 x (1 - s) sqrt(2/pi) (1 + 3 * 0.044715 x^2))     (1 - tanh^2 u = 4 s (1 - s))
// -2u is clamped to [-88, 88], inside Exp's range: exp(88) ~ 1.7e38 leaves gelu(x) ~ x * 6e-39
// where the exact value underflows anyway (x < -7), exp(-88) leaves s = 1 to f32 rounding.
template <bool kBackward>
void GeluRange(float* out, const float* in, const float* dout, int64_t b, int64_t e) {
  const hn::ScalableTag<float> d;
  const int64_t L = int64_t(hn::Lanes(d));
  const auto k0 = hn::Set(d, 0.7978845608f), k1 = hn::Set(d, 0.044715f), k3 = hn::Set(d, 0.134145f),
             m2k0 = hn::Set(d, -2.0f * 0.7978845608f), two = hn::Set(d, 2.0f),
             one = hn::Set(d, 1.0f), lo = hn::Set(d, -88.0f), hi = hn::Set(d, 88.0f);
  auto body = [&](auto x, auto dy) {
    const auto x2 = hn::Mul(x, x);
    const auto m2u = hn::Mul(m2k0, hn::MulAdd(hn::Mul(k1, x2), x, x));  // -2u
    const auto ex = hn::Exp(d, hn::Min(hn::Max(m2u, lo), hi));
    if constexpr (!kBackward) {
      return hn::Div(x, hn::Add(one, ex));
    } else {
      const auto s = hn::Div(one, hn::Add(one, ex));
      const auto inner = hn::Mul(hn::Mul(k0, hn::MulAdd(k3, x2, one)), hn::Mul(two, x));
      const auto g = hn::Mul(s, hn::MulAdd(inner, hn::Sub(one, s), one));
      return hn::Mul(g, dy);
    }
  };
  int64_t i = b;
  for (; i + L <= e; i += L) {
    const auto x = hn::LoadU(d, in + i);
    const auto dy = kBackward ? hn::LoadU(d, dout + i) : hn::Zero(d);
    hn::StoreU(body(x, dy), d, out + i);
  }
  if (i < e) {  // tail through a padded buffer: never touches memory past e
    HWY_ALIGN float xb[hn::MaxLanes(d)] = {}, db[hn::MaxLanes(d)] = {}, ob[hn::MaxLanes(d)];
    const int64_t n = e - i;
    std::copy(in + i, in + e, xb);
    if (kBackward) std::copy(dout + i, dout + e, db);
    hn::Store(body(hn::Load(d, xb), hn::Load(d, db)), d, ob);
    std::copy(ob, ob + n, out + i);
  }
}

void GeluForwardT(float* out, const float* in, int64_t n) {
  pool().parallelFor(n, 1 << 13,
                     [&](int64_t b, int64_t e) { GeluRange<false>(out, in, nullptr, b, e); });
}
void GeluBackwardT(float* din, const float* in, const float* dout, int64_t n) {
  pool().parallelFor(n, 1 << 13,
                     [&](int64_t b, int64_t e) { GeluRange<true>(din, in, dout, b, e); });
}

}  // namespace ptllm::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ptllm::cpu {
HWY_EXPORT(GeluForwardT);
HWY_EXPORT(GeluBackwardT);

void geluForward(float* out, const float* in, int64_t n) {
  HWY_DYNAMIC_DISPATCH(GeluForwardT)(out, in, n);
}
void geluBackward(float* din, const float* in, const float* dout, int64_t n) {
  HWY_DYNAMIC_DISPATCH(GeluBackwardT)(din, in, dout, n);
}
}  // namespace ptllm::cpu
#endif
