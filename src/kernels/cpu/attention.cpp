// Fast causal multi-head attention (same math as kernels/ref/attention.cpp), f32 with Highway.
// qkv[B,Tk,3C] fused; head h uses channels [h*hs, (h+1)*hs), hs = C/NH; scale 1/sqrt(hs).
//
// Each task owns one (b, h) pair (and, when B*NH is small, a range of query rows). All six
// products (scores, probs @ V; dY @ V^T, dS @ K, dS^T @ Q, P^T @ dY) run through one register
// tile, Tile<R>: R rows of A (scalars broadcast from any two strides) times a row-major B
// panel of NR = kNV vectors, so every B load serves R rows (the old row-at-a-time kernels
// reused nothing and ran at ~30 GFLOP/s a core). Operands live in per-thread scratch:
// K^T / V^T as [hs][Tp] and q / k / v / dout rows as [T][hsp] (Tp, hsp: positions and head
// channels rounded up to NR, zero padded), probabilities and dS as [T][Tp] with zeros past
// the causal edge, so tiles may run over whole vectors and the zero tails add nothing.
// Tasks write disjoint slices of out/att/dqkv.
#include <hwy/cache_control.h>

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

#if HWY_TARGET <= HWY_AVX3
constexpr int kR = 8, kNV = 2;  // 16 accumulators of 32 zmm registers
#else
constexpr int kR = 6, kNV = 2;  // 12 accumulators of 16 ymm/xmm registers
#endif

inline int RoundUp(int x, int m) {
  return (x + m - 1) / m * m;
}

// Row stride of the [.][Tp] operands walked down a column (K^T / V^T written by a transpose,
// P / dS read by columns for dK / dV): one vector more than Tp. At Tp = 256 their rows were
// 1 KiB apart, so a column fell into 4 of the 64 L1 sets and its lines evicted each other (the
// transposes were ~70% of ForwardTask's own time); 17 lines apart they do not.
inline int PaddedLd(int Tp, int L) {
  return Tp + L;
}

// The copies into scratch are the first touch of a head's q/k/v (and dy) rows, 3C floats apart:
// fetched one row at a time they waited on memory. Prefetch the row kAhead positions on: the
// head's slices [0, hs) of `parts` consecutive C-wide parts from row.
constexpr int kAhead = 8;
inline void PrefetchHead(const float* row, int C, int hs, int parts) {
  for (int p = 0; p < parts; ++p)
    for (int c = 0; c < hs; c += 16) hwy::Prefetch(row + (int64_t)p * C + c);
}

// dst[0:hs) = src[0:hs), dst[hs:hsp) = 0 (a head's row, zero padded to whole vectors).
inline void CopyPadded(float* HWY_RESTRICT dst, const float* HWY_RESTRICT src, int hs, int hsp) {
  std::memcpy(dst, src, sizeof(float) * hs);
  std::fill(dst + hs, dst + hsp, 0.0f);
}

// C[r*ldc + 0:cols) = sum_{k<kn} A[r*ar + k*ak] * B[k*ldb + 0:NR) for r < R, NR = kNV*L.
// B must be readable for whole NR-wide rows; only cols (<= NR) columns of C are written.
template <int R>
HWY_NOINLINE void Tile(const float* HWY_RESTRICT A, int64_t ar, int64_t ak,
                       const float* HWY_RESTRICT B, int64_t ldb, int kn, float* HWY_RESTRICT C,
                       int64_t ldc, int cols) {
  const DF d;
  const int L = (int)hn::Lanes(d);
  VF acc[R][kNV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) acc[r][v] = hn::Zero(d);
  for (int k = 0; k < kn; ++k) {
    VF b[kNV];
    const float* bk = B + k * ldb;
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) b[v] = hn::LoadU(d, bk + v * L);
    const float* ak0 = A + k * ak;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const VF a = hn::Set(d, ak0[r * ar]);
#pragma GCC unroll 4
      for (int v = 0; v < kNV; ++v) acc[r][v] = hn::MulAdd(a, b[v], acc[r][v]);
    }
  }
  if (cols == kNV * L) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < kNV; ++v) hn::StoreU(acc[r][v], d, C + r * ldc + v * L);
  } else {  // partial columns: through a buffer, so nothing past cols is touched
    HWY_ALIGN float tmp[kNV * HWY_LANES(float)];
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < kNV; ++v) hn::Store(acc[r][v], d, tmp + v * L);
      std::memcpy(C + r * ldc, tmp, sizeof(float) * cols);
    }
  }
}

