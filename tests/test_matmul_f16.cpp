// The f16-storage matmul path (kernels/cpu/matmul_f16.cpp): the scalar conversions and the
// packer against hand-worked IEEE binary16 cases, then matmulF16 against a double reference
// over the unpacked f16 weights (tight) and against the f32 reference (looser).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/half.h"
#include "core/rng.h"
#include "core/thread_pool.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/ref/ref_kernels.h"
#include "test_util.h"

namespace ptllm {
namespace {

constexpr float kEps = std::numeric_limits<float>::epsilon();

// The binary16 bits packF16 stores for x (a 1x1 matrix; the layout pads it to a panel).
// f16 -> f32 -> f16 is exact for every non-NaN value, so the bits read back unchanged.
uint16_t packOne(float x, bool* ok) {
  std::vector<uint16_t> buf(cpu::f16PackedBytes(1, 1) / 2, 0xffff);
  *ok = cpu::packF16(buf.data(), &x, 1, 1);
  return f32ToF16(cpu::f16PackedAt(buf.data(), 1, 1, 0, 0));
}

TEST(F16, HandCases) {
  struct Case {
    float in;
    uint16_t want;
  };
  const Case cases[] = {
      {0.0f, 0x0000},
      {-0.0f, 0x8000},
      {1.0f, 0x3c00},
      {-2.0f, 0xc000},
      {65504.0f, 0x7bff},               // largest finite
      {65519.99f, 0x7bff},              // below the tie to 65520: rounds down
      {std::ldexp(1.0f, -14), 0x0400},  // smallest normal
      {std::ldexp(1.0f, -24), 0x0001},  // smallest subnormal
      {-std::ldexp(1.0f, -24), 0x8001},
      {std::ldexp(1023.0f, -24), 0x03ff},  // largest subnormal
      {std::ldexp(1.0f, -25), 0x0000},     // tie between 0 and 2^-24: even (0)
      {std::ldexp(1.5f, -25), 0x0001},     // above the tie
      {std::ldexp(3.0f, -25), 0x0002},     // 1.5 units: tie between 1 and 2 -> even 2
      {std::ldexp(5.0f, -25), 0x0002},     // 2.5 units: tie between 2 and 3 -> even 2
      {std::ldexp(2047.0f, -25), 0x0400},  // 1023.5 units: tie -> even 1024 = smallest normal
      {std::ldexp(1.0f, -26), 0x0000},
      {1.0f + std::ldexp(1.0f, -11), 0x3c00},      // tie between 0x3c00 and 0x3c01 -> even
      {1.0f + 3 * std::ldexp(1.0f, -11), 0x3c02},  // tie between 0x3c01 and 0x3c02 -> even
      {1.0f + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -20), 0x3c01},  // just above a tie
      {2048.0f + 1.0f, 0x6800},                                        // tie at 2049 -> 2048 (even)
      {2048.0f + 3.0f, 0x6802},                                        // tie at 2051 -> 2052 (even)
      {0.1f, 0x2e66},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "x=" << c.in);
    EXPECT_EQ(f32ToF16(c.in), c.want);
    bool ok = false;
    EXPECT_EQ(packOne(c.in, &ok), c.want);
    EXPECT_TRUE(ok);
  }
  // Overflow, infinities and NaN make the matrix ineligible.
  for (float bad :
       {65520.0f, -65520.0f, 1e6f, std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    bool ok = true;
    packOne(bad, &ok);
    EXPECT_FALSE(ok) << bad;
  }
  EXPECT_EQ(f32ToF16(65520.0f), 0x7c00);
  EXPECT_EQ(f32ToF16(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(f32ToF16(std::numeric_limits<float>::quiet_NaN()) & 0x7c00, 0x7c00);
  EXPECT_NE(f32ToF16(std::numeric_limits<float>::quiet_NaN()) & 0x03ff, 0);
  // One bad element anywhere in a larger matrix fails the whole pack.
  std::vector<float> w = test::randomVector(33 * 65, 5);
  std::vector<uint16_t> dst(cpu::f16PackedBytes(33, 65) / 2);
  EXPECT_TRUE(cpu::packF16(dst.data(), w.data(), 33, 65));
  w[33 * 65 - 1] = 70000.0f;
  EXPECT_FALSE(cpu::packF16(dst.data(), w.data(), 33, 65));
}

TEST(F16, DecodeAllAndRoundTrip) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = f16ToF32(uint16_t(h));
    const uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0x1f) {
      EXPECT_TRUE(m ? std::isnan(f) : std::isinf(f)) << h;
      continue;
    }
    // value = (-1)^s * (e ? 1024 + m : m) * 2^(max(e,1) - 25)
    const double want = (h & 0x8000 ? -1.0 : 1.0) * (e ? 1024.0 + m : double(m)) *
                        std::ldexp(1.0, int(std::max<uint32_t>(e, 1)) - 25);
    ASSERT_EQ(double(f), want) << h;
    ASSERT_EQ(f32ToF16(f), uint16_t(h)) << h;
  }
}

