// The CUDA backend's canonical f32 ops (kernels/cuda) against the reference (kernels/ref): every
// op over a table of shapes chosen to hit each kernel's tails and dispatch boundaries, outputs
// poisoned with NaN (or set to finite values for (+=) outputs) before the call, guard elements
// after the outputs that must stay untouched, the aliasing ops.h allows, and a whole tiny GPT-2
// (forward, backward, gradient norm, AdamW, KV-cached decode) on CudaOps against RefOps.
// Every test skips, naming the reason, on a machine without a usable GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "kernels/cuda/cuda_device.h"
#include "kernels/ops.h"
#include "model/gpt2.h"
#include "test_util.h"

namespace ptllm {
namespace {

using test::allFinite;
using test::maxAbsDiff;
using test::poisoned;
using test::randomVector;
using test::worstRatio;

constexpr size_t kGuard = 37;
constexpr float kGuardValue = 12345.5f;
constexpr float kEps = std::numeric_limits<float>::epsilon();

class CudaOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const CudaDeviceInfo& info = cudaDeviceInfo();
    if (!info.available) GTEST_SKIP() << "no usable GPU: " << info.reason;
    cuda = makeCudaOps();
  }

  // A device copy of a host vector (with `guard` trailing guard elements).
  Tensor up(const std::vector<float>& host, size_t guard = 0) {
    std::vector<float> h = host;
    h.resize(host.size() + guard, kGuardValue);
    Tensor t = cuda->alloc({int64_t(h.size())});
    cuda->upload(t, h.data());
    return t;
  }
  std::vector<float> down(const Tensor& t) {
    std::vector<float> h(size_t(t.numel()));
    cuda->download(h.data(), t);
    return h;
  }
  // Downloads an output uploaded with kGuard guards, checks them, and drops them.
  std::vector<float> downGuarded(const Tensor& t, const char* what) {
    std::vector<float> h = down(t);
    const size_t n = h.size() - kGuard;
    for (size_t i = n; i < h.size(); ++i) {
      EXPECT_EQ(h[i], kGuardValue) << what << ": write past the end at +" << i - n;
      if (h[i] != kGuardValue) break;
    }
    h.resize(n);
    return h;
  }

  // The last Tq of Tk queries' attention (Tq == Tk: the whole forward; less: the decode and
  // prefill-after-cache forms) on the GPU, outputs poisoned and guarded, against the
  // reference's: finite, and within the attention tolerance (outputs and probabilities). dqkv
  // is qkv on the device. The probabilities go to refAtt and gpuAtt where given (callers check
  // HasFatalFailure() before using them).
  void expectAttentionForward(const std::vector<float>& qkv, const Tensor& dqkv, int B, int Tq,
                              int Tk, int C, int NH, std::vector<float>* refAtt = nullptr,
                              std::vector<float>* gpuAtt = nullptr) {
    std::vector<float> y(size_t(B) * Tq * C), att(size_t(B) * NH * Tq * Tk);
    ref->attentionForward(y.data(), att.data(), qkv.data(), B, Tq, Tk, C, NH);
    Tensor dy = up(poisoned(y.size()), kGuard), datt = up(poisoned(att.size()), kGuard);
    cuda->attentionForward(dy.data(), datt.data(), dqkv.data(), B, Tq, Tk, C, NH);
    const auto gy = downGuarded(dy, "att out"), ga = downGuarded(datt, "att probs");
    ASSERT_TRUE(allFinite(gy.data(), gy.size()));
    ASSERT_TRUE(allFinite(ga.data(), ga.size()));
    EXPECT_LE(worstRatio(gy.data(), y.data(), y.size(), 2e-5, 2e-5), 1.0)
        << "max abs diff " << maxAbsDiff(gy.data(), y.data(), y.size());
    EXPECT_LE(worstRatio(ga.data(), att.data(), att.size(), 2e-6, 2e-5), 1.0)
        << "max abs diff " << maxAbsDiff(ga.data(), att.data(), att.size());
    if (refAtt) *refAtt = std::move(att);
    if (gpuAtt) *gpuAtt = ga;
  }

  std::unique_ptr<Ops> ref = makeRefOps();
  std::unique_ptr<Ops> cuda;
};

// ---- matmuls ----

