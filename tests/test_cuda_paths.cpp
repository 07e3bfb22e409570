// The CUDA gated paths: each kernel against the f32 reference over a shape table (exactly, on
// the weights it claims to store, and within the spec's gate on the raw weights); the gates
// pass or fail as on the CPU, the test-only broken pack included; the registry's CUDA table.
// Every GPU test skips (not fails) on a machine without a usable GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "gate/capabilities.h"
#include "gate/gate.h"
#include "gate/metric.h"
#include "gate/paths.h"
#include "kernels/cuda/cuda_device.h"
#include "kernels/cuda/cuda_paths.h"
#include "kernels/ops.h"
#include "kernels/registry.h"
#include "test_util.h"

namespace ptllm {
namespace {

TEST(CudaRegistry, DeclaresEveryPathOfTheIssue) {
  const std::vector<PathEntry> paths = cudaPaths();
  if (!cudaDeviceInfo().built) {
    EXPECT_TRUE(paths.empty());  // the stub build
    GTEST_SKIP() << cudaDeviceInfo().reason;
  }
  std::vector<std::string> names;
  for (const auto& e : paths) {
    names.push_back(e.name);
    EXPECT_EQ(e.device, Device::CUDA);
    EXPECT_FALSE(e.pill.empty());
    ASSERT_FALSE(e.gateShapes.empty());
    EXPECT_EQ(e.gateShapes[0].M, 64);  // the spec's shape first
    EXPECT_EQ(e.gateShapes[0].K, 128);
    EXPECT_EQ(e.gateShapes[0].N, 128);
    EXPECT_EQ(e.gateProbes.size(), 4u);
    EXPECT_DOUBLE_EQ(e.thresholds.meanRel, 0.005);  // the spec's thresholds, never looser
    EXPECT_DOUBLE_EQ(e.thresholds.maxAbsOfMeanRef, 0.01);
  }
  EXPECT_EQ(names, (std::vector<std::string>{"f16-storage", "bf16-storage", "tensor-core-f16",
                                             "cublaslt", "fp8-e4m3"}));
  // pathsFor keeps the backends apart: a CPU PathSet never lists a CUDA entry.
  for (const auto& e : pathsFor(Device::CPU)) EXPECT_EQ(e.device, Device::CPU);
}

TEST(CudaDetection, ReportsAReasonWhenUnavailable) {
  const CudaDeviceInfo& d = cudaDeviceInfo();
  if (d.available) {
    EXPECT_FALSE(d.name.empty());
    EXPECT_GT(d.multiprocessors, 0);
    EXPECT_TRUE(detectCapabilities().has("cuda"));
  } else {
    EXPECT_FALSE(d.reason.empty());
    EXPECT_FALSE(detectCapabilities().has("cuda"));
    EXPECT_THROW(makeCudaOps(), Error);
  }
  EXPECT_FALSE(d.summary().empty());
}

class CudaPaths : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cudaDeviceInfo().available) GTEST_SKIP() << cudaDeviceInfo().reason;
    ops = makeCudaOps();
    ref = makeRefOps();
  }
  // in[M,K] and w[K,N] through `e` on the GPU (output poisoned first); host result.
  std::vector<float> runPath(const PathEntry& e, const std::vector<float>& in,
                             const std::vector<float>& w, const std::vector<float>& bias, int M,
                             int K, int N, bool* eligible = nullptr) {
    Tensor dIn = ops->alloc({M, K}), dW = ops->alloc({K, N}), dB = ops->alloc({N}),
           dOut = ops->alloc({M, N});
    ops->upload(dIn, in.data());
    ops->upload(dW, w.data());
    ops->upload(dB, bias.data());
    ops->fill(dOut.data(), std::nanf(""), dOut.numel());
    auto packed = ops->allocBytes(e.packedBytes(K, N));
    const bool ok = e.prepare(packed->ptr, dW.data(), K, N);
    if (eligible) *eligible = ok;
    std::vector<float> out(size_t(M) * N);
    if (!ok) return out;
    e.dispatch(dOut.data(), dIn.data(), packed->ptr, bias.empty() ? nullptr : dB.data(), M, K, N);
    ops->download(out.data(), dOut);
    return out;
  }
  std::vector<float> reference(const std::vector<float>& in, const std::vector<float>& w,
                               const std::vector<float>& bias, int M, int K, int N) {
    std::vector<float> out(size_t(M) * N);
    ref->matmul(out.data(), in.data(), w.data(), bias.data(), M, K, N);
    return out;
  }
  std::unique_ptr<Ops> ops, ref;
};

