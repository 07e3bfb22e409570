// Fast causal multi-head attention (same math as kernels/ref/attention.cpp), f32 with Highway.
// qkv[B,Tk,3C] fused; head h uses channels [h*hs, (h+1)*hs), hs = C/NH; scale 1/sqrt(hs).
//
// Each task owns one (b, h) pair (and, when B*NH is small, a range of query rows) and copies
// what it reads into per-thread scratch: K^T / V^T as [hs][Tp] (Tp: positions rounded up to
// 4 vectors, zero padded) so that a row of scores is a run of vector FMAs over key positions,
// and q / k / v / dout rows as [T][hsp] (hsp: hs rounded up to a vector, zero padded) for the
// weighted sums over positions. Tasks write disjoint slices of out/att/dqkv.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/thread_pool.h"
#include "kernels/cpu/cpu_kernels.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/attention.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// (separate blocks: the order matters to Highway's per-target re-inclusion)
#include <hwy/highway.h>
// after highway.h
#include <hwy/contrib/math/math-inl.h>

#ifndef PTLLM_KERNELS_CPU_ATTENTION_ONCE
#define PTLLM_KERNELS_CPU_ATTENTION_ONCE
#include "kernels/cpu/scratch.h"
namespace ptllm::cpu::detail {
inline thread_local Scratch tlsAtt;
}  // namespace ptllm::cpu::detail
#endif

HWY_BEFORE_NAMESPACE();
namespace ptllm::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// s[0, nb*4L) = sum_d x[d] * xt[d*ld + j]: four independent vector chains per block of 4L.
HWY_INLINE void RowTimesT(const float* HWY_RESTRICT x, const float* HWY_RESTRICT xt, int64_t ld,
                          int hs, int nb, float* HWY_RESTRICT s) {
  const DF d;
  const int L = (int)hn::Lanes(d);
  for (int blk = 0; blk < nb; ++blk) {
    const float* base = xt + (int64_t)blk * 4 * L;
    VF a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
    for (int c = 0; c < hs; ++c) {
      const VF xv = hn::Set(d, x[c]);
      const float* r = base + c * ld;
      a0 = hn::MulAdd(xv, hn::Load(d, r), a0);
      a1 = hn::MulAdd(xv, hn::Load(d, r + L), a1);
      a2 = hn::MulAdd(xv, hn::Load(d, r + 2 * L), a2);
      a3 = hn::MulAdd(xv, hn::Load(d, r + 3 * L), a3);
    }
    float* o = s + (int64_t)blk * 4 * L;
    hn::Store(a0, d, o);
    hn::Store(a1, d, o + L);
    hn::Store(a2, d, o + 2 * L);
    hn::Store(a3, d, o + 3 * L);
  }
}

// acc[hsp] = sum_{j<n} w[j] * rows[j*hsp + :]  (two interleaved chains over j)
HWY_INLINE void WeightedRowSum(const float* HWY_RESTRICT w, const float* HWY_RESTRICT rows, int hsp,
                               int n, float* HWY_RESTRICT acc) {
  const DF d;
  const int L = (int)hn::Lanes(d);
  for (int c = 0; c < hsp; c += 4 * L) {
    const int nv = std::min(4, (hsp - c) / L);
    VF e[4], o[4];
    for (int v = 0; v < 4; ++v) e[v] = o[v] = hn::Zero(d);
    int j = 0;
    for (; j + 2 <= n; j += 2) {
      const VF w0 = hn::Set(d, w[j]), w1 = hn::Set(d, w[j + 1]);
      const float* r0 = rows + (int64_t)j * hsp + c;
      const float* r1 = r0 + hsp;
      for (int v = 0; v < nv; ++v) {
        e[v] = hn::MulAdd(w0, hn::Load(d, r0 + v * L), e[v]);
        o[v] = hn::MulAdd(w1, hn::Load(d, r1 + v * L), o[v]);
      }
    }
    if (j < n) {
      const VF w0 = hn::Set(d, w[j]);
      const float* r0 = rows + (int64_t)j * hsp + c;
      for (int v = 0; v < nv; ++v) e[v] = hn::MulAdd(w0, hn::Load(d, r0 + v * L), e[v]);
    }
    for (int v = 0; v < nv; ++v) hn::Store(hn::Add(e[v], o[v]), d, acc + c + v * L);
  }
}

