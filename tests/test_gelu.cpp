// CPU GELU (kernels/cpu/gelu.cpp) against the double reference on every SIMD target Highway
// compiled that this machine runs, 1 and 2 pool threads: lengths around the vector width and
// the thread grain (1, 7, 15/16/17, 33, 8191/8192/8193, 100003), inputs in [-6, 6] and a wide
// range [-40, 40] (the clamped Exp), NaN-poisoned outputs, guards, in-place (out == in) calls.
#include <gtest/gtest.h>

#include <vector>

#include "core/thread_pool.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/ref/ref_kernels.h"
#include "test_util.h"

namespace ptllm {
namespace {

constexpr size_t kGuard = 19;
constexpr float kGuardValue = 4242.25f;

TEST(CpuGelu, ForwardBackwardEveryTarget) {
  uint64_t seed = 900;
  for (float range : {6.0f, 40.0f}) {
    for (int64_t n : {1, 7, 15, 16, 17, 33, 8191, 8192, 8193, 100003}) {
      const size_t un = size_t(n);
      const auto x = test::randomVector(un, seed++, -range, range);
      const auto dy = test::randomVector(un, seed++);
      std::vector<float> y(un), g(un);
      ref::geluForward(y.data(), x.data(), n);
      ref::geluBackward(g.data(), x.data(), dy.data(), n);
      test::forEachSimdTarget([&] {
        for (int threads : {1, 2}) {
          setThreads(threads);
          SCOPED_TRACE(::testing::Message()
                       << "n=" << n << " range=" << range << " threads=" << threads);
          auto gy = test::poisoned(un);
          gy.resize(un + kGuard, kGuardValue);
          cpu::geluForward(gy.data(), x.data(), n);
          EXPECT_TRUE(test::allFinite(gy.data(), un));
          // Exp and the division: a few ulp of the result (atol for the values near 0).
          EXPECT_LE(test::worstRatio(gy.data(), y.data(), un, 1e-6, 1e-5), 1.0)
              << "max diff " << test::maxAbsDiff(gy.data(), y.data(), un);
          auto gg = test::poisoned(un);
          gg.resize(un + kGuard, kGuardValue);
          cpu::geluBackward(gg.data(), x.data(), dy.data(), n);
          EXPECT_TRUE(test::allFinite(gg.data(), un));
          // as in OpsVsRef.GeluForwardBackward: s (1 - s) carries Exp's error, amplified by
          // 2|x| * 0.8 * (1 + 0.134 x^2) where s (1 - s) is not negligible (|x| < ~7).
          EXPECT_LE(test::worstRatio(gg.data(), g.data(), un, 1.2e-5, 1e-5), 1.0)
              << "max diff " << test::maxAbsDiff(gg.data(), g.data(), un);
          for (size_t i = un; i < un + kGuard; ++i) {
            ASSERT_EQ(gy[i], kGuardValue) << "guard " << i - un;
            ASSERT_EQ(gg[i], kGuardValue) << "guard " << i - un;
          }
          // in place, as the model calls them (gelu out may alias in, din may alias dout)
          auto inPlace = x;
          cpu::geluForward(inPlace.data(), inPlace.data(), n);
          EXPECT_LE(test::worstRatio(inPlace.data(), y.data(), un, 1e-6, 1e-5), 1.0);
          auto dInPlace = dy;
          cpu::geluBackward(dInPlace.data(), x.data(), dInPlace.data(), n);
          EXPECT_LE(test::worstRatio(dInPlace.data(), g.data(), un, 1.2e-5, 1e-5), 1.0);
        }
      });
    }
  }
  setThreads(0);
}

}  // namespace
}  // namespace ptllm