// Random f32 values over the whole f16 range: the result is the nearest f16, ties to even.
TEST(F16, NearestEvenOnRandomValues) {
  Rng rng(11);
  for (int i = 0; i < 200000; ++i) {
    const float x = std::ldexp(rng.uniform(-1.0f, 1.0f), int(rng.below(42)) - 26);
    const uint16_t h = f32ToF16(x);
    ASSERT_NE(h & 0x7c00, 0x7c00) << x;
    const double err = std::fabs(double(f16ToF32(h)) - x);
    for (int step : {-1, 1}) {  // neighbours in magnitude, same sign
      const uint16_t mag = h & 0x7fff;
      if ((step < 0 && mag == 0) || (step > 0 && mag == 0x7bff)) continue;
      const uint16_t nb = uint16_t((h & 0x8000) | (mag + step));
      const double nerr = std::fabs(double(f16ToF32(nb)) - x);
      ASSERT_LE(err, nerr) << "x=" << x;
      if (err == nerr) {
        ASSERT_EQ(h & 1, 0) << "tie not to even, x=" << x;
      }
    }
  }
}

struct Shape3 {
  int M, K, N;
};
const Shape3 kShapes[] = {
    {1, 1, 1},       {1, 7, 3},     {2, 31, 33},    {3, 64, 65},   {4, 65, 127},  {5, 33, 129},
    {7, 129, 31},    {8, 257, 64},  {31, 127, 257}, {33, 256, 17}, {64, 300, 96}, {65, 97, 1031},
    {1, 4096, 1031}, {3, 4096, 67}, {129, 31, 31},  {2, 0, 9},     {2, 100, 193}, {4, 1, 64},
    {1, 64, 128},    {6, 100, 130}, {4, 37, 1},
};

// f16PackedAt reads back exactly f32ToF16(w[k,n]) for every element, whatever the padding.
TEST(F16, PackedLayoutRoundTrip) {
  uint64_t seed = 900;
  for (const Shape3& s : kShapes) {
    const auto w = test::randomVector(size_t(s.K) * s.N, seed++);
    std::vector<uint16_t> w16(cpu::f16PackedBytes(s.K, s.N) / 2 + 1, 0xffff);
    ASSERT_TRUE(cpu::packF16(w16.data(), w.data(), s.K, s.N));
    EXPECT_EQ(w16.back(), 0xffff);  // nothing written past f16PackedBytes
    for (int k = 0; k < s.K; ++k)
      for (int n = 0; n < s.N; ++n)
        ASSERT_EQ(f32ToF16(cpu::f16PackedAt(w16.data(), s.K, s.N, k, n)),
                  f32ToF16(w[size_t(k) * s.N + n]))
            << "K=" << s.K << " N=" << s.N << " k=" << k << " n=" << n;
  }
}