struct Shape3 {
  int M, K, N;
};
// GEMV (M <= 8) and SGEMM (M > 8) either side of the boundary; 64x64 and 128x128 tile tails;
// K and N with and without the float4 path (multiples of 4 or not); K = 0; K up to 4096; and
// shapes with >= 132 128x128 tiles (the big-tile kernel on an H200's 132 SMs).
const Shape3 kMatmulShapes[] = {
    {1, 1, 1},        {1, 2, 3},        {2, 3, 1},        {4, 31, 32},    {8, 64, 64},
    {8, 65, 7},       {9, 127, 129},    {9, 8, 4},        {31, 128, 127}, {32, 129, 64},
    {33, 257, 31},    {64, 13, 257},    {65, 97, 2},      {127, 256, 65}, {128, 128, 128},
    {129, 31, 96},    {257, 64, 129},   {61, 509, 53},    {1, 4096, 257}, {2, 4096, 67},
    {3, 1031, 1},     {17, 4096, 37},   {1, 1024, 1031},  {4, 300, 2053}, {6, 256, 768},
    {12, 4096, 64},   {300, 200, 50},   {1, 0, 5},        {3, 0, 2},      {20, 0, 9},
    {1537, 67, 1411}, {2304, 36, 1152}, {2048, 64, 1024},
};

enum class MM { kMatmul, kMatmulBias, kAbt, kAbtAcc, kAtb, kAtbAcc };
const char* mmName(MM op) {
  static const char* names[] = {"matmul", "matmul+bias", "abt", "abt+acc", "atb", "atb+acc"};
  return names[int(op)];
}

void runMM(Ops& ops, MM op, float* out, const float* a, const float* b, const float* bias, int M,
           int K, int N) {
  switch (op) {
    case MM::kMatmul:
      return ops.matmul(out, a, b, nullptr, M, K, N);
    case MM::kMatmulBias:
      return ops.matmul(out, a, b, bias, M, K, N);
    case MM::kAbt:
    case MM::kAbtAcc:
      return ops.matmulAbt(out, a, b, M, K, N, op == MM::kAbtAcc);
    case MM::kAtb:
    case MM::kAtbAcc:
      return ops.matmulAtb(out, a, b, M, K, N, op == MM::kAtbAcc);
  }
}

// f32 sums of K products of entries in [-1,1] (rms sqrt(K)/3) against the double reference: a
// few eps * sqrt(K) of that magnitude, x8 for the tails; `extra` is the bias / accumulated-into
// magnitude.
double matmulTolerance(int K, double extra) {
  return 8.0 * kEps * std::sqrt(double(std::max(K, 1))) * (std::sqrt(double(K)) / 3.0 + extra);
}

class CudaMatmul : public CudaOpsTest, public ::testing::WithParamInterface<MM> {};

TEST_P(CudaMatmul, MatchesReference) {
  const MM op = GetParam();
  const bool accumulate = op == MM::kAbtAcc || op == MM::kAtbAcc;
  uint64_t seed = 1000 + 17 * uint64_t(op);
  for (const Shape3& s : kMatmulShapes) {
    SCOPED_TRACE(::testing::Message()
                 << mmName(op) << " M=" << s.M << " K=" << s.K << " N=" << s.N);
    const size_t nOut = size_t(s.M) * s.N;
    // a is [M,K] (or [K,M] for atb), b is [K,N] (or [N,K] for abt): the same element counts.
    const auto a = randomVector(size_t(s.M) * s.K, seed++),
               b = randomVector(size_t(s.K) * s.N, seed++);
    const auto bias = randomVector(size_t(s.N), seed++), init = randomVector(nOut, seed++);
    std::vector<float> want = accumulate ? init : poisoned(nOut);
    runMM(*ref, op, want.data(), a.data(), b.data(), bias.data(), s.M, s.K, s.N);
    Tensor da = up(a), db = up(b), dbias = up(bias),
           dout = up(accumulate ? init : poisoned(nOut), kGuard);
    runMM(*cuda, op, dout.data(), da.data(), db.data(), dbias.data(), s.M, s.K, s.N);
    const auto got = downGuarded(dout, mmName(op));
    ASSERT_TRUE(allFinite(got.data(), nOut));
    const double tol = matmulTolerance(s.K, op == MM::kMatmulBias || accumulate ? 1.0 : 0.0);
    EXPECT_LE(worstRatio(got.data(), want.data(), nOut, tol, 0.0), 1.0)
        << "max abs diff " << maxAbsDiff(got.data(), want.data(), nOut) << " tol " << tol;
  }
}

std::string mmTestName(const ::testing::TestParamInfo<MM>& info) {
  static const char* names[] = {"Matmul",        "MatmulBias", "Abt",
                                "AbtAccumulate", "Atb",        "AtbAccumulate"};
  return names[int(info.param)];
}

INSTANTIATE_TEST_SUITE_P(Ops, CudaMatmul,
                         ::testing::Values(MM::kMatmul, MM::kMatmulBias, MM::kAbt, MM::kAbtAcc,
                                           MM::kAtb, MM::kAtbAcc),
                         mmTestName);