// Row i of the forward for one (b, h): scores over keys [0, pos], softmax, weighted V.
void ForwardTask(float* out, float* att, const float* qkv, int b, int h, int i0, int i1, int Tq,
                 int Tk, int C, int NH) {
  const DF d;
  const int L = (int)hn::Lanes(d);
  const int hs = C / NH, hsp = (hs + L - 1) / L * L;
  const int q0 = Tk - Tq;
  const int jmax = q0 + i1;  // keys the task needs: [0, jmax)
  const int Tp = (jmax + 4 * L - 1) / (4 * L) * (4 * L);
  const float scale = 1.0f / std::sqrt((float)hs);
  float* kt = detail::tlsAtt.get((size_t)hs * Tp + (size_t)jmax * hsp + Tp + hsp);
  float* vr = kt + (size_t)hs * Tp;  // [jmax][hsp]
  float* s = vr + (size_t)jmax * hsp;
  float* o = s + Tp;
  const int64_t ld = 3 * (int64_t)C;
  const float* base = qkv + (int64_t)b * Tk * ld + h * hs;
  for (int j = 0; j < jmax; ++j) {
    const float* k = base + j * ld + C;
    const float* v = base + j * ld + 2 * C;
    for (int c = 0; c < hs; ++c) kt[(int64_t)c * Tp + j] = k[c];
    std::memcpy(vr + (int64_t)j * hsp, v, sizeof(float) * hs);
    for (int c = hs; c < hsp; ++c) vr[(int64_t)j * hsp + c] = 0.0f;
  }
  for (int c = 0; c < hs; ++c)
    for (int j = jmax; j < Tp; ++j) kt[(int64_t)c * Tp + j] = 0.0f;

  for (int i = i0; i < i1; ++i) {
    const int pos = q0 + i, n = pos + 1;
    const int nb = (n + 4 * L - 1) / (4 * L);
    RowTimesT(base + (int64_t)pos * ld, kt, Tp, hs, nb, s);
    const int nvec = (n + L - 1) / L;
    // max over valid scores (lanes past n are excluded)
    VF mx = hn::Set(d, -INFINITY);
    for (int v = 0; v < nvec; ++v) {
      const auto m = hn::FirstN(d, n - v * L);
      mx = hn::Max(mx, hn::IfThenElse(m, hn::Load(d, s + v * L), hn::Set(d, -INFINITY)));
    }
    const VF mxs = hn::Mul(hn::MaxOfLanes(d, mx), hn::Set(d, scale));
    const VF vs = hn::Set(d, scale);
    VF sum = hn::Zero(d);
    for (int v = 0; v < nvec; ++v) {
      const auto m = hn::FirstN(d, n - v * L);
      const VF e = hn::Exp(d, hn::MulSub(hn::Load(d, s + v * L), vs, mxs));
      const VF p = hn::IfThenElseZero(m, e);
      hn::Store(p, d, s + v * L);
      sum = hn::Add(sum, p);
    }
    const float inv = 1.0f / hn::GetLane(hn::SumOfLanes(d, sum));
    const VF vinv = hn::Set(d, inv);
    for (int v = 0; v < nvec; ++v) hn::Store(hn::Mul(hn::Load(d, s + v * L), vinv), d, s + v * L);
    float* a = att + (((int64_t)b * NH + h) * Tq + i) * Tk;
    std::memcpy(a, s, sizeof(float) * n);
    std::fill(a + n, a + Tk, 0.0f);
    WeightedRowSum(s, vr, hsp, n, o);
    std::memcpy(out + ((int64_t)b * Tq + i) * C + h * hs, o, sizeof(float) * hs);
  }
}

void AttentionForwardT(float* out, float* att, const float* qkv, int B, int Tq, int Tk, int C,
                       int NH) {
  const int pairs = B * NH;
  const int threads = threadCount();
  // Split query rows when there are few (b, h) pairs; chunk boundaries balance causal work.
  int chunks = 1;
  if (pairs < 4 * threads && Tq >= 32)
    chunks = std::min(Tq / 16, (4 * threads + pairs - 1) / pairs);
  std::vector<int> bounds(chunks + 1, Tq);
  bounds[0] = 0;
  if (chunks > 1) {
    const int q0 = Tk - Tq;
    const double total = double(Tq) * (q0 + 1) + double(Tq) * (Tq - 1) / 2;
    double acc = 0;
    int c = 1;
    for (int i = 0; i < Tq && c < chunks; ++i) {
      acc += q0 + i + 1;
      if (acc >= total * c / chunks) bounds[c++] = i + 1;
    }
  }
  const int64_t tasks = (int64_t)pairs * chunks;
  const int64_t grain = (double)Tq * Tk * C < 2e5 ? tasks : 1;
  pool().parallelFor(tasks, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int pr = (int)(t / chunks), ch = (int)(t % chunks);
      if (bounds[ch] < bounds[ch + 1])
        ForwardTask(out, att, qkv, pr / NH, pr % NH, bounds[ch], bounds[ch + 1], Tq, Tk, C, NH);
    }
  });
}