TEST(F16, MatmulAgainstReferences) {
  uint64_t seed = 300;
  for (const Shape3& s : kShapes) {
    const auto in = test::randomVector(size_t(s.M) * s.K, seed++);
    const auto w = test::randomVector(size_t(s.K) * s.N, seed++);
    const auto bias = test::randomVector(s.N, seed++);
    std::vector<uint16_t> w16(cpu::f16PackedBytes(s.K, s.N) / 2 + 1);
    ASSERT_TRUE(cpu::packF16(w16.data(), w.data(), s.K, s.N));
    // Reference over the unpacked weights, in double.
    std::vector<float> wantExact(size_t(s.M) * s.N);
    for (int m = 0; m < s.M; ++m)
      for (int n = 0; n < s.N; ++n) {
        double acc = bias[n];
        for (int k = 0; k < s.K; ++k)
          acc += double(in[size_t(m) * s.K + k]) * cpu::f16PackedAt(w16.data(), s.K, s.N, k, n);
        wantExact[size_t(m) * s.N + n] = float(acc);
      }
    std::vector<float> want32(size_t(s.M) * s.N);
    ref::matmul(want32.data(), in.data(), w.data(), bias.data(), s.M, s.K, s.N);
    const double rootK = std::sqrt(double(std::max(s.K, 1)));
    // Same f32 FMA accumulation as the f32 matmul: a sum of K products of magnitude <= 1 has
    // rms ~ sqrt(K)/3; each f32 rounding of a partial sum costs eps/2 of it -> eps*sqrt(K)*mag,
    // x8 for the tails over many outputs (bias adds 1 to the magnitude).
    const double tolExact = 8.0 * kEps * rootK * (rootK / 3.0 + 1.0);
    // Against the f32 weights the f16 rounding dominates: relative error <= 2^-11 per weight,
    // independent over k, so the sum's error has rms ~ 2^-11 * sqrt(K) / (3*sqrt(3)); x8 again.
    const double tol32 = 8.0 * std::ldexp(1.0, -11) * rootK / 3.0 + tolExact;
    test::forEachSimdTarget([&] {
      for (int threads : {1, 2}) {
        setThreads(threads);
        SCOPED_TRACE(::testing::Message()
                     << "M=" << s.M << " K=" << s.K << " N=" << s.N << " threads=" << threads);
        const size_t nOut = size_t(s.M) * s.N, guard = 19;
        std::vector<float> got = test::poisoned(nOut);
        got.resize(nOut + guard, -777.25f);
        cpu::matmulF16(got.data(), in.data(), w16.data(), bias.data(), s.M, s.K, s.N);
        EXPECT_TRUE(test::allFinite(got.data(), nOut));
        EXPECT_LE(test::worstRatio(got.data(), wantExact.data(), nOut, tolExact, 0), 1.0)
            << "max diff " << test::maxAbsDiff(got.data(), wantExact.data(), nOut);
        EXPECT_LE(test::worstRatio(got.data(), want32.data(), nOut, tol32, 0), 1.0)
            << "max diff " << test::maxAbsDiff(got.data(), want32.data(), nOut);
        for (size_t i = nOut; i < nOut + guard; ++i) ASSERT_EQ(got[i], -777.25f);
        // no bias
        std::vector<float> nob = test::poisoned(nOut);
        cpu::matmulF16(nob.data(), in.data(), w16.data(), nullptr, s.M, s.K, s.N);
        std::vector<float> wantNob = wantExact;
        for (size_t i = 0; i < nOut; ++i) wantNob[i] -= bias[i % s.N];
        EXPECT_LE(test::worstRatio(nob.data(), wantNob.data(), nOut, tolExact + 2 * kEps, 0), 1.0);
      }
    });
  }
  setThreads(0);
}

}  // namespace
}  // namespace ptllm
