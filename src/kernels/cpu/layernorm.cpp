// LayerNorm (eps 1e-5, biased variance), forward and backward, f32 with Highway, rows split
// over the pool. Reference: kernels/ref/layernorm.cpp (double sums). The row sums here are f32
// vector sums (two chains of L lanes); the plain loops they replace were scalar dependency
// chains (the baseline build does not reorder float sums) and cost ~4% of a training step.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/thread_pool.h"
#include "kernels/cpu/cpu_kernels.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/layernorm.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace ptllm::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// out[M,C] = (in - mean) * rstd * w + b; mean[M], rstd[M] saved when not null.
void LayernormForwardT(float* out, float* mean, float* rstd, const float* in, const float* w,
                       const float* b, int M, int C) {
  pool().parallelFor(M, 16, [&](int64_t r0, int64_t r1) {
    const DF d;
    const int L = (int)hn::Lanes(d);
    for (int64_t m = r0; m < r1; ++m) {
      const float* x = in + m * C;
      VF s0 = hn::Zero(d), s1 = hn::Zero(d);
      int c = 0;
      for (; c + 2 * L <= C; c += 2 * L) {
        s0 = hn::Add(s0, hn::LoadU(d, x + c));
        s1 = hn::Add(s1, hn::LoadU(d, x + c + L));
      }
      for (; c + L <= C; c += L) s0 = hn::Add(s0, hn::LoadU(d, x + c));
      float s = hn::GetLane(hn::SumOfLanes(d, hn::Add(s0, s1)));
      for (; c < C; ++c) s += x[c];
      const float mu = s / C;
      const VF vmu = hn::Set(d, mu);
      VF q0 = hn::Zero(d), q1 = hn::Zero(d);
      c = 0;
      for (; c + 2 * L <= C; c += 2 * L) {
        const VF d0 = hn::Sub(hn::LoadU(d, x + c), vmu), d1 = hn::Sub(hn::LoadU(d, x + c + L), vmu);
        q0 = hn::MulAdd(d0, d0, q0);
        q1 = hn::MulAdd(d1, d1, q1);
      }
      for (; c + L <= C; c += L) {
        const VF d0 = hn::Sub(hn::LoadU(d, x + c), vmu);
        q0 = hn::MulAdd(d0, d0, q0);
      }
      float v = hn::GetLane(hn::SumOfLanes(d, hn::Add(q0, q1)));
      for (; c < C; ++c) v += (x[c] - mu) * (x[c] - mu);
      const float rs = 1.0f / std::sqrt(v / C + 1e-5f);
      const VF vrs = hn::Set(d, rs);
      float* y = out + m * C;
      c = 0;
      for (; c + L <= C; c += L) {
        const VF n = hn::Mul(hn::Sub(hn::LoadU(d, x + c), vmu), vrs);
        hn::StoreU(hn::MulAdd(n, hn::LoadU(d, w + c), hn::LoadU(d, b + c)), d, y + c);
      }
      for (; c < C; ++c) y[c] = (x[c] - mu) * rs * w[c] + b[c];
      if (mean) mean[m] = mu;
      if (rstd) rstd[m] = rs;
    }
  });
}

// din[M,C] (+=), dw[C] (+=), db[C] (+=). Rows split over the pool; dw/db summed per thread
// into partials, then added in thread order (the result does not depend on timing).
void LayernormBackwardT(float* din, float* dw, float* db, const float* dout, const float* in,
                        const float* w, const float* mean, const float* rstd, int M, int C) {
  const int threads = std::max(1, std::min(threadCount(), M));
  std::vector<float> part(size_t(threads) * 2 * C, 0.0f);
  pool().run(threads, [&](int t) {
    const DF d;
    const int L = (int)hn::Lanes(d);
    const int64_t r0 = int64_t(M) * t / threads, r1 = int64_t(M) * (t + 1) / threads;
    float* pdw = part.data() + size_t(t) * 2 * C;
    float* pdb = pdw + C;
    for (int64_t m = r0; m < r1; ++m) {
      const float* x = in + m * C;
      const float* dy = dout + m * C;
      const float mu = mean[m], rs = rstd[m];
      const VF vmu = hn::Set(d, mu), vrs = hn::Set(d, rs);
      VF a0 = hn::Zero(d), a1 = hn::Zero(d);  // sum of dn, sum of dn * norm
      int c = 0;
      for (; c + L <= C; c += L) {
        const VF norm = hn::Mul(hn::Sub(hn::LoadU(d, x + c), vmu), vrs);
        const VF dn = hn::Mul(hn::LoadU(d, w + c), hn::LoadU(d, dy + c));
        a0 = hn::Add(a0, dn);
        a1 = hn::MulAdd(dn, norm, a1);
      }
      float dnMean = hn::GetLane(hn::SumOfLanes(d, a0));
      float dnNormMean = hn::GetLane(hn::SumOfLanes(d, a1));
      for (; c < C; ++c) {
        const float norm = (x[c] - mu) * rs, dn = w[c] * dy[c];
        dnMean += dn;
        dnNormMean += dn * norm;
      }
      dnMean /= C;
      dnNormMean /= C;
      const VF vm = hn::Set(d, dnMean), vnm = hn::Set(d, dnNormMean);
      float* dx = din + m * C;
      c = 0;
      for (; c + L <= C; c += L) {
        const VF norm = hn::Mul(hn::Sub(hn::LoadU(d, x + c), vmu), vrs);
        const VF dyv = hn::LoadU(d, dy + c);
        const VF dn = hn::Mul(hn::LoadU(d, w + c), dyv);
        hn::StoreU(hn::Add(hn::LoadU(d, pdb + c), dyv), d, pdb + c);
        hn::StoreU(hn::MulAdd(norm, dyv, hn::LoadU(d, pdw + c)), d, pdw + c);
        const VF g = hn::Mul(hn::NegMulAdd(norm, vnm, hn::Sub(dn, vm)), vrs);
        hn::StoreU(hn::Add(hn::LoadU(d, dx + c), g), d, dx + c);
      }
      for (; c < C; ++c) {
        const float norm = (x[c] - mu) * rs, dn = w[c] * dy[c];
        pdb[c] += dy[c];
        pdw[c] += norm * dy[c];
        dx[c] += (dn - dnMean - norm * dnNormMean) * rs;
      }
    }
  });
  for (int t = 0; t < threads; ++t)
    for (int c = 0; c < C; ++c) {
      dw[c] += part[size_t(t) * 2 * C + c];
      db[c] += part[size_t(t) * 2 * C + C + c];
    }
}

}  // namespace ptllm::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ptllm::cpu {

HWY_EXPORT(LayernormForwardT);
HWY_EXPORT(LayernormBackwardT);

void layernormForward(float* out, float* mean, float* rstd, const float* in, const float* w,
                      const float* b, int M, int C) {
  if (M <= 0 || C <= 0) return;
  HWY_DYNAMIC_DISPATCH(LayernormForwardT)(out, mean, rstd, in, w, b, M, C);
}

void layernormBackward(float* din, float* dw, float* db, const float* dout, const float* in,
                       const float* w, const float* mean, const float* rstd, int M, int C) {
  if (M <= 0 || C <= 0) return;
  HWY_DYNAMIC_DISPATCH(LayernormBackwardT)(din, dw, db, dout, in, w, mean, rstd, M, C);
}

}  // namespace ptllm::cpu
#endif  // HWY_ONCE