// Tile<rows> for 1 <= rows <= kR (the tails of the row blocks).
template <int R = kR>
HWY_INLINE void Tiles(int rows, const float* A, int64_t ar, int64_t ak, const float* B, int64_t ldb,
                      int kn, float* C, int64_t ldc, int cols) {
  if constexpr (R == 1) {
    Tile<1>(A, ar, ak, B, ldb, kn, C, ldc, cols);
  } else {
    if (rows == R) return Tile<R>(A, ar, ak, B, ldb, kn, C, ldc, cols);
    Tiles<R - 1>(rows, A, ar, ak, B, ldb, kn, C, ldc, cols);
  }
}

// C[rows][0:width) = A[rows][0:kn) (row stride ar, k stride ak) @ B[kn][0:width) (row stride
// ldb, readable up to RoundUp(width, NR)), column panel by column panel.
HWY_INLINE void TileRow(int rows, const float* A, int64_t ar, int64_t ak, const float* B,
                        int64_t ldb, int kn, float* C, int64_t ldc, int width) {
  const int NR = kNV * (int)hn::Lanes(DF());
  for (int c0 = 0; c0 < width; c0 += NR)
    Tiles(rows, A, ar, ak, B + c0, ldb, kn, C + c0, ldc, std::min(NR, width - c0));
}