const PathEntry& cudaEntry(std::string_view name) {
  for (const auto& e : registeredPaths())
    if (e.device == Device::CUDA && e.name == name) return e;
  throw Error("no CUDA path " + std::string(name));
}

struct Shape {
  int M, K, N;
};
// 1, odd, primes, GEMV (M <= 8) and tiled (M > 8) kernels, K up to 4096, K not a multiple of
// the 64-element padding, N not a multiple of a warp's columns or the 128-wide tensor tiles.
const std::vector<Shape> kShapes = {
    {1, 1, 1},    {1, 7, 3},      {2, 64, 61},     {3, 127, 130},  {5, 256, 768},   {8, 1031, 17},
    {9, 33, 257}, {64, 128, 128}, {67, 1000, 131}, {1, 4096, 512}, {130, 4096, 96}, {257, 96, 300}};

// The weights a storage format claims to hold, rounded on the host.
float roundF16(float x) {
  return f16ToF32(f32ToF16(x));
}
float roundBf16(float x) {
  return bf16ToF32(f32ToBf16(x));
}

// Exact level: the path equals the f32 reference run on the weights it stores (rounded on the
// host), up to f32 summation order — any indexing, layout or tail bug shows here.
TEST_F(CudaPaths, StorageKernelsEqualTheReferenceOnTheStoredWeights) {
  uint64_t seed = 100;
  for (const char* name : {"f16-storage", "bf16-storage"}) {
    const PathEntry& e = cudaEntry(name);
    for (const Shape& s : kShapes) {
      SCOPED_TRACE(::testing::Message() << name << " " << s.M << "x" << s.K << "x" << s.N);
      const auto in = test::randomVector(size_t(s.M) * s.K, ++seed);
      auto w = test::randomVector(size_t(s.K) * s.N, ++seed, -0.2f, 0.2f);
      const auto bias = test::randomVector(size_t(s.N), ++seed);
      bool ok = false;
      const auto got = runPath(e, in, w, bias, s.M, s.K, s.N, &ok);
      ASSERT_TRUE(ok);
      for (float& x : w) x = std::string(name) == "f16-storage" ? roundF16(x) : roundBf16(x);
      const auto want = reference(in, w, bias, s.M, s.K, s.N);
      ASSERT_TRUE(test::allFinite(got.data(), got.size()));
      EXPECT_LT(test::worstRatio(got.data(), want.data(), got.size(), 1e-5 * std::sqrt(s.K), 1e-5),
                1.0);
    }
  }
}

// The tensor-core paths round activations (row-scaled) and weights to f16: equal to the
// reference on both rounded operands, up to summation order.
TEST_F(CudaPaths, TensorCoreKernelsEqualTheReferenceOnF16Operands) {
  uint64_t seed = 200;
  for (const char* name : {"tensor-core-f16", "cublaslt"}) {
    const PathEntry& e = cudaEntry(name);
    for (const Shape& s : kShapes) {
      SCOPED_TRACE(::testing::Message() << name << " " << s.M << "x" << s.K << "x" << s.N);
      // Power-of-two-friendly magnitudes: the row scale is exact, so rounding the unscaled
      // values to f16 on the host is what the kernel does.
      auto in = test::randomVector(size_t(s.M) * s.K, ++seed);
      auto w = test::randomVector(size_t(s.K) * s.N, ++seed, -0.2f, 0.2f);
      const auto bias = test::randomVector(size_t(s.N), ++seed);
      const auto got = runPath(e, in, w, bias, s.M, s.K, s.N);
      for (float& x : w) x = roundF16(x);
      for (int m = 0; m < s.M; ++m) {  // the kernel's row scale: max |row| into [256, 512)
        float amax = 0;
        for (int k = 0; k < s.K; ++k) amax = std::max(amax, std::fabs(in[size_t(m) * s.K + k]));
        const int ex = amax > 0 ? std::ilogb(amax) - 8 : 0;
        for (int k = 0; k < s.K; ++k) {
          float& x = in[size_t(m) * s.K + k];
          x = std::ldexp(roundF16(std::ldexp(x, -ex)), ex);
        }
      }
      const auto want = reference(in, w, bias, s.M, s.K, s.N);
      ASSERT_TRUE(test::allFinite(got.data(), got.size()));
      EXPECT_LT(test::worstRatio(got.data(), want.data(), got.size(), 1e-5 * std::sqrt(s.K), 1e-5),
                1.0);
    }
  }
}