// Operands at an odd float offset (rows not 16-byte aligned although K and N are multiples of
// 4): the scalar-load and scalar-store fallbacks of the SGEMM.
TEST_F(CudaOpsTest, MatmulUnalignedOperands) {
  for (const Shape3& s : {Shape3{64, 64, 64}, Shape3{200, 128, 260}, Shape3{8, 32, 36}}) {
    for (MM op : {MM::kMatmulBias, MM::kAbtAcc, MM::kAtbAcc}) {
      SCOPED_TRACE(::testing::Message()
                   << mmName(op) << " M=" << s.M << " K=" << s.K << " N=" << s.N);
      const bool accumulate = op != MM::kMatmulBias;
      const size_t nOut = size_t(s.M) * s.N;
      auto a = randomVector(size_t(s.M) * s.K + 1, 1), b = randomVector(size_t(s.K) * s.N + 1, 2);
      const auto bias = randomVector(size_t(s.N), 3);
      auto init = randomVector(nOut + 1, 4);  // [0]: the element before the output
      if (!accumulate) std::fill(init.begin() + 1, init.end(), std::nanf(""));
      std::vector<float> want(init.begin() + 1, init.end());
      runMM(*ref, op, want.data(), a.data() + 1, b.data() + 1, bias.data(), s.M, s.K, s.N);
      Tensor da = up(a), db = up(b), dbias = up(bias), dout = up(init, kGuard);
      runMM(*cuda, op, dout.data() + 1, da.data() + 1, db.data() + 1, dbias.data(), s.M, s.K, s.N);
      auto got = downGuarded(dout, mmName(op));
      EXPECT_EQ(got[0], init[0]);  // the element before the output
      EXPECT_LE(worstRatio(got.data() + 1, want.data(), nOut, matmulTolerance(s.K, 1.0), 0.0), 1.0);
    }
  }
}

TEST_F(CudaOpsTest, BiasBackward) {
  uint64_t seed = 50;
  for (auto [M, N] : {std::pair{1, 1}, {3, 7}, {64, 33}, {1000, 5}, {4097, 768}, {9, 2304}}) {
    const auto dout = randomVector(size_t(M) * N, ++seed), init = randomVector(size_t(N), ++seed);
    auto want = init;
    ref->biasBackward(want.data(), dout.data(), M, N);
    Tensor dd = up(dout), db = up(init, kGuard);
    cuda->biasBackward(db.data(), dd.data(), M, N);
    const auto got = downGuarded(db, "dbias");
    // A sum of M values in [-1,1] (rms sqrt(M/3)) in f32 against double.
    EXPECT_LE(worstRatio(got.data(), want.data(), size_t(N), 4 * kEps * M, 1e-6), 1.0)
        << "M=" << M << " N=" << N;
  }
}

// ---- elementwise, normalisation ----

const int64_t kSizes[] = {1, 7, 64, 1000, 100003, 3000017};  // the last: past the grid cap

TEST_F(CudaOpsTest, FillCopyScaleAdd) {
  for (int64_t n : kSizes) {
    SCOPED_TRACE(n);
    const auto a = randomVector(size_t(n), uint64_t(n)),
               b = randomVector(size_t(n), uint64_t(n) + 1);
    Tensor da = up(a), db = up(b), dout = up(poisoned(static_cast<size_t>(n)), kGuard);
    cuda->fill(dout.data(), 2.5f, n);
    auto got = downGuarded(dout, "fill");
    EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](float x) { return x == 2.5f; }));
    cuda->fill(dout.data(), 0.0f, n);
    got = downGuarded(dout, "fill 0");
    EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](float x) { return x == 0.0f; }));
    cuda->copy(dout.data(), da.data(), n);
    EXPECT_EQ(downGuarded(dout, "copy"), a);

    std::vector<float> want(static_cast<size_t>(n));
    ref->add(want.data(), a.data(), b.data(), n);
    cuda->add(dout.data(), da.data(), db.data(), n);
    EXPECT_EQ(downGuarded(dout, "add"), want);  // one f32 rounding: exact
    // out aliasing a, then b.
    cuda->add(da.data(), da.data(), db.data(), n);
    EXPECT_EQ(down(da), want);
    std::vector<float> want2(static_cast<size_t>(n));
    ref->add(want2.data(), want.data(), b.data(), n);
    cuda->add(db.data(), da.data(), db.data(), n);
    EXPECT_EQ(down(db), want2);

    auto s = a;
    ref->scale(s.data(), -0.37f, n);
    Tensor ds = up(a, kGuard);
    cuda->scale(ds.data(), -0.37f, n);
    EXPECT_EQ(downGuarded(ds, "scale"), s);
  }
}