// Forward for one (b, h), query rows [i0, i1), kR rows at a time: scores over keys
// [0, pos], softmax, probabilities @ V.
void ForwardTask(float* out, float* att, const float* qkv, int b, int h, int i0, int i1, int Tq,
                 int Tk, int C, int NH) {
  const DF d;
  const int L = (int)hn::Lanes(d);
  const int NR = kNV * L;
  const int hs = C / NH, hsp = RoundUp(hs, NR);
  const int q0 = Tk - Tq;
  const int jmax = q0 + i1;  // keys the task needs: [0, jmax)
  const int Tp = RoundUp(jmax, NR);
  const int ldk = PaddedLd(Tp, L);
  const float scale = 1.0f / std::sqrt((float)hs);
  float* kt = detail::tlsAtt.get((size_t)hs * ldk + (size_t)jmax * hsp + (size_t)kR * Tp);
  float* vr = kt + (size_t)hs * ldk;   // [jmax][hsp]
  float* s = vr + (size_t)jmax * hsp;  // [kR][Tp] scores, then probabilities
  const int64_t ld = 3 * (int64_t)C;
  const float* base = qkv + (int64_t)b * Tk * ld + h * hs;
  for (int j = 0; j < jmax; ++j) {
    if (j + kAhead < jmax) PrefetchHead(base + (j + kAhead) * ld, C, hs, 3);
    const float* k = base + j * ld + C;
    for (int c = 0; c < hs; ++c) kt[(int64_t)c * ldk + j] = k[c];
    CopyPadded(vr + (int64_t)j * hsp, base + j * ld + 2 * C, hs, hsp);
  }
  for (int c = 0; c < hs; ++c)
    std::fill(kt + (int64_t)c * ldk + jmax, kt + (int64_t)c * ldk + Tp, 0.0f);

  const VF vs = hn::Set(d, scale);
  for (int ib = i0; ib < i1; ib += kR) {
    const int rows = std::min(kR, i1 - ib);
    const int nmax = q0 + ib + rows;  // keys of the block's last row
    const int ncols = RoundUp(nmax, NR);
    // s[r][j] = q_{ib+r} . k_j
    TileRow(rows, base + (int64_t)(q0 + ib) * ld, ld, 1, kt, ldk, hs, s, Tp, ncols);
    for (int r = 0; r < rows; ++r) {
      float* sr = s + (int64_t)r * Tp;
      const int i = ib + r, n = q0 + i + 1;
      const int nvec = (n + L - 1) / L;
      VF mx = hn::Set(d, -INFINITY);  // max over the valid scores (lanes past n excluded)
      for (int v = 0; v < nvec; ++v) {
        const auto m = hn::FirstN(d, n - v * L);
        mx = hn::Max(mx, hn::IfThenElse(m, hn::Load(d, sr + v * L), hn::Set(d, -INFINITY)));
      }
      const VF mxs = hn::Mul(hn::MaxOfLanes(d, mx), vs);
      VF sum = hn::Zero(d);
      for (int v = 0; v < nvec; ++v) {
        const auto m = hn::FirstN(d, n - v * L);
        const VF p =
            hn::IfThenElseZero(m, hn::Exp(d, hn::MulSub(hn::Load(d, sr + v * L), vs, mxs)));
        hn::Store(p, d, sr + v * L);
        sum = hn::Add(sum, p);
      }
      const VF vinv = hn::Set(d, 1.0f / hn::GetLane(hn::SumOfLanes(d, sum)));
      for (int v = 0; v < nvec; ++v)
        hn::Store(hn::Mul(hn::Load(d, sr + v * L), vinv), d, sr + v * L);
      std::fill(sr + nvec * L, sr + ncols, 0.0f);  // the block's longer rows run past n
      float* a = att + (((int64_t)b * NH + h) * Tq + i) * Tk;
      std::memcpy(a, sr, sizeof(float) * n);
      std::fill(a + n, a + Tk, 0.0f);
    }
    // out[ib+r] = sum_j p[r][j] v_j
    TileRow(rows, s, Tp, 1, vr, hsp, nmax, out + ((int64_t)b * Tq + ib) * C + h * hs, C, hs);
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

// Backward for one (b, h). With P = att (row i over keys j <= i) and dP = dY V^T:
//   dS = P * (dP - rowsum(P * dP)) * scale;  dQ = dS K;  dK = dS^T Q;  dV = P^T dY.
// Phase 1 walks blocks of query rows (dP, dS, dQ); phase 2 blocks of key rows (dK, dV) over
// the stored dS and P columns.
void BackwardTask(float* dqkv, const float* dout, const float* qkv, const float* att, int b, int h,
                  int T, int C, int NH) {
  const DF d;
  const int L = (int)hn::Lanes(d);
  const int NR = kNV * L;
  const int hs = C / NH, hsp = RoundUp(hs, NR);
  const int Tp = RoundUp(T, NR);
  const int ldv = PaddedLd(Tp, L);  // vt, p and ds rows
  const float scale = 1.0f / std::sqrt((float)hs);
  const size_t rowsz = (size_t)T * hsp, sqsz = (size_t)T * ldv;
  float* vt = detail::tlsAtt.get((size_t)hs * ldv + 3 * rowsz + 2 * sqsz);
  float* q = vt + (size_t)hs * ldv;  // [T][hsp] each
  float* k = q + rowsz;
  float* dy = k + rowsz;
  float* p = dy + rowsz;  // [T][ldv] probabilities, zero past the causal edge
  float* ds = p + sqsz;   // [T][ldv] dP, then dS (zero past the causal edge)
  const int64_t ld = 3 * (int64_t)C;
  const float* base = qkv + (int64_t)b * T * ld + h * hs;
  const float* a0 = att + ((int64_t)b * NH + h) * T * T;
  for (int j = 0; j < T; ++j) {
    if (j + kAhead < T) {
      PrefetchHead(base + (j + kAhead) * ld, C, hs, 3);
      PrefetchHead(dout + ((int64_t)b * T + j + kAhead) * C + h * hs, 0, hs, 1);
    }
    const float* rq = base + j * ld;
    const float* rv = rq + 2 * C;
    for (int c = 0; c < hs; ++c) vt[(int64_t)c * ldv + j] = rv[c];
    CopyPadded(q + (int64_t)j * hsp, rq, hs, hsp);
    CopyPadded(k + (int64_t)j * hsp, rq + C, hs, hsp);
    CopyPadded(dy + (int64_t)j * hsp, dout + ((int64_t)b * T + j) * C + h * hs, hs, hsp);
  }
  for (int c = 0; c < hs; ++c)
    std::fill(vt + (int64_t)c * ldv + T, vt + (int64_t)c * ldv + Tp, 0.0f);

  const VF vscale = hn::Set(d, scale);
  const int nvT = Tp / L;
  for (int ib = 0; ib < T; ib += kR) {
    const int rows = std::min(kR, T - ib);
    const int nmax = ib + rows;
    // The saved probabilities come from memory (written by the forward long ago): fetch the
    // next block's rows while this block computes.
    for (int i = ib + kR; i < std::min(T, ib + 2 * kR); ++i)
      for (int c = 0; c <= i; c += 16) hwy::Prefetch(a0 + (int64_t)i * T + c);
    // dP[ib+r][j] = dy_{ib+r} . v_j into ds
    TileRow(rows, dy + (int64_t)ib * hsp, hsp, 1, vt, ldv, hs, ds + (int64_t)ib * ldv, ldv,
            RoundUp(nmax, NR));
    for (int r = 0; r < rows; ++r) {
      const int i = ib + r, n = i + 1;
      float* pr = p + (int64_t)i * ldv;
      float* dr = ds + (int64_t)i * ldv;
      std::memcpy(pr, a0 + (int64_t)i * T, sizeof(float) * n);
      std::fill(pr + n, pr + Tp, 0.0f);
      const int nvec = (n + L - 1) / L;  // p is zero past n, so whole vectors are exact
      VF dot = hn::Zero(d);
      for (int v = 0; v < nvec; ++v)
        dot = hn::MulAdd(hn::Load(d, pr + v * L), hn::Load(d, dr + v * L), dot);
      const VF vdot = hn::Set(d, hn::GetLane(hn::SumOfLanes(d, dot)));
      for (int v = 0; v < nvec; ++v) {
        const VF pv = hn::Load(d, pr + v * L);
        hn::Store(hn::Mul(hn::Mul(pv, hn::Sub(hn::Load(d, dr + v * L), vdot)), vscale), d,
                  dr + v * L);
      }
      for (int v = nvec; v < nvT; ++v) hn::Store(hn::Zero(d), d, dr + v * L);
    }
    // dq_i = sum_j dS_ij k_j
    TileRow(rows, ds + (int64_t)ib * ldv, ldv, 1, k, hsp, nmax,
            dqkv + ((int64_t)b * T + ib) * ld + h * hs, ld, hs);
  }
  for (int jb = 0; jb < T; jb += kR) {
    const int rows = std::min(kR, T - jb);
    const int kn = T - jb;  // queries i >= jb (dS and P are zero where i < j)
    float* dst = dqkv + ((int64_t)b * T + jb) * ld + h * hs;
    // dk_j = sum_i dS_ij q_i ; dv_j = sum_i P_ij dy_i
    TileRow(rows, ds + (int64_t)jb * ldv + jb, 1, ldv, q + (int64_t)jb * hsp, hsp, kn, dst + C, ld,
            hs);
    TileRow(rows, p + (int64_t)jb * ldv + jb, 1, ldv, dy + (int64_t)jb * hsp, hsp, kn, dst + 2 * C,
            ld, hs);
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