// e4m3 on the host: 3 mantissa bits, exponent bias 7, subnormal spacing 2^-9, saturating at
// 448; round to nearest even (the pack converts with __NV_SATFINITE).
float roundE4m3(float x) {
  const float a = std::fabs(x);
  if (a == 0.f) return x;
  const int e = std::max(std::ilogb(a), -6);
  const float ulp = std::ldexp(1.f, e - 3);
  return std::copysign(std::min(std::nearbyint(a / ulp) * ulp, 448.f), x);
}

// fp8 stores q = e4m3(w / scale[n]) with scale[n] = max_k |w[k,n]| / 448 and multiplies the
// scale back after the dot product: equal to the reference on q * scale, up to summation order.
TEST_F(CudaPaths, Fp8KernelEqualsTheReferenceOnTheStoredWeights) {
  const PathEntry& e = cudaEntry("fp8-e4m3");
  uint64_t seed = 300;
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(::testing::Message() << s.M << "x" << s.K << "x" << s.N);
    const auto in = test::randomVector(size_t(s.M) * s.K, ++seed);
    auto w = test::randomVector(size_t(s.K) * s.N, ++seed, -0.2f, 0.2f);
    const auto bias = test::randomVector(size_t(s.N), ++seed);
    const auto got = runPath(e, in, w, bias, s.M, s.K, s.N);
    for (int n = 0; n < s.N; ++n) {
      float amax = 0;
      for (int k = 0; k < s.K; ++k) amax = std::max(amax, std::fabs(w[size_t(k) * s.N + n]));
      const float scale = amax > 0 ? amax / 448.f : 1.f;
      for (int k = 0; k < s.K; ++k) {
        float& x = w[size_t(k) * s.N + n];
        x = roundE4m3(x / scale) * scale;
      }
    }
    const auto want = reference(in, w, bias, s.M, s.K, s.N);
    ASSERT_TRUE(test::allFinite(got.data(), got.size()));
    EXPECT_LT(test::worstRatio(got.data(), want.data(), got.size(), 1e-5 * std::sqrt(s.K), 1e-4),
              1.0);
  }
}

// The benchmark's M = 1 GEMV schedules compute matmulF16's arithmetic: bit for bit equal to it
// (outputs poisoned first), over K and N tails, K past one round of loads per lane, and N not a
// multiple of any block's columns.
TEST_F(CudaPaths, GemvVariantsEqualMatmulF16BitForBit) {
  ASSERT_GE(cuda::gemvF16VariantCount(), 2);
  uint64_t seed = 400;
  for (auto [K, N] : {std::pair{1, 1},
                      {7, 3},
                      {64, 61},
                      {256, 768},
                      {1024, 256},
                      {1031, 17},
                      {4096, 512},
                      {16384, 67},
                      {33, 2053}}) {
    SCOPED_TRACE(::testing::Message() << "K=" << K << " N=" << N);
    const auto in = test::randomVector(size_t(K), ++seed);
    const auto w = test::randomVector(size_t(K) * N, ++seed, -0.2f, 0.2f);
    const auto bias = test::randomVector(size_t(N), ++seed);
    Tensor dIn = ops->alloc({K}), dW = ops->alloc({K, N}), dB = ops->alloc({N}),
           dOut = ops->alloc({N});
    ops->upload(dIn, in.data());
    ops->upload(dW, w.data());
    ops->upload(dB, bias.data());
    auto packed = ops->allocBytes(cuda::f16PackedBytes(K, N));
    ASSERT_TRUE(cuda::packF16(packed->ptr, dW.data(), K, N));
    ops->fill(dOut.data(), std::nanf(""), N);
    cuda::matmulF16(dOut.data(), dIn.data(), packed->ptr, dB.data(), 1, K, N);
    std::vector<float> want(static_cast<size_t>(N)), got(static_cast<size_t>(N));
    ops->download(want.data(), dOut);
    ASSERT_TRUE(test::allFinite(want.data(), want.size()));
    for (int v = 0; v < cuda::gemvF16VariantCount(); ++v) {
      SCOPED_TRACE(cuda::gemvF16VariantName(v));
      ops->fill(dOut.data(), std::nanf(""), N);
      cuda::gemvF16Variant(v, dOut.data(), dIn.data(), packed->ptr, dB.data(), K, N);
      ops->download(got.data(), dOut);
      EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0)
          << "max |diff| " << test::maxAbsDiff(got.data(), want.data(), got.size());
    }
  }
}

