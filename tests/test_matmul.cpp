// CPU f32 matmuls (kernels/cpu/matmul.cpp) against the double-accumulating reference, over a
// table of shapes that hits every tail of the register tiles (MR rows x NR columns, KC depth),
// the GEMV paths (M <= 4), K up to 4096, both 1 and 2 pool threads, and every SIMD target
// Highway compiled that this machine runs (MR and NR differ per target).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/thread_pool.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/ref/ref_kernels.h"
#include "test_util.h"

namespace ptllm {
namespace {

struct Shape3 {
  int M, K, N;
};

// Not all combinations: each row exercises different tails; sizes kept so the reference (scalar,
// double) stays fast.
const Shape3 kShapes[] = {
    {1, 1, 1},      {1, 2, 3},      {2, 3, 1},      {3, 7, 31},     {4, 31, 32},    {5, 33, 33},
    {7, 64, 65},    {8, 65, 7},     {9, 127, 129},  {31, 128, 127}, {32, 129, 64},  {33, 257, 31},
    {64, 13, 257},  {65, 97, 2},    {127, 256, 65}, {128, 257, 33}, {129, 31, 96},  {257, 64, 129},
    {61, 509, 53},  {1, 4096, 257}, {2, 4096, 67},  {3, 1031, 1},   {17, 4096, 37}, {1, 1024, 1031},
    {4, 300, 2053}, {6, 256, 768},  {300, 200, 50}, {1, 0, 5},      {3, 0, 2},
};

constexpr float kEps = std::numeric_limits<float>::epsilon();
constexpr size_t kGuard = 37;
constexpr float kGuardValue = 12345.5f;

// Entries are uniform in [-1,1]: a sum of K products has rms ~ sqrt(K)/3, and each of the K
// f32 roundings of a partial sum adds an error of at most eps/2 of it, so the accumulated error
// is ~ eps * sqrt(K) * (that magnitude); x8 covers the tails over many outputs and the
// different summation order (blocked FMA vs sequential double). `extra` is the magnitude of a
// bias or of the accumulated-into values.
double tolerance(int K, double extra) {
  return 8.0 * kEps * std::sqrt(double(std::max(K, 1))) * (std::sqrt(double(K)) / 3.0 + extra);
}

enum class Op { kMatmul, kMatmulBias, kAbt, kAbtAcc, kAtb, kAtbAcc };
const char* opName(Op op) {
  static const char* names[] = {"matmul", "matmul+bias", "abt", "abt+acc", "atb", "atb+acc"};
  return names[int(op)];
}

void runOp(Op op, float* out, const float* a, const float* b, const float* bias, int M, int K,
           int N, bool ref) {
  switch (op) {
    case Op::kMatmul:
    case Op::kMatmulBias: {
      const float* bb = op == Op::kMatmulBias ? bias : nullptr;
      return ref ? ref::matmul(out, a, b, bb, M, K, N) : cpu::matmul(out, a, b, bb, M, K, N);
    }
    case Op::kAbt:
    case Op::kAbtAcc: {
      const bool acc = op == Op::kAbtAcc;
      return ref ? ref::matmulAbt(out, a, b, M, K, N, acc)
                 : cpu::matmulAbt(out, a, b, M, K, N, acc);
    }
    case Op::kAtb:
    case Op::kAtbAcc: {
      const bool acc = op == Op::kAtbAcc;
      return ref ? ref::matmulAtb(out, a, b, M, K, N, acc)
                 : cpu::matmulAtb(out, a, b, M, K, N, acc);
    }
  }
}

void checkOp(Op op) {
  const bool accumulate = op == Op::kAbtAcc || op == Op::kAtbAcc;
  uint64_t seed = 1000 + 17 * int(op);
  for (const Shape3& s : kShapes) {
    const size_t nOut = size_t(s.M) * s.N;
    // a is [M,K] (or [K,M] for atb), b is [K,N] (or [N,K] for abt): same element counts.
    const auto a = test::randomVector(size_t(s.M) * s.K, seed++);
    const auto b = test::randomVector(size_t(s.K) * s.N, seed++);
    const auto bias = test::randomVector(s.N, seed++);
    const auto init = test::randomVector(nOut, seed++);  // finite values accumulated into
    std::vector<float> want = accumulate ? init : test::poisoned(nOut);
    runOp(op, want.data(), a.data(), b.data(), bias.data(), s.M, s.K, s.N, true);
    const double tol = tolerance(s.K, op == Op::kMatmulBias || accumulate ? 1.0 : 0.0);
    test::forEachSimdTarget([&] {
      for (int threads : {1, 2}) {
        setThreads(threads);
        SCOPED_TRACE(::testing::Message() << opName(op) << " M=" << s.M << " K=" << s.K
                                          << " N=" << s.N << " threads=" << threads);
        std::vector<float> got = accumulate ? init : test::poisoned(nOut);
        got.resize(nOut + kGuard, kGuardValue);
        runOp(op, got.data(), a.data(), b.data(), bias.data(), s.M, s.K, s.N, false);
        EXPECT_TRUE(test::allFinite(got.data(), nOut));
        EXPECT_LE(test::worstRatio(got.data(), want.data(), nOut, tol, 0.0), 1.0)
            << "max abs diff " << test::maxAbsDiff(got.data(), want.data(), nOut) << " tol " << tol;
        for (size_t i = nOut; i < nOut + kGuard; ++i)
          ASSERT_EQ(got[i], kGuardValue) << "guard " << i;
      }
    });
  }
  setThreads(0);
}

TEST(CpuMatmul, Matmul) {
  checkOp(Op::kMatmul);
}
TEST(CpuMatmul, MatmulBias) {
  checkOp(Op::kMatmulBias);
}
TEST(CpuMatmul, Abt) {
  checkOp(Op::kAbt);
}
TEST(CpuMatmul, AbtAccumulate) {
  checkOp(Op::kAbtAcc);
}
TEST(CpuMatmul, Atb) {
  checkOp(Op::kAtb);
}
TEST(CpuMatmul, AtbAccumulate) {
  checkOp(Op::kAtbAcc);
}

// The training shapes once (M=4096 rows of activations), checked on a sample of rows so the
// reference stays cheap: the forward, dIn = dOut @ W^T, dW = In^T @ dOut, the tied logits.
TEST(CpuMatmul, TrainingShapesSampled) {
  const int M = 4096, K = 256, N = 768;
  const auto in = test::randomVector(size_t(M) * K, 1), w = test::randomVector(size_t(K) * N, 2);
  const auto bias = test::randomVector(N, 3);
  std::vector<float> out = test::poisoned(size_t(M) * N), want(N);
  cpu::matmul(out.data(), in.data(), w.data(), bias.data(), M, K, N);
  for (int m : {0, 1, 7, 8, 2047, 4000, 4095}) {
    ref::matmul(want.data(), in.data() + size_t(m) * K, w.data(), bias.data(), 1, K, N);
    EXPECT_LE(test::worstRatio(out.data() + size_t(m) * N, want.data(), N, tolerance(K, 1), 0), 1)
        << "row " << m;
  }
  // dIn[M,K] = dOut[M,N] @ W[K,N]^T
  std::vector<float> din = test::poisoned(size_t(M) * K), wantK(K);
  cpu::matmulAbt(din.data(), out.data(), w.data(), M, N, K, false);
  EXPECT_TRUE(test::allFinite(din.data(), din.size()));
  const double outMag = std::sqrt(double(K)) / 3 + 1;  // |out| scale
  for (int m : {0, 5, 4095}) {
    ref::matmulAbt(wantK.data(), out.data() + size_t(m) * N, w.data(), 1, N, K, false);
    EXPECT_LE(
        test::worstRatio(din.data() + size_t(m) * K, wantK.data(), K, tolerance(N, 0) * outMag, 0),
        1)
        << "row " << m;
  }
  // dW[K,N] = In[M,K]^T @ dOut[M,N]; check a few rows by a 1-row Atb on a column of In
  std::vector<float> dw = test::poisoned(size_t(K) * N), col(M), wantN(N);
  cpu::matmulAtb(dw.data(), in.data(), out.data(), K, M, N, false);
  EXPECT_TRUE(test::allFinite(dw.data(), dw.size()));
  for (int k : {0, 100, 255}) {
    for (int m = 0; m < M; ++m) col[m] = in[size_t(m) * K + k];
    ref::matmulAtb(wantN.data(), col.data(), out.data(), 1, M, N, false);
    EXPECT_LE(
        test::worstRatio(dw.data() + size_t(k) * N, wantN.data(), N, tolerance(M, 0) * outMag, 0),
        1)
        << "row " << k;
  }
}

TEST(CpuMatmul, BiasBackward) {
  uint64_t seed = 77;
  for (const Shape3& s : kShapes) {
    if (s.M == 0) continue;
    const auto dout = test::randomVector(size_t(s.M) * s.N, seed++);
    const auto init = test::randomVector(s.N, seed++);
    std::vector<float> want = init;
    ref::biasBackward(want.data(), dout.data(), s.M, s.N);
    for (int threads : {1, 2}) {
      setThreads(threads);
      SCOPED_TRACE(::testing::Message() << "M=" << s.M << " N=" << s.N << " threads=" << threads);
      std::vector<float> got = init;
      got.resize(s.N + kGuard, kGuardValue);
      cpu::biasBackward(got.data(), dout.data(), s.M, s.N);
      // a sum of M values in [-1,1] plus the initial value, in f32: eps * sqrt(M) * magnitude.
      EXPECT_LE(test::worstRatio(got.data(), want.data(), s.N, tolerance(s.M, 1.0), 0), 1.0);
      for (size_t i = s.N; i < s.N + kGuard; ++i) ASSERT_EQ(got[i], kGuardValue);
    }
  }
  setThreads(0);
}

// The fused dW / db of a linear layer: out (+=) a^T @ b and dbias += column sums of b, against
// the reference's two ops, for both accumulate modes (out poisoned when overwritten).
TEST(CpuMatmul, AtbBias) {
  uint64_t seed = 515;
  for (const Shape3& s : kShapes) {
    const size_t nOut = size_t(s.M) * s.N;
    const auto a = test::randomVector(size_t(s.K) * s.M, seed++);  // [K,M]
    const auto b = test::randomVector(size_t(s.K) * s.N, seed++);  // [K,N]
    const auto init = test::randomVector(nOut, seed++);
    const auto dbInit = test::randomVector(s.N, seed++);
    for (bool accumulate : {false, true}) {
      std::vector<float> want = accumulate ? init : test::poisoned(nOut), wantDb = dbInit;
      ref::matmulAtb(want.data(), a.data(), b.data(), s.M, s.K, s.N, accumulate);
      ref::biasBackward(wantDb.data(), b.data(), s.K, s.N);
      const double tol = tolerance(s.K, accumulate ? 1.0 : 0.0), tolDb = tolerance(s.K, 1.0);
      test::forEachSimdTarget([&] {
        for (int threads : {1, 2}) {
          setThreads(threads);
          SCOPED_TRACE(::testing::Message()
                       << "M=" << s.M << " K=" << s.K << " N=" << s.N
                       << " accumulate=" << accumulate << " threads=" << threads);
          std::vector<float> got = accumulate ? init : test::poisoned(nOut), gotDb = dbInit;
          got.resize(nOut + kGuard, kGuardValue);
          gotDb.resize(s.N + kGuard, kGuardValue);
          cpu::matmulAtbBias(got.data(), gotDb.data(), a.data(), b.data(), s.M, s.K, s.N,
                             accumulate);
          EXPECT_TRUE(test::allFinite(got.data(), nOut));
          EXPECT_LE(test::worstRatio(got.data(), want.data(), nOut, tol, 0.0), 1.0)
              << "max abs diff " << test::maxAbsDiff(got.data(), want.data(), nOut);
          EXPECT_TRUE(test::allFinite(gotDb.data(), s.N));
          EXPECT_LE(test::worstRatio(gotDb.data(), wantDb.data(), s.N, tolDb, 0.0), 1.0)
              << "db max abs diff " << test::maxAbsDiff(gotDb.data(), wantDb.data(), s.N);
          for (size_t i = nOut; i < nOut + kGuard; ++i) ASSERT_EQ(got[i], kGuardValue);
          for (size_t i = s.N; i < s.N + kGuard; ++i) ASSERT_EQ(gotDb[i], kGuardValue);
        }
      });
    }
  }
  setThreads(0);
}

TEST(CpuMatmul, SimdTargetName) {
  const char* name = cpu::simdTargetName();
  ASSERT_NE(name, nullptr);
  EXPECT_GT(std::string(name).size(), 0u);
  std::printf("[ info ] SIMD target: %s\n", name);
}

}  // namespace
}  // namespace ptllm