TEST_F(CudaOpsTest, GeluForwardBackwardInPlace) {
  for (int64_t n : kSizes) {
    SCOPED_TRACE(n);
    const auto x = randomVector(size_t(n), uint64_t(n), -6, 6), dy = randomVector(size_t(n), 3);
    std::vector<float> y(static_cast<size_t>(n)), g(static_cast<size_t>(n));
    ref->geluForward(y.data(), x.data(), n);
    ref->geluBackward(g.data(), x.data(), dy.data(), n);
    Tensor dx = up(x), ddy = up(dy), dout = up(poisoned(static_cast<size_t>(n)), kGuard);
    cuda->geluForward(dout.data(), dx.data(), n);
    // f32 tanhf (<= 2 ulp) against double; gelu' amplifies tanh's error by up to ~56 at |x| 6.
    const auto got = downGuarded(dout, "gelu");
    EXPECT_LE(worstRatio(got.data(), y.data(), size_t(n), 2e-6, 2e-5), 1.0);
    cuda->geluBackward(dout.data(), dx.data(), ddy.data(), n);
    const auto gotG = downGuarded(dout, "gelu backward");
    EXPECT_LE(worstRatio(gotG.data(), g.data(), size_t(n), 2e-5, 2e-5), 1.0);
    // In place: din aliasing dout, out aliasing in.
    cuda->geluBackward(ddy.data(), dx.data(), ddy.data(), n);
    EXPECT_EQ(down(ddy), gotG);
    cuda->geluForward(dx.data(), dx.data(), n);
    EXPECT_EQ(down(dx), got);
  }
}

TEST_F(CudaOpsTest, AdamwAndSumSquares) {
  for (int64_t n : kSizes) {
    SCOPED_TRACE(n);
    auto p1 = randomVector(size_t(n), 7), g = randomVector(size_t(n), 8),
         m1 = randomVector(size_t(n), 9, 0, 0.1f), v1 = randomVector(size_t(n), 10, 0, 0.1f);
    Tensor dp = up(p1, kGuard), dg = up(g), dm = up(m1, kGuard), dv = up(v1, kGuard);
    for (int t : {1, 3}) {
      ref->adamw(p1.data(), g.data(), m1.data(), v1.data(), n, 1e-3f, 0.9f, 0.99f, 1e-8f, 0.1f, t);
      cuda->adamw(dp.data(), dg.data(), dm.data(), dv.data(), n, 1e-3f, 0.9f, 0.99f, 1e-8f, 0.1f,
                  t);
    }
    const auto p2 = downGuarded(dp, "p"), m2 = downGuarded(dm, "m"), v2 = downGuarded(dv, "v");
    EXPECT_LE(worstRatio(p2.data(), p1.data(), size_t(n), 1e-7, 1e-6), 1.0);
    EXPECT_LE(worstRatio(m2.data(), m1.data(), size_t(n), 1e-7, 1e-6), 1.0);
    EXPECT_LE(worstRatio(v2.data(), v1.data(), size_t(n), 1e-7, 1e-6), 1.0);
    const double want = ref->sumSquares(g.data(), n), got = cuda->sumSquares(dg.data(), n);
    EXPECT_NEAR(got, want, 1e-11 * want);  // both in double, different orders
  }
  EXPECT_EQ(cuda->sumSquares(nullptr, 0), 0.0);
}