// Every tensor-core tile kernel this GPU runs (on Hopper the wgmma + TMA ones and mma.sync)
// against a double-precision product of the same f16 operands, through the row-scale and bias
// epilogue: tails in M and N, an odd count of 128-row tiles (the 2-CTA clusters' spare tile),
// one K step to many, K past Kp's padding. Outputs poisoned first.
TEST_F(CudaPaths, TensorCoreTileKernelsEqualTheReferenceOnF16Operands) {
  ASSERT_GE(cuda::gemmF16VariantCount(), 1);
  uint64_t seed = 500;
  for (auto [M, N, K] : {std::tuple{1, 8, 64},
                         {64, 256, 64},
                         {65, 257, 100},
                         {128, 512, 128},
                         {129, 300, 1031},
                         {300, 2304, 768},
                         {383, 130, 4096},
                         {512, 1024, 256}}) {
    SCOPED_TRACE(::testing::Message() << M << "x" << N << "x" << K);
    const int Kp = cuda::paddedK(K);
    auto a = test::randomVector(size_t(M) * K, ++seed);
    auto b = test::randomVector(size_t(N) * K, ++seed, -0.2f, 0.2f);
    for (float& x : a) x = roundF16(x);
    for (float& x : b) x = roundF16(x);
    std::vector<float> rowScale(static_cast<size_t>(M));
    for (int m = 0; m < M; ++m) rowScale[size_t(m)] = std::ldexp(1.f, m % 5 - 2);
    const auto bias = test::randomVector(size_t(N), ++seed);
    // packF16 turns a [K][rows] f32 matrix into [rows][Kp] f16: upload the transposes.
    auto packed = [&](const std::vector<float>& rowsK, int rows) {
      std::vector<float> t(rowsK.size());
      for (int r = 0; r < rows; ++r)
        for (int k = 0; k < K; ++k) t[size_t(k) * rows + r] = rowsK[size_t(r) * K + k];
      Tensor staging = ops->alloc({K, rows});
      ops->upload(staging, t.data());
      auto buf = ops->allocBytes(cuda::f16PackedBytes(K, rows));
      EXPECT_TRUE(cuda::packF16(buf->ptr, staging.data(), K, rows));
      return buf;
    };
    const auto a16 = packed(a, M), b16 = packed(b, N);
    Tensor dScale = ops->alloc({M}), dBias = ops->alloc({N}), dC = ops->alloc({M, N});
    ops->upload(dScale, rowScale.data());
    ops->upload(dBias, bias.data());
    std::vector<float> want(size_t(M) * N), got(want.size());
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n) {
        double acc = 0;
        for (int k = 0; k < K; ++k) acc += double(a[size_t(m) * K + k]) * b[size_t(n) * K + k];
        want[size_t(m) * N + n] = float(acc * rowScale[size_t(m)] + bias[size_t(n)]);
      }
    for (int v = 0; v < cuda::gemmF16VariantCount(); ++v) {
      SCOPED_TRACE(cuda::gemmF16VariantName(v));
      ops->fill(dC.data(), std::nanf(""), dC.numel());
      cuda::gemmF16Variant(v, dC.data(), a16->ptr, b16->ptr, dScale.data(), dBias.data(), M, N, Kp);
      ops->download(got.data(), dC);
      ASSERT_TRUE(test::allFinite(got.data(), got.size()));
      EXPECT_LT(test::worstRatio(got.data(), want.data(), got.size(), 4e-5 * std::sqrt(K), 1e-5),
                1.0);
    }
  }
}

