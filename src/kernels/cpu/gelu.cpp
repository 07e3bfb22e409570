// GELU (tanh approximation), forward and backward, vectorised with Highway's Tanh and threaded.
// Reference: kernels/ref/gelu.cpp. Scalar std::tanh here cost ~45% of a small model's training
// step; the vector Tanh is within a few ulp of it.
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

// u = sqrt(2/pi) * (x + 0.044715 x^3); gelu = 0.5 x (1 + tanh u)
// gelu' = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
template <bool kBackward>
void GeluRange(float* out, const float* in, const float* dout, int64_t b, int64_t e) {
  const hn::ScalableTag<float> d;
  const int64_t L = int64_t(hn::Lanes(d));
  const auto k0 = hn::Set(d, 0.7978845608f), k1 = hn::Set(d, 0.044715f), k3 = hn::Set(d, 0.134145f),
             half = hn::Set(d, 0.5f), one = hn::Set(d, 1.0f);
  auto body = [&](auto x, auto dy) {
    const auto x2 = hn::Mul(x, x);
    const auto u = hn::Mul(k0, hn::MulAdd(hn::Mul(k1, x2), x, x));
    const auto th = hn::Tanh(d, u);
    if constexpr (!kBackward) {
      return hn::Mul(hn::Mul(half, x), hn::Add(one, th));
    } else {
      const auto sech2 = hn::NegMulAdd(th, th, one);
      const auto inner = hn::Mul(hn::Mul(k0, hn::MulAdd(k3, x2, one)), sech2);
      const auto g = hn::Mul(half, hn::MulAdd(x, inner, hn::Add(one, th)));
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