TEST_F(CudaOpsTest, LayerNormForwardBackward) {
  uint64_t seed = 100;
  for (auto [M, C] : {std::pair{1, 4},
                      {7, 12},
                      {10, 16},
                      {99, 32},
                      {128, 64},
                      {129, 48},
                      {64, 768},
                      {5, 1000},
                      {3, 2049},
                      {1000, 33},
                      {2500, 96}}) {
    SCOPED_TRACE(::testing::Message() << "M=" << M << " C=" << C);
    auto x = randomVector(size_t(M) * C, ++seed, -2, 2), w = randomVector(size_t(C), ++seed),
         b = randomVector(size_t(C), ++seed), dy = randomVector(size_t(M) * C, ++seed);
    for (size_t i = 0; i < x.size(); i += 3) x[i] += 1.5f;  // a non-zero mean
    std::vector<float> y(x.size()), mean(static_cast<size_t>(M)), rstd(static_cast<size_t>(M));
    ref->layernormForward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), M, C);
    Tensor dx = up(x), dw = up(w), db = up(b), ddy = up(dy);
    Tensor dyOut = up(poisoned(y.size()), kGuard),
           dMean = up(poisoned(static_cast<size_t>(M)), kGuard),
           dRstd = up(poisoned(static_cast<size_t>(M)), kGuard);
    cuda->layernormForward(dyOut.data(), dMean.data(), dRstd.data(), dx.data(), dw.data(),
                           db.data(), M, C);
    const auto gy = downGuarded(dyOut, "ln out"), gm = downGuarded(dMean, "mean"),
               gr = downGuarded(dRstd, "rstd");
    ASSERT_TRUE(allFinite(gy.data(), gy.size()));
    EXPECT_LE(worstRatio(gy.data(), y.data(), y.size(), 2e-5, 2e-5), 1.0);
    EXPECT_LE(worstRatio(gm.data(), mean.data(), size_t(M), 1e-6, 1e-5), 1.0);
    EXPECT_LE(worstRatio(gr.data(), rstd.data(), size_t(M), 1e-6, 1e-5), 1.0);
    // Without saved statistics (the inference form).
    cuda->layernormForward(dyOut.data(), nullptr, nullptr, dx.data(), dw.data(), db.data(), M, C);
    EXPECT_EQ(downGuarded(dyOut, "ln out, no stats"), gy);

    // Backward accumulates into din, dw, db: start from the same non-zero values; both sides
    // use the reference's saved statistics.
    auto dxr = randomVector(x.size(), ++seed), dwr = randomVector(size_t(C), ++seed),
         dbr = randomVector(size_t(C), ++seed);
    Tensor ddx = up(dxr, kGuard), ddw = up(dwr, kGuard), ddb = up(dbr, kGuard), dm = up(mean),
           dr = up(rstd);
    ref->layernormBackward(dxr.data(), dwr.data(), dbr.data(), dy.data(), x.data(), w.data(),
                           mean.data(), rstd.data(), M, C);
    cuda->layernormBackward(ddx.data(), ddw.data(), ddb.data(), ddy.data(), dx.data(), dw.data(),
                            dm.data(), dr.data(), M, C);
    const auto gdx = downGuarded(ddx, "din"), gdw = downGuarded(ddw, "dw"),
               gdb = downGuarded(ddb, "db");
    EXPECT_LE(worstRatio(gdx.data(), dxr.data(), gdx.size(), 1e-4, 1e-4), 1.0);
    // dw/db sum over M rows: the tolerance grows with M.
    EXPECT_LE(worstRatio(gdw.data(), dwr.data(), size_t(C), 1e-5 * M, 1e-4), 1.0);
    EXPECT_LE(worstRatio(gdb.data(), dbr.data(), size_t(C), 1e-5 * M, 1e-4), 1.0);
  }
}

// ---- attention ----

struct AttShape {
  int B, T, C, NH;
};
// T = 1, 7, 64, 257 (tails of the 16-query and 32-key tiles), 1024; head sizes 4..128,
// odd (5, 15) and C not a multiple of 32.
const AttShape kAttShapes[] = {
    {1, 1, 4, 1},    {1, 7, 12, 3},   {2, 5, 16, 2},    {3, 33, 15, 3},   {2, 64, 64, 4},
    {1, 257, 48, 6}, {2, 17, 256, 2}, {1, 64, 768, 12}, {1, 257, 200, 2}, {1, 1024, 128, 2}};

TEST_F(CudaOpsTest, AttentionForwardBackward) {
  uint64_t seed = 7;
  for (const AttShape& s : kAttShapes) {
    const int B = s.B, T = s.T, C = s.C, NH = s.NH;
    SCOPED_TRACE(::testing::Message() << "B=" << B << " T=" << T << " C=" << C << " NH=" << NH);
    const auto qkv = randomVector(size_t(B) * T * 3 * C, ++seed);
    const Tensor dqkv = up(qkv);
    std::vector<float> att, ga;  // the reference's and the GPU's probabilities
    expectAttentionForward(qkv, dqkv, B, T, T, C, NH, &att, &ga);
    if (HasFatalFailure()) return;
    for (int b = 0; b < B * NH; ++b)  // masked entries exactly 0
      for (int i = 0; i < T; ++i)
        for (int j = i + 1; j < T; ++j) ASSERT_EQ(ga[(size_t(b) * T + i) * T + j], 0.0f);

    // Backward (=) from the reference's saved probabilities.
    const auto dout = randomVector(size_t(B) * T * C, ++seed);
    std::vector<float> dq(qkv.size());
    ref->attentionBackward(dq.data(), dout.data(), qkv.data(), att.data(), B, T, C, NH);
    Tensor ddout = up(dout), drefAtt = up(att), ddq = up(poisoned(qkv.size()), kGuard);
    cuda->attentionBackward(ddq.data(), ddout.data(), dqkv.data(), drefAtt.data(), B, T, C, NH);
    const auto gdq = downGuarded(ddq, "dqkv");
    ASSERT_TRUE(allFinite(gdq.data(), gdq.size()));
    EXPECT_LE(worstRatio(gdq.data(), dq.data(), dq.size(), 1e-4, 1e-3), 1.0)
        << "max abs diff " << maxAbsDiff(gdq.data(), dq.data(), dq.size());

    // Decode / prefill-after-cache form: the last Tq queries over all T keys.
    for (int Tq : {1, 3, 16, 17}) {
      if (Tq >= T) continue;
      SCOPED_TRACE(::testing::Message() << "Tq=" << Tq);
      expectAttentionForward(qkv, dqkv, B, Tq, T, C, NH);
    }
  }
}