TEST_F(CudaPaths, F16PackRefusesOverflowAndBf16AcceptsIt) {
  std::vector<float> w(64 * 32, 0.01f), in(64, 1.f), bias(32, 0.f);
  w[77] = 1e5f;  // past f16's 65504
  bool ok = true;
  runPath(cudaEntry("f16-storage"), in, w, bias, 1, 64, 32, &ok);
  EXPECT_FALSE(ok);
  runPath(cudaEntry("tensor-core-f16"), in, w, bias, 1, 64, 32, &ok);
  EXPECT_FALSE(ok);
  const auto got = runPath(cudaEntry("bf16-storage"), in, w, bias, 1, 64, 32, &ok);
  EXPECT_TRUE(ok);
  EXPECT_TRUE(test::allFinite(got.data(), got.size()));
}

// Activations past f16's range: the row scale keeps the tensor-core paths finite and right.
TEST_F(CudaPaths, TensorCoreRowScaleHoldsActivationsPastF16Range) {
  const int M = 4, K = 256, N = 64;
  auto in = test::randomVector(size_t(M) * K, 9, -700.f, 700.f);
  for (size_t i = 0; i < in.size(); i += 64) in[i] *= 100.f;  // up to 7e4
  const auto w = test::randomVector(size_t(K) * N, 10, -0.2f, 0.2f);
  const std::vector<float> bias(N, 0.f);
  const auto want = reference(in, w, bias, M, K, N);
  for (const char* name : {"tensor-core-f16", "cublaslt"}) {
    const auto got = runPath(cudaEntry(name), in, w, bias, M, K, N);
    const GateMetric m = compareOutputs(want.data(), got.data(), got.size(), GateThresholds{});
    EXPECT_TRUE(m.pass) << name << ": " << m.reason << " mean_rel " << m.meanRel;
  }
}

// Every CUDA gate runs on the GPU backend; the storage and tensor-core paths carry f16's
// precision and pass the spec's thresholds; whatever the verdicts, each is reported with its
// numbers and a failed path is never the forward path.
TEST_F(CudaPaths, GatesRunAndAFailedPathIsNeverUsed) {
  PathSet set(*ops, PathSelection{}, detectCapabilities(), pathsFor(Device::CUDA));
  const auto results = set.results();
  ASSERT_EQ(results.size(), 5u);
  for (const auto& r : results) {
    SCOPED_TRACE(consoleLine(r));
    EXPECT_TRUE(r.ran || !r.supported);
    if (r.ran) {
      EXPECT_GT(r.metric.meanAbsRef, 0.0);
    }
  }
  EXPECT_TRUE(results[0].pass) << consoleLine(results[0]);  // f16-storage
  EXPECT_TRUE(results[2].pass) << consoleLine(results[2]);  // tensor-core-f16
  const PathEntry* fwd = set.forwardPath();
  ASSERT_NE(fwd, nullptr);
  EXPECT_EQ(fwd->name, "f16-storage");
  for (const auto& r : results) {
    if (!r.pass) {
      EXPECT_FALSE(set.isActive(r.path));
    }
  }
}

TEST_F(CudaPaths, BrokenPackFailsTheGateAndTheModelStaysOnF32) {
  PathEntry broken = cudaEntry("f16-storage");
  broken.name = "broken-f16";
  broken.prepare = cuda::packF16Truncated;  // drops 6 mantissa bits
  const GateResult r = runGate(*ops, broken);
  EXPECT_FALSE(r.pass) << consoleLine(r);
  EXPECT_NE(consoleLine(r).find("FAIL"), std::string::npos);
  PathSet set(*ops, PathSelection{}, detectCapabilities(), {broken});
  EXPECT_EQ(set.forwardPath(), nullptr);
  EXPECT_TRUE(set.activePills().empty());
}

}  // namespace
}  // namespace ptllm
