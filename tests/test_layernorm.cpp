// CPU LayerNorm (kernels/cpu/layernorm.cpp) against the double-accumulating reference, over
// row widths below, at and above the vector width and its 2-vector step (1, 7, 31/32/33, 97,
// 127, 1024, 4099), row counts from 1 to thousands (dw/db sum over rows), inputs with a large
// mean (the variance subtracts it), NaN-poisoned outputs and guards, 1 and 2 pool threads, on
// every SIMD target Highway compiled that this machine runs.
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

constexpr double kEps = std::numeric_limits<float>::epsilon();
constexpr size_t kGuard = 17;
constexpr float kGuardValue = 31337.5f;

struct LnShape {
  int M, C;
  float offset;  // added to every input: a row mean far from 0
};
const LnShape kShapes[] = {{1, 1, 0},    {3, 7, 0},    {5, 31, 3},    {4, 32, 0},   {6, 33, -5},
                           {17, 64, 0},  {2, 97, 10},  {9, 127, 0},   {33, 256, 1}, {7, 1024, 0},
                           {3, 4099, 2}, {300, 48, 0}, {2003, 33, 0}, {1, 256, 100}};

double maxAbs(const std::vector<float>& v, size_t n) {
  double m = 1.0;
  for (size_t i = 0; i < n; ++i) m = std::max(m, double(std::fabs(v[i])));
  return m;
}

// f32 sums of n terms: each rounding costs eps/2 of a partial sum, the errors add like a
// random walk, so ~eps*sqrt(n) of the magnitude; x16 for the tails and the other
// roundings around the sums (mean, rstd, the products of the output).
double tol(int n, double magnitude) {
  return 16.0 * kEps * std::sqrt(double(std::max(n, 1))) * magnitude;
}

std::vector<float> withGuard(std::vector<float> v) {
  v.resize(v.size() + kGuard, kGuardValue);
  return v;
}
void expectGuard(const std::vector<float>& v, size_t n) {
  for (size_t i = n; i < n + kGuard; ++i) ASSERT_EQ(v[i], kGuardValue) << "guard " << i - n;
}

TEST(CpuLayerNorm, ForwardBackward) {
  uint64_t seed = 4242;
  for (const LnShape& s : kShapes) {
    const size_t n = size_t(s.M) * s.C;
    auto x = test::randomVector(n, seed++, -2, 2);
    for (auto& v : x) v += s.offset;
    const auto w = test::randomVector(s.C, seed++), b = test::randomVector(s.C, seed++);
    const auto dy = test::randomVector(n, seed++);
    const auto dxInit = test::randomVector(n, seed++), dwInit = test::randomVector(s.C, seed++),
               dbInit = test::randomVector(s.C, seed++);
    std::vector<float> y(n), mean(s.M), rstd(s.M);
    ref::layernormForward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), s.M,
                          s.C);
    auto dx = dxInit, dw = dwInit, db = dbInit;
    ref::layernormBackward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(),
                           mean.data(), rstd.data(), s.M, s.C);
    // The offset enters the mean (and cancels in x - mean, to the mean's f32 error).
    const double xMag = 2.0 + std::fabs(s.offset);
    const double tolY = tol(s.C, maxAbs(y, n) * xMag);
    const double tolDx = tol(s.C, maxAbs(dx, n) * xMag);
    const double tolDw = tol(s.M, maxAbs(dw, s.C) * xMag), tolDb = tol(s.M, maxAbs(db, s.C));
    test::forEachSimdTarget([&] {
      for (int threads : {1, 2}) {
        setThreads(threads);
        SCOPED_TRACE(::testing::Message() << "M=" << s.M << " C=" << s.C << " offset=" << s.offset
                                          << " threads=" << threads);
        auto gy = withGuard(test::poisoned(n)), gm = withGuard(test::poisoned(s.M)),
             gr = withGuard(test::poisoned(s.M));
        cpu::layernormForward(gy.data(), gm.data(), gr.data(), x.data(), w.data(), b.data(), s.M,
                              s.C);
        EXPECT_TRUE(test::allFinite(gy.data(), n));
        EXPECT_LE(test::worstRatio(gy.data(), y.data(), n, tolY, 0), 1.0)
            << "y max diff " << test::maxAbsDiff(gy.data(), y.data(), n);
        EXPECT_LE(test::worstRatio(gm.data(), mean.data(), s.M, tol(s.C, xMag), 0), 1.0);
        EXPECT_LE(test::worstRatio(gr.data(), rstd.data(), s.M, 0, tol(s.C, xMag)), 1.0);
        expectGuard(gy, n);
        expectGuard(gm, s.M);
        expectGuard(gr, s.M);
        // mean / rstd are optional
        auto gy2 = withGuard(test::poisoned(n));
        cpu::layernormForward(gy2.data(), nullptr, nullptr, x.data(), w.data(), b.data(), s.M, s.C);
        EXPECT_LE(test::worstRatio(gy2.data(), y.data(), n, tolY, 0), 1.0);
        expectGuard(gy2, n);

        auto gdx = withGuard(dxInit), gdw = withGuard(dwInit), gdb = withGuard(dbInit);
        cpu::layernormBackward(gdx.data(), gdw.data(), gdb.data(), dy.data(), x.data(), w.data(),
                               mean.data(), rstd.data(), s.M, s.C);
        EXPECT_TRUE(test::allFinite(gdx.data(), n));
        EXPECT_LE(test::worstRatio(gdx.data(), dx.data(), n, tolDx, 0), 1.0)
            << "dx max diff " << test::maxAbsDiff(gdx.data(), dx.data(), n);
        EXPECT_LE(test::worstRatio(gdw.data(), dw.data(), s.C, tolDw, 0), 1.0)
            << "dw max diff " << test::maxAbsDiff(gdw.data(), dw.data(), s.C);
        EXPECT_LE(test::worstRatio(gdb.data(), db.data(), s.C, tolDb, 0), 1.0)
            << "db max diff " << test::maxAbsDiff(gdb.data(), db.data(), s.C);
        expectGuard(gdx, n);
        expectGuard(gdw, s.C);
        expectGuard(gdb, s.C);
      }
    });
  }
  setThreads(0);
}

}  // namespace
}  // namespace ptllm
