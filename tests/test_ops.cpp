// Every op of every backend against the reference (kernels/ref), over a table of shapes, with
// outputs poisoned first; and every op's backward against central finite differences.
#include <gtest/gtest.h>

#include <functional>
#include <memory>

#include "core/rng.h"
#include "core/thread_pool.h"
#include "kernels/ops.h"
#include "test_util.h"

namespace ptllm {
namespace {

using test::allFinite;
using test::poisoned;
using test::randomVector;
using test::worstRatio;

// Tolerance of the CPU backend's f32 ops against the double-accumulating reference: a few ulps
// of f32 times the length of the sums involved (rows of C <= 256 here).
constexpr double kAtol = 2e-5, kRtol = 2e-5;

struct Shape4 {
  int B, T, C, NH;
};
const Shape4 kShapes[] = {{1, 1, 4, 1},   {1, 7, 12, 3},  {2, 5, 16, 2},
                          {3, 33, 32, 4}, {2, 64, 64, 4}, {1, 129, 48, 6}};

class OpsVsRef : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { setThreads(GetParam()); }
  void TearDown() override { setThreads(0); }
  std::unique_ptr<Ops> ref = makeRefOps();
  std::unique_ptr<Ops> cpu = makeCpuOps();
};

TEST_P(OpsVsRef, LayerNormForwardBackward) {
  uint64_t seed = 100;
  for (auto s : kShapes) {
    const int M = s.B * s.T, C = s.C;
    auto x = randomVector(size_t(M) * C, ++seed, -2, 2), w = randomVector(C, ++seed),
         b = randomVector(C, ++seed), dy = randomVector(size_t(M) * C, ++seed);
    auto yr = poisoned(x.size()), yc = poisoned(x.size());
    auto mr = poisoned(M), mc = poisoned(M), rr = poisoned(M), rc = poisoned(M);
    ref->layernormForward(yr.data(), mr.data(), rr.data(), x.data(), w.data(), b.data(), M, C);
    cpu->layernormForward(yc.data(), mc.data(), rc.data(), x.data(), w.data(), b.data(), M, C);
    ASSERT_TRUE(allFinite(yc.data(), yc.size()));
    EXPECT_LE(worstRatio(yc.data(), yr.data(), yc.size(), kAtol, kRtol), 1.0)
        << "M=" << M << " C=" << C;
    EXPECT_LE(worstRatio(rc.data(), rr.data(), M, kAtol, kRtol), 1.0);
    // Backward accumulates into its outputs: start from the same non-zero values.
    auto dxr = randomVector(x.size(), ++seed), dwr = randomVector(C, ++seed),
         dbr = randomVector(C, ++seed);
    auto dxc = dxr, dwc = dwr, dbc = dbr;
    ref->layernormBackward(dxr.data(), dwr.data(), dbr.data(), dy.data(), x.data(), w.data(),
                           mr.data(), rr.data(), M, C);
    cpu->layernormBackward(dxc.data(), dwc.data(), dbc.data(), dy.data(), x.data(), w.data(),
                           mr.data(), rr.data(), M, C);
    EXPECT_LE(worstRatio(dxc.data(), dxr.data(), dxc.size(), 1e-4, 1e-4), 1.0);
    // dw/db sum over M rows: the tolerance grows with M.
    EXPECT_LE(worstRatio(dwc.data(), dwr.data(), C, 1e-5 * M, 1e-4), 1.0);
    EXPECT_LE(worstRatio(dbc.data(), dbr.data(), C, 1e-5 * M, 1e-4), 1.0);
  }
}

TEST_P(OpsVsRef, GeluForwardBackward) {
  for (int64_t n : {1, 7, 64, 1000, 100003}) {
    auto x = randomVector(size_t(n), uint64_t(n), -6, 6), dy = randomVector(size_t(n), 3);
    auto yr = poisoned(size_t(n)), yc = poisoned(size_t(n));
    ref->geluForward(yr.data(), x.data(), n);
    cpu->geluForward(yc.data(), x.data(), n);
    EXPECT_LE(worstRatio(yc.data(), yr.data(), size_t(n), 1e-6, 1e-5), 1.0) << n;
    auto gr = poisoned(size_t(n)), gc = poisoned(size_t(n));
    ref->geluBackward(gr.data(), x.data(), dy.data(), n);
    cpu->geluBackward(gc.data(), x.data(), dy.data(), n);
    // gelu' contains x * (1 - tanh^2 u) * sqrt(2/pi) (1 + 0.134 x^2): an error of a few ulp in
    // the vector tanh (~2e-7) is amplified by 2|x| * 0.8 * (1 + 0.134 x^2) <= 56 at |x| <= 6.
    EXPECT_LE(worstRatio(gc.data(), gr.data(), size_t(n), 1.2e-5, 1e-5), 1.0) << n;
  }
}

TEST_P(OpsVsRef, AttentionForwardBackward) {
  uint64_t seed = 7;
  for (auto s : kShapes) {
    const int B = s.B, T = s.T, C = s.C, NH = s.NH;
    auto qkv = randomVector(size_t(B) * T * 3 * C, ++seed);
    auto yr = poisoned(size_t(B) * T * C), yc = poisoned(yr.size());
    auto ar = poisoned(size_t(B) * NH * T * T), ac = poisoned(ar.size());
    ref->attentionForward(yr.data(), ar.data(), qkv.data(), B, T, T, C, NH);
    cpu->attentionForward(yc.data(), ac.data(), qkv.data(), B, T, T, C, NH);
    ASSERT_TRUE(allFinite(yc.data(), yc.size()));
    ASSERT_TRUE(allFinite(ac.data(), ac.size()));
    EXPECT_LE(worstRatio(yc.data(), yr.data(), yc.size(), kAtol, kRtol), 1.0) << T << " " << C;
    EXPECT_LE(worstRatio(ac.data(), ar.data(), ac.size(), kAtol, kRtol), 1.0);
    auto dy = randomVector(yr.size(), ++seed);
    auto dr = poisoned(qkv.size()), dc = poisoned(qkv.size());
    ref->attentionBackward(dr.data(), dy.data(), qkv.data(), ar.data(), B, T, C, NH);
    cpu->attentionBackward(dc.data(), dy.data(), qkv.data(), ar.data(), B, T, C, NH);
    ASSERT_TRUE(allFinite(dc.data(), dc.size()));
    EXPECT_LE(worstRatio(dc.data(), dr.data(), dc.size(), 1e-4, 1e-4), 1.0) << T << " " << C;
    // Decode form: the last Tq queries over Tk keys equal the tail of the full computation.
    for (int Tq : {1, 3}) {
      if (Tq > T) continue;
      auto yq = poisoned(size_t(B) * Tq * C), aq = poisoned(size_t(B) * NH * Tq * T);
      cpu->attentionForward(yq.data(), aq.data(), qkv.data(), B, Tq, T, C, NH);
      for (int b = 0; b < B; ++b)
        EXPECT_LE(
            worstRatio(yq.data() + size_t(b) * Tq * C, yr.data() + (size_t(b) * T + T - Tq) * C,
                       size_t(Tq) * C, kAtol, kRtol),
            1.0);
    }
  }
}

TEST_P(OpsVsRef, EmbeddingCrossEntropyAdamw) {
  const int B = 3, T = 17, C = 24, V = 11;
  Rng rng(5);
  std::vector<int32_t> tok(B * T), tgt(B * T);
  for (auto& t : tok) t = int32_t(rng.below(V));
  for (auto& t : tgt) t = int32_t(rng.below(V));
  tgt[4] = -1;  // ignored position
  auto wte = randomVector(V * C, 1), wpe = randomVector(32 * C, 2);
  auto er = poisoned(B * T * C), ec = poisoned(B * T * C);
  ref->embeddingForward(er.data(), tok.data(), wte.data(), wpe.data(), B, T, C, 3);
  cpu->embeddingForward(ec.data(), tok.data(), wte.data(), wpe.data(), B, T, C, 3);
  EXPECT_EQ(worstRatio(ec.data(), er.data(), er.size(), 0, 0), 0.0);
  auto dwr = randomVector(V * C, 3), dpr = randomVector(T * C, 4);
  auto dwc = dwr, dpc = dpr;
  auto dout = randomVector(B * T * C, 5);
  ref->embeddingBackward(dwr.data(), dpr.data(), dout.data(), tok.data(), B, T, C);
  cpu->embeddingBackward(dwc.data(), dpc.data(), dout.data(), tok.data(), B, T, C);
  EXPECT_LE(worstRatio(dwc.data(), dwr.data(), dwr.size(), 1e-6, 1e-6), 1.0);
  EXPECT_LE(worstRatio(dpc.data(), dpr.data(), dpr.size(), 1e-6, 1e-6), 1.0);

  auto logits = randomVector(B * T * V, 6, -5, 5);
  auto lr_ = poisoned(B * T), lc = poisoned(B * T), gr = poisoned(logits.size());
  auto gc = logits;  // in place on the CPU backend
  ref->crossEntropy(lr_.data(), gr.data(), logits.data(), tgt.data(), B * T, V, 0.5f);
  cpu->crossEntropy(lc.data(), gc.data(), gc.data(), tgt.data(), B * T, V, 0.5f);
  EXPECT_LE(worstRatio(lc.data(), lr_.data(), lc.size(), 1e-5, 1e-5), 1.0);
  EXPECT_LE(worstRatio(gc.data(), gr.data(), gc.size(), 1e-6, 1e-5), 1.0);
  EXPECT_EQ(lc[4], 0.0f);

  auto p1 = randomVector(1001, 7), g = randomVector(1001, 8), m1 = randomVector(1001, 9, 0, 0.1f),
       v1 = randomVector(1001, 10, 0, 0.1f);
  auto p2 = p1, m2 = m1, v2 = v1;
  ref->adamw(p1.data(), g.data(), m1.data(), v1.data(), 1001, 1e-3f, 0.9f, 0.99f, 1e-8f, 0.1f, 3);
  cpu->adamw(p2.data(), g.data(), m2.data(), v2.data(), 1001, 1e-3f, 0.9f, 0.99f, 1e-8f, 0.1f, 3);
  EXPECT_LE(worstRatio(p2.data(), p1.data(), 1001, 1e-7, 1e-6), 1.0);
  EXPECT_LE(worstRatio(m2.data(), m1.data(), 1001, 1e-7, 1e-6), 1.0);
  EXPECT_NEAR(cpu->sumSquares(g.data(), 1001), ref->sumSquares(g.data(), 1001), 1e-9);
}

INSTANTIATE_TEST_SUITE_P(Threads, OpsVsRef, ::testing::Values(1, 2));

// ---- backward against central finite differences, in double on the reference ops ----

// L(x) = sum_i r_i * f(x)_i for fixed random r; dL/dx from the op's backward vs
// (L(x + h e_j) - L(x - h e_j)) / 2h. The reference sums in double, so h = 1e-3 leaves
// FD error ~ h^2 * f''' plus f32 rounding ~1e-7/h.
double weightedSum(const std::vector<float>& y, const std::vector<float>& r) {
  double s = 0;
  for (size_t i = 0; i < y.size(); ++i) s += double(y[i]) * r[i];
  return s;
}

void expectGradMatches(const std::function<double(const std::vector<float>&)>& loss,
                       std::vector<float> x, const std::vector<float>& analytic, const char* what,
                       double h = 1e-3, double tol = 2e-3) {
  ASSERT_EQ(x.size(), analytic.size());
  for (size_t j = 0; j < x.size(); ++j) {
    const float x0 = x[j];
    x[j] = x0 + float(h);
    const double lp = loss(x);
    x[j] = x0 - float(h);
    const double lm = loss(x);
    x[j] = x0;
    const double fd = (lp - lm) / (2 * h);
    EXPECT_NEAR(analytic[j], fd, tol * (1 + std::fabs(fd))) << what << " index " << j;
  }
}

TEST(FiniteDifferences, Linear) {
  auto ops = makeRefOps();
  const int M = 3, K = 5, N = 4;
  auto x = randomVector(M * K, 1), w = randomVector(K * N, 2), b = randomVector(N, 3),
       r = randomVector(M * N, 4);
  auto fwd = [&](const std::vector<float>& xx, const std::vector<float>& ww,
                 const std::vector<float>& bb) {
    std::vector<float> y(M * N);
    ops->matmul(y.data(), xx.data(), ww.data(), bb.data(), M, K, N);
    return weightedSum(y, r);
  };
  std::vector<float> dx(M * K), dw(K * N, 0.0f), db(N, 0.0f);
  ops->matmulAbt(dx.data(), r.data(), w.data(), M, N, K, false);
  ops->matmulAtb(dw.data(), x.data(), r.data(), K, M, N, true);
  ops->biasBackward(db.data(), r.data(), M, N);
  expectGradMatches([&](const auto& v) { return fwd(v, w, b); }, x, dx, "dx");
  expectGradMatches([&](const auto& v) { return fwd(x, v, b); }, w, dw, "dw");
  expectGradMatches([&](const auto& v) { return fwd(x, w, v); }, b, db, "db");
}

TEST(FiniteDifferences, LayerNorm) {
  auto ops = makeRefOps();
  const int M = 3, C = 6;
  auto x = randomVector(M * C, 1, -2, 2), w = randomVector(C, 2), b = randomVector(C, 3),
       r = randomVector(M * C, 4);
  auto fwd = [&](const std::vector<float>& xx, const std::vector<float>& ww,
                 const std::vector<float>& bb) {
    std::vector<float> y(M * C);
    ops->layernormForward(y.data(), nullptr, nullptr, xx.data(), ww.data(), bb.data(), M, C);
    return weightedSum(y, r);
  };
  std::vector<float> y(M * C), mean(M), rstd(M), dx(M * C, 0.0f), dw(C, 0.0f), db(C, 0.0f);
  ops->layernormForward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), M, C);
  ops->layernormBackward(dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(), mean.data(),
                         rstd.data(), M, C);
  expectGradMatches([&](const auto& v) { return fwd(v, w, b); }, x, dx, "dx");
  expectGradMatches([&](const auto& v) { return fwd(x, v, b); }, w, dw, "dw");
  expectGradMatches([&](const auto& v) { return fwd(x, w, v); }, b, db, "db");
}

