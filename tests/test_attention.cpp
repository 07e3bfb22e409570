// Fast CPU causal attention (kernels/cpu/attention.cpp) against the double-accumulating
// reference: the training form (Tq == Tk) forward and backward, and the decode forms
// (Tq < Tk, queries are the last Tq positions), over head sizes that are below, at and above
// the vector width and the tiles' NR-column panels (hs 1, 31/32/33, 96), positions around the
// tiles' row blocks (6/8 rows) and panels (T 31/32/33, primes, 257), with 1 and 2 pool threads,
// on every SIMD target Highway compiled that this machine runs (each has its own tile).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/thread_pool.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/ref/ref_kernels.h"
#include "test_util.h"

namespace ptllm {
namespace {

constexpr float kEps = std::numeric_limits<float>::epsilon();
constexpr size_t kGuard = 23;
constexpr float kGuardValue = -4242.5f;

struct AttShape {
  int B, Tq, Tk, C, NH;
};
const AttShape kShapes[] = {
    {1, 1, 1, 4, 1},
    {2, 7, 7, 8, 2},
    {1, 33, 33, 12, 3},
    {2, 64, 64, 32, 2},
    {1, 65, 65, 40, 2},
    {2, 17, 17, 48, 1},
    {1, 130, 130, 128, 2},
    {1, 40, 40, 72, 1},
    {3, 31, 31, 30, 3},
    {1, 97, 97, 256, 4},
    {2, 256, 256, 256, 4},
    // decode: one or a few queries at the end of the cache
    {1, 1, 1, 64, 4},
    {1, 1, 97, 64, 4},
    {2, 1, 300, 96, 3},
    {1, 5, 37, 20, 2},
    {1, 64, 200, 64, 1},
    // tile edges: row blocks (6 or 8 rows), column panels (NR = 2 vectors), head sizes
    {1, 9, 9, 3, 3},        // hs = 1
    {2, 31, 31, 62, 2},     // hs = 31
    {1, 32, 32, 64, 2},     // hs = 32
    {1, 33, 33, 66, 2},     // hs = 33
    {1, 13, 13, 96, 1},     // hs = 96: three 32-wide panels
    {3, 8, 8, 16, 1},       // one full 8-row block
    {1, 257, 257, 128, 2},  // one position past 256
    {2, 101, 101, 40, 5},   // prime T, hs = 8
    {1, 9, 40, 24, 2},      // decode with a 6/8-row block and a tail
    {2, 17, 50, 96, 3},
};

// Max |x| over an array, at least 1 (the scale of the tolerance).
double magnitude(const std::vector<float>& v) {
  double m = 1.0;
  for (float x : v) m = std::max(m, double(std::fabs(x)));
  return m;
}

TEST(CpuAttention, Forward) {
  uint64_t seed = 500;
  for (const AttShape& s : kShapes) {
    const int hs = s.C / s.NH;
    const size_t nQkv = size_t(s.B) * s.Tk * 3 * s.C, nOut = size_t(s.B) * s.Tq * s.C;
    const size_t nAtt = size_t(s.B) * s.NH * s.Tq * s.Tk;
    const auto qkv = test::randomVector(nQkv, seed++);
    std::vector<float> wantOut(nOut), wantAtt(nAtt);
    ref::attentionForward(wantOut.data(), wantAtt.data(), qkv.data(), s.B, s.Tq, s.Tk, s.C, s.NH);
    // Scores are f32 dot products of hs terms in [-1,1] (error ~ eps*sqrt(hs)*sqrt(hs)/3,
    // scaled by 1/sqrt(hs)); exp turns a score error into the same relative error of a prob;
    // the output sums Tk prob-weighted values (error ~ eps*sqrt(Tk)). x16 covers the tails and
    // Highway's Exp (a few ulp).
    const double tol = 16.0 * kEps * (std::sqrt(double(hs)) + std::sqrt(double(s.Tk)) + 1.0);
    test::forEachSimdTarget([&] {
      for (int threads : {1, 2}) {
        setThreads(threads);
        SCOPED_TRACE(::testing::Message()
                     << "B=" << s.B << " Tq=" << s.Tq << " Tk=" << s.Tk << " C=" << s.C
                     << " NH=" << s.NH << " threads=" << threads);
        std::vector<float> out = test::poisoned(nOut), att = test::poisoned(nAtt);
        out.resize(nOut + kGuard, kGuardValue);
        att.resize(nAtt + kGuard, kGuardValue);
        cpu::attentionForward(out.data(), att.data(), qkv.data(), s.B, s.Tq, s.Tk, s.C, s.NH);
        EXPECT_TRUE(test::allFinite(out.data(), nOut));
        EXPECT_TRUE(test::allFinite(att.data(), nAtt));
        EXPECT_LE(test::worstRatio(att.data(), wantAtt.data(), nAtt, tol, 0), 1.0)
            << "att max diff " << test::maxAbsDiff(att.data(), wantAtt.data(), nAtt);
        EXPECT_LE(test::worstRatio(out.data(), wantOut.data(), nOut, tol, 0), 1.0)
            << "out max diff " << test::maxAbsDiff(out.data(), wantOut.data(), nOut);
        // masked entries are exactly zero
        for (int b = 0; b < s.B; ++b)
          for (int h = 0; h < s.NH; ++h)
            for (int i = 0; i < s.Tq; ++i)
              for (int j = s.Tk - s.Tq + i + 1; j < s.Tk; ++j)
                ASSERT_EQ(att[((size_t(b) * s.NH + h) * s.Tq + i) * s.Tk + j], 0.0f);
        for (size_t i = 0; i < kGuard; ++i) {
          ASSERT_EQ(out[nOut + i], kGuardValue);
          ASSERT_EQ(att[nAtt + i], kGuardValue);
        }
      }
    });
  }
  setThreads(0);
}

TEST(CpuAttention, Backward) {
  uint64_t seed = 900;
  for (const AttShape& s : kShapes) {
    if (s.Tq != s.Tk) continue;  // the backward is the training form only
    const int T = s.Tq, hs = s.C / s.NH;
    const size_t nQkv = size_t(s.B) * T * 3 * s.C, nOut = size_t(s.B) * T * s.C;
    const size_t nAtt = size_t(s.B) * s.NH * T * T;
    const auto qkv = test::randomVector(nQkv, seed++);
    const auto dout = test::randomVector(nOut, seed++);
    std::vector<float> out(nOut), att(nAtt);
    ref::attentionForward(out.data(), att.data(), qkv.data(), s.B, T, T, s.C, s.NH);
    // The backward reads only the causal part of att (j <= i), as the reference does: NaN in
    // the masked part must not leak into the gradients.
    for (size_t bh = 0; bh < size_t(s.B) * s.NH; ++bh)
      for (int i = 0; i < T; ++i)
        for (int j = i + 1; j < T; ++j)
          att[(bh * T + i) * T + j] = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> want = test::poisoned(nQkv);
    ref::attentionBackward(want.data(), dout.data(), qkv.data(), att.data(), s.B, T, s.C, s.NH);
    // Each gradient is a sum over up to T positions of products of terms whose own f32 error
    // is ~ eps*sqrt(hs) relative (the dot products dy.v and the softmax backward), so the
    // error is ~ eps*sqrt(T*hs) of the largest gradient; x32 for the tails.
    const double tol = 32.0 * kEps * std::sqrt(double(T) * hs) * magnitude(want);
    test::forEachSimdTarget([&] {
      for (int threads : {1, 2}) {
        setThreads(threads);
        SCOPED_TRACE(::testing::Message() << "B=" << s.B << " T=" << T << " C=" << s.C
                                          << " NH=" << s.NH << " threads=" << threads);
        std::vector<float> got = test::poisoned(nQkv);
        got.resize(nQkv + kGuard, kGuardValue);
        cpu::attentionBackward(got.data(), dout.data(), qkv.data(), att.data(), s.B, T, s.C, s.NH);
        EXPECT_TRUE(test::allFinite(got.data(), nQkv));
        EXPECT_LE(test::worstRatio(got.data(), want.data(), nQkv, tol, 0), 1.0)
            << "max diff " << test::maxAbsDiff(got.data(), want.data(), nQkv) << " tol " << tol;
        for (size_t i = 0; i < kGuard; ++i) ASSERT_EQ(got[nQkv + i], kGuardValue);
      }
    });
  }
  setThreads(0);
}

}  // namespace
}  // namespace ptllm