// The decode attention (Tq == 1) over long contexts and large scores: either side of a warp's
// 32 keys and the block's 256 threads, up to the 4096 keys its scores keep in shared memory
// (and one past, the general kernel), with the query scaled so that the scores span several
// units (x12: a standard deviation near 4 at head size 64, so most probabilities are far below
// the largest, while the f32 scores' rounding, amplified by exp, stays inside the attention
// tests' tolerance).
TEST_F(CudaOpsTest, AttentionDecodeLongContexts) {
  uint64_t seed = 41;
  struct Case {
    int B, Tk, C, NH;
    float qScale;
  };
  const Case cases[] = {{1, 1, 128, 2, 12.f},    {1, 2, 64, 2, 12.f},    {2, 31, 128, 2, 1.f},
                        {1, 32, 128, 2, 12.f},   {1, 33, 64, 1, 12.f},   {1, 255, 128, 2, 8.f},
                        {1, 256, 128, 2, 12.f},  {2, 257, 64, 2, 12.f},  {1, 511, 128, 2, 1.f},
                        {1, 1000, 128, 2, 12.f}, {1, 4096, 128, 2, 8.f}, {1, 4096, 64, 1, 12.f},
                        {1, 4097, 128, 2, 12.f}};
  for (const Case& c : cases) {
    const int B = c.B, Tk = c.Tk, C = c.C, NH = c.NH;
    SCOPED_TRACE(::testing::Message()
                 << "B=" << B << " Tk=" << Tk << " C=" << C << " NH=" << NH << " q x" << c.qScale);
    auto qkv = randomVector(size_t(B) * Tk * 3 * C, ++seed);
    for (int b = 0; b < B; ++b) {
      float* q = qkv.data() + (size_t(b) * Tk + size_t(Tk - 1)) * 3 * C;  // the query row's q
      for (int i = 0; i < C; ++i) q[i] *= c.qScale;
    }
    expectAttentionForward(qkv, up(qkv), B, 1, Tk, C, NH);
  }
}

// ---- embeddings, loss ----

TEST_F(CudaOpsTest, EmbeddingForwardBackward) {
  uint64_t seed = 300;
  // V small (every token repeated many times), V large (mostly distinct), pos0 > 0.
  for (auto [B, T, C, V, pos0] :
       {std::tuple{1, 1, 4, 1, 0}, {3, 17, 24, 11, 3}, {4, 64, 33, 5, 0}, {2, 100, 64, 50257, 7}}) {
    SCOPED_TRACE(::testing::Message() << "B=" << B << " T=" << T << " C=" << C << " V=" << V);
    Rng rng(++seed);
    std::vector<int32_t> tok(size_t(B) * T);
    for (auto& t : tok) t = int32_t(rng.below(uint64_t(V)));
    const auto wte = randomVector(size_t(V) * C, ++seed),
               wpe = randomVector(size_t(pos0 + T) * C, ++seed);
    std::vector<float> e(size_t(B) * T * C);
    ref->embeddingForward(e.data(), tok.data(), wte.data(), wpe.data(), B, T, C, pos0);
    Tensor dwte = up(wte), dwpe = up(wpe), de = up(poisoned(e.size()), kGuard);
    cuda->embeddingForward(de.data(), tok.data(), dwte.data(), dwpe.data(), B, T, C, pos0);
    EXPECT_EQ(downGuarded(de, "embedding"), e);  // one f32 add: exact

    auto gte = randomVector(wte.size(), ++seed), gpe = randomVector(size_t(T) * C, ++seed);
    const auto dout = randomVector(e.size(), ++seed);
    Tensor dgte = up(gte, kGuard), dgpe = up(gpe, kGuard), ddout = up(dout);
    ref->embeddingBackward(gte.data(), gpe.data(), dout.data(), tok.data(), B, T, C);
    cuda->embeddingBackward(dgte.data(), dgpe.data(), ddout.data(), tok.data(), B, T, C);
    const auto cte = downGuarded(dgte, "dwte"), cpe = downGuarded(dgpe, "dwpe");
    // Sums of up to B*T values in a different order than the reference's running sum.
    const double atol = 4 * kEps * (B * T + 1);
    EXPECT_LE(worstRatio(cte.data(), gte.data(), gte.size(), atol, 1e-6), 1.0);
    EXPECT_LE(worstRatio(cpe.data(), gpe.data(), gpe.size(), atol, 1e-6), 1.0);
  }
}