TEST(FiniteDifferences, Gelu) {
  auto ops = makeRefOps();
  auto x = randomVector(40, 1, -4, 4), r = randomVector(40, 2);
  std::vector<float> dx(40);
  ops->geluBackward(dx.data(), x.data(), r.data(), 40);
  expectGradMatches(
      [&](const auto& v) {
        std::vector<float> y(40);
        ops->geluForward(y.data(), v.data(), 40);
        return weightedSum(y, r);
      },
      x, dx, "dx");
}

TEST(FiniteDifferences, Attention) {
  auto ops = makeRefOps();
  const int B = 2, T = 4, C = 6, NH = 2;
  auto qkv = randomVector(B * T * 3 * C, 1), r = randomVector(B * T * C, 2);
  std::vector<float> y(B * T * C), att(B * NH * T * T), dqkv(qkv.size());
  ops->attentionForward(y.data(), att.data(), qkv.data(), B, T, T, C, NH);
  ops->attentionBackward(dqkv.data(), r.data(), qkv.data(), att.data(), B, T, C, NH);
  expectGradMatches(
      [&](const auto& v) {
        std::vector<float> yy(B * T * C), aa(att.size());
        ops->attentionForward(yy.data(), aa.data(), v.data(), B, T, T, C, NH);
        return weightedSum(yy, r);
      },
      qkv, dqkv, "dqkv");
}