void BackwardTask(float* dqkv, const float* dout, const float* qkv, const float* att, int b, int h,
                  int T, int C, int NH) {
  const DF d;
  const int L = (int)hn::Lanes(d);
  const int hs = C / NH, hsp = (hs + L - 1) / L * L;
  const int Tp = (T + 4 * L - 1) / (4 * L) * (4 * L);
  const float scale = 1.0f / std::sqrt((float)hs);
  const size_t rowsz = (size_t)T * hsp;
  float* vt = detail::tlsAtt.get((size_t)hs * Tp + 4 * rowsz + (size_t)T * Tp + 2 * hsp + Tp + T);
  float* q = vt + (size_t)hs * Tp;  // [T][hsp] each
  float* k = q + rowsz;
  float* dy = k + rowsz;
  float* dpT = dy + rowsz;  // [T][Tp]: dpT[j][i] = scale * dpre_ij for i >= j
  float* tmp = dpT + (size_t)T * Tp;
  float* tmp2 = tmp + hsp;
  float* da = tmp2 + hsp;  // [Tp] one row of datt / dpre
  float* acol = da + Tp;   // [T] one column of att
  const int64_t ld = 3 * (int64_t)C;
  const float* base = qkv + (int64_t)b * T * ld + h * hs;
  const float* a0 = att + ((int64_t)b * NH + h) * T * T;
  for (int j = 0; j < T; ++j) {
    const float* rq = base + j * ld;
    const float* rv = rq + 2 * C;
    const float* rdy = dout + ((int64_t)b * T + j) * C + h * hs;
    for (int c = 0; c < hs; ++c) vt[(int64_t)c * Tp + j] = rv[c];
    for (int c = 0; c < hsp; ++c) {
      q[(int64_t)j * hsp + c] = c < hs ? rq[c] : 0.0f;
      k[(int64_t)j * hsp + c] = c < hs ? rq[C + c] : 0.0f;
      dy[(int64_t)j * hsp + c] = c < hs ? rdy[c] : 0.0f;
    }
  }
  for (int c = 0; c < hs; ++c)
    for (int j = T; j < Tp; ++j) vt[(int64_t)c * Tp + j] = 0.0f;

  for (int i = 0; i < T; ++i) {
    const int n = i + 1;
    const float* a = a0 + (int64_t)i * T;
    RowTimesT(dy + (int64_t)i * hsp, vt, Tp, hs, (n + 4 * L - 1) / (4 * L), da);  // dy_i . v_j
    double dot = 0;
    for (int j = 0; j < n; ++j) dot += double(a[j]) * da[j];
    const float fdot = (float)dot;
    for (int j = 0; j < n; ++j) {
      da[j] = a[j] * (da[j] - fdot) * scale;  // dpre_ij * scale
      dpT[(int64_t)j * Tp + i] = da[j];
    }
    WeightedRowSum(da, k, hsp, n, tmp);  // dq_i = sum_j dpre_ij k_j
    std::memcpy(dqkv + ((int64_t)b * T + i) * ld + h * hs, tmp, sizeof(float) * hs);
  }
  // dk_j = sum_{i>=j} dpre_ij q_i ; dv_j = sum_{i>=j} a_ij dy_i
  for (int j = 0; j < T; ++j) {
    const int n = T - j;
    for (int i = j; i < T; ++i) acol[i - j] = a0[(int64_t)i * T + j];
    WeightedRowSum(dpT + (int64_t)j * Tp + j, q + (int64_t)j * hsp, hsp, n, tmp);
    WeightedRowSum(acol, dy + (int64_t)j * hsp, hsp, n, tmp2);
    float* dst = dqkv + ((int64_t)b * T + j) * ld + h * hs;
    std::memcpy(dst + C, tmp, sizeof(float) * hs);
    std::memcpy(dst + 2 * C, tmp2, sizeof(float) * hs);
  }
}

void AttentionBackwardT(float* dqkv, const float* dout, const float* qkv, const float* att, int B,
                        int T, int C, int NH) {
  const int hs = C / NH;
  if (hs * NH != C) std::fill(dqkv, dqkv + (int64_t)B * T * 3 * C, 0.0f);  // unused channels
  const int64_t tasks = (int64_t)B * NH;
  pool().parallelFor(tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      BackwardTask(dqkv, dout, qkv, att, (int)(t / NH), (int)(t % NH), T, C, NH);
  });
}

}  // namespace ptllm::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ptllm::cpu {

HWY_EXPORT(AttentionForwardT);
HWY_EXPORT(AttentionBackwardT);

void attentionForward(float* out, float* att, const float* qkv, int B, int Tq, int Tk, int C,
                      int NH) {
  if (B <= 0 || Tq <= 0 || Tk <= 0 || C <= 0 || NH <= 0) return;
  HWY_DYNAMIC_DISPATCH(AttentionForwardT)(out, att, qkv, B, Tq, Tk, C, NH);
}

void attentionBackward(float* dqkv, const float* dout, const float* qkv, const float* att, int B,
                       int T, int C, int NH) {
  if (B <= 0 || T <= 0 || C <= 0 || NH <= 0) return;
  HWY_DYNAMIC_DISPATCH(AttentionBackwardT)(dqkv, dout, qkv, att, B, T, C, NH);
}

}  // namespace ptllm::cpu
#endif  // HWY_ONCE