TEST_F(CudaOpsTest, CrossEntropyInPlaceAndLossOnly) {
  uint64_t seed = 400;
  for (auto [M, V] : {std::pair{1, 1}, {3, 7}, {17, 65}, {50, 1000}, {8, 50257}}) {
    SCOPED_TRACE(::testing::Message() << "M=" << M << " V=" << V);
    Rng rng(++seed);
    std::vector<int32_t> tgt(static_cast<size_t>(M));
    for (auto& t : tgt) t = int32_t(rng.below(uint64_t(V)));
    if (M > 2) tgt[2] = -1;  // ignored
    const auto logits = randomVector(size_t(M) * V, ++seed, -5, 5);
    std::vector<float> loss(static_cast<size_t>(M)), grad(logits.size());
    ref->crossEntropy(loss.data(), grad.data(), logits.data(), tgt.data(), M, V, 0.5f);
    // In place: dlogits aliasing logits (as Gpt2::backward does).
    Tensor dl = up(logits, kGuard), dloss = up(poisoned(static_cast<size_t>(M)), kGuard);
    cuda->crossEntropy(dloss.data(), dl.data(), dl.data(), tgt.data(), M, V, 0.5f);
    const auto gl = downGuarded(dloss, "losses"), gg = downGuarded(dl, "dlogits");
    EXPECT_LE(worstRatio(gl.data(), loss.data(), size_t(M), 1e-5, 1e-5), 1.0);
    EXPECT_LE(worstRatio(gg.data(), grad.data(), grad.size(), 2e-6, 2e-5), 1.0);
    if (M > 2) {
      EXPECT_EQ(gl[2], 0.0f);
    }
    // Loss only (dlogits null): the logits stay as they were.
    Tensor dl2 = up(logits), dloss2 = up(poisoned(static_cast<size_t>(M)), kGuard);
    cuda->crossEntropy(dloss2.data(), nullptr, dl2.data(), tgt.data(), M, V, 0.0f);
    EXPECT_EQ(downGuarded(dloss2, "losses, no grad"), gl);
    EXPECT_EQ(down(dl2), logits);
  }
}

// ---- the whole model ----

ModelConfig smallConfig(int C, int NH, int V) {
  ModelConfig c;
  c.nLayer = 2;
  c.nHead = NH;
  c.nEmbd = C;
  c.blockSize = 16;
  c.vocabSize = V;
  return c;
}

TEST_F(CudaOpsTest, Gpt2TrainingStepMatchesReference) {
  // C = 32 (hs 8) and C = 48 with 3 heads (hs 16, C not a multiple of 32), a larger vocab.
  for (const ModelConfig& c : {smallConfig(32, 4, 13), smallConfig(48, 3, 65)}) {
    SCOPED_TRACE(::testing::Message()
                 << "C=" << c.nEmbd << " NH=" << c.nHead << " V=" << c.vocabSize);
    Gpt2 a(*ref, c), b(*cuda, c);
    a.initRandom(9);
    b.initRandom(9);
    const int B = 3, T = 16;
    std::vector<int32_t> x(B * T), y(B * T);
    Rng rng(1);
    for (auto& t : x) t = int32_t(rng.below(uint64_t(c.vocabSize)));
    for (auto& t : y) t = int32_t(rng.below(uint64_t(c.vocabSize)));
    y[5] = -1;  // an ignored target
    const float la = a.forward(x.data(), y.data(), B, T), lb = b.forward(x.data(), y.data(), B, T);
    EXPECT_NEAR(lb, la, 1e-5 * std::fabs(la));
    const auto logitsA = a.logitsHost(), logitsB = b.logitsHost();
    EXPECT_LE(worstRatio(logitsB.data(), logitsA.data(), logitsA.size(), 1e-5, 1e-4), 1.0);

    a.zeroGrad();
    b.zeroGrad();
    a.backward();
    b.backward();
    std::vector<float> ga(size_t(a.numParams())), gb(ga.size());
    ref->download(ga.data(), a.gradData());
    cuda->download(gb.data(), b.gradData());
    ASSERT_TRUE(allFinite(gb.data(), gb.size()));
    for (const auto& p : a.paramInfos())
      EXPECT_LE(
          worstRatio(gb.data() + p.offset, ga.data() + p.offset, size_t(p.numel()), 1e-5, 1e-3),
          1.0)
          << p.name;

    // The gradient norm (sumSquares, scale), then AdamW from identical gradients so the
    // parameters can be compared tightly (Adam's first steps are ~lr * sign(g)).
    const float na = a.clipGradNorm(1e-3f), nb = b.clipGradNorm(1e-3f);
    EXPECT_NEAR(nb, na, 1e-4 * na);
    ref->download(ga.data(), a.gradData());
    cuda->upload(b.gradData(), ga.data());
    for (int step = 0; step < 2; ++step) {
      a.adamwStep(1e-3f, 0.9f, 0.99f, 1e-8f, 0.1f);
      b.adamwStep(1e-3f, 0.9f, 0.99f, 1e-8f, 0.1f);
    }
    std::vector<float> pa(ga.size()), pb(ga.size());
    ref->download(pa.data(), a.paramData());
    cuda->download(pb.data(), b.paramData());
    EXPECT_LE(worstRatio(pb.data(), pa.data(), pa.size(), 1e-7, 1e-6), 1.0);
    // And the updated model still agrees.
    const float la2 = a.forward(x.data(), y.data(), B, T),
                lb2 = b.forward(x.data(), y.data(), B, T);
    EXPECT_NEAR(lb2, la2, 1e-5 * std::fabs(la2));
  }
}