TEST(FiniteDifferences, EmbeddingAndCrossEntropy) {
  auto ops = makeRefOps();
  const int B = 2, T = 3, C = 4, V = 5;
  std::vector<int32_t> tok = {0, 3, 3, 1, 4, 0}, tgt = {1, 2, -1, 0, 4, 3};
  auto wte = randomVector(V * C, 1), wpe = randomVector(T * C, 2), r = randomVector(B * T * C, 3);
  std::vector<float> dwte(V * C, 0.0f), dwpe(T * C, 0.0f);
  ops->embeddingBackward(dwte.data(), dwpe.data(), r.data(), tok.data(), B, T, C);
  auto emb = [&](const std::vector<float>& te, const std::vector<float>& pe) {
    std::vector<float> y(B * T * C);
    ops->embeddingForward(y.data(), tok.data(), te.data(), pe.data(), B, T, C, 0);
    return weightedSum(y, r);
  };
  expectGradMatches([&](const auto& v) { return emb(v, wpe); }, wte, dwte, "dwte");
  expectGradMatches([&](const auto& v) { return emb(wte, v); }, wpe, dwpe, "dwpe");

  auto logits = randomVector(B * T * V, 4, -3, 3);
  std::vector<float> losses(B * T), dlogits(logits.size());
  ops->crossEntropy(losses.data(), dlogits.data(), logits.data(), tgt.data(), B * T, V, 1.0f);
  expectGradMatches(
      [&](const auto& v) {
        std::vector<float> l(B * T);
        ops->crossEntropy(l.data(), nullptr, v.data(), tgt.data(), B * T, V, 1.0f);
        double s = 0;
        for (float x : l) s += x;
        return s;
      },
      logits, dlogits, "dlogits");
}

}  // namespace
}  // namespace ptllm