TEST_F(CudaOpsTest, Gpt2KvCacheDecodeMatchesFullForward) {
  const ModelConfig c = smallConfig(48, 3, 17);
  Gpt2 m(*cuda, c), r(*ref, c);
  m.initRandom(4);
  r.initRandom(4);
  std::vector<int32_t> seq = {1, 5, 2, 8, 0, 3, 3, 7, 6, 4, 2, 1, 16, 9, 11, 10};
  m.forward(seq.data(), nullptr, 1, 16);
  r.forward(seq.data(), nullptr, 1, 16);
  const auto full = m.logitsHost(), fullRef = r.logitsHost();
  EXPECT_LE(worstRatio(full.data(), fullRef.data(), full.size(), 1e-5, 1e-4), 1.0);
  const int V = c.vocabSize;
  for (int prefill : {1, 5}) {
    m.resetCache();
    std::vector<float> logits(static_cast<size_t>(V));
    m.forwardCached(seq.data(), prefill, logits.data());
    EXPECT_LE(worstRatio(logits.data(), full.data() + (prefill - 1) * V, size_t(V), 1e-5, 1e-4),
              1.0);
    for (int t = prefill; t < 16; ++t) {
      m.forwardCached(seq.data() + t, 1, logits.data());
      EXPECT_LE(worstRatio(logits.data(), full.data() + t * V, size_t(V), 1e-5, 1e-4), 1.0)
          << "position " << t << " prefill " << prefill;
    }
  }
}

// greedyAdvance picks std::max_element's token (the first largest; a NaN wins only at index
// 0), writes it at tokens[pos] and moves the step on: ties, NaNs, infinities, V = 1, V past
// the block's threads, a large vocabulary. Unwritten tokens stay poisoned.
TEST_F(CudaOpsTest, GreedyAdvancePicksWhatMaxElementPicks) {
  const float nan = std::nanf(""), inf = INFINITY;
  std::vector<std::vector<float>> cases = {
      {0.5f},     {1, 3, 3, 2},     {nan, 5, 7}, {4, nan, 7, nan, 7}, {-inf, -inf, -inf},
      {nan, nan}, {2, inf, 1, inf},
  };
  for (int V : {255, 256, 257, 513, 50257}) {
    cases.push_back(test::randomVector(size_t(V), uint64_t(V)));
    cases.back()[size_t(V) / 3] = 9.f;  // a tie far apart: the first wins
    cases.back()[size_t(V) - 1] = 9.f;
  }
  auto ids = cuda->allocBytes(8 * sizeof(int32_t));
  auto step = cuda->allocBytes(2 * sizeof(int32_t));
  for (const auto& logits : cases) {
    const int V = int(logits.size());
    SCOPED_TRACE(::testing::Message() << "V=" << V << " logits[0]=" << logits[0]);
    const Tensor dl = up(logits);
    const int pos = 3;
    std::vector<int32_t> poison(8, -7);
    Tensor poisonT = cuda->alloc({8});
    cuda->upload(poisonT, reinterpret_cast<const float*>(poison.data()));
    cuda->copy(static_cast<float*>(ids->ptr), poisonT.data(), 8);
    cuda->setDecodeStep(static_cast<int32_t*>(step->ptr), 42, pos);
    cuda->greedyAdvance(static_cast<int32_t*>(step->ptr), static_cast<int32_t*>(ids->ptr),
                        dl.data(), V);
    std::vector<int32_t> got(8), st(2);
    cuda->downloadIds(got.data(), static_cast<int32_t*>(ids->ptr), 8);
    cuda->downloadIds(st.data(), static_cast<int32_t*>(step->ptr), 2);
    const int want = int(std::max_element(logits.begin(), logits.end()) - logits.begin());
    for (int i = 0; i < 8; ++i) EXPECT_EQ(got[size_t(i)], i == pos ? want : -7) << "slot " << i;
    EXPECT_EQ(st[0], want);
    EXPECT_EQ(st[1], pos + 1);
  }
}

TEST(CudaOpsAvailability, MakeCudaOpsThrowsWithTheReasonWithoutAGpu) {
  const CudaDeviceInfo& info = cudaDeviceInfo();
  if (info.available) GTEST_SKIP() << "a GPU is available: " << info.summary();
  try {
    makeCudaOps();
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(info.reason), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace ptllm
