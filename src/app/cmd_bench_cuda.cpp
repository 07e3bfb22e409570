// ptllm bench cuda: the GPU numbers of the CUDA issue, as `peer=ptllm mode=...` lines that
// bench/run_cuda_bench.sh sets beside PyTorch's (bench/torch_cuda_peer.py) on the same GPU:
// device copy bandwidth, each path's GEMV (M=1) at 16384^2 and 4096^2 with its gate verdict,
// and our tensor-core GEMM against cuBLASLt at 8192^3 on the same f16 operands.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "app/commands.h"
#include "app/engine.h"
#include "core/error.h"
#include "core/rng.h"
#include "gate/paths.h"
#include "kernels/cuda/cuda_device.h"
#include "kernels/cuda/cuda_paths.h"

namespace ptllm::app {

namespace {

std::vector<float> uniform(size_t n, uint64_t seed, float lo, float hi) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = rng.uniform(lo, hi);
  return v;
}

void benchCopy(Ops& ops, int iters) {
  const size_t bytes = size_t(1) << 30;
  auto a = ops.allocBytes(bytes), b = ops.allocBytes(bytes);
  const double ms = cudaMedianMs(
      [&] {
        ops.copy(static_cast<float*>(b->ptr), static_cast<float*>(a->ptr),
                 int64_t(bytes / sizeof(float)));
      },
      iters);
  std::printf("peer=ptllm mode=copy bytes=%zu ms=%.4f gbs=%.1f\n", bytes, ms,
              2.0 * double(bytes) / ms / 1e6);  // read + write
}

// The f16-storage GEMV's other schedules (cuda::gemvF16Variant: bit-identical arithmetic) on
// the same rotating weights; each is checked bit for bit against matmulF16 first.
void benchGemvVariants(Ops& ops, Tensor& y, const Tensor& x, const Tensor& bias,
                       const std::vector<std::shared_ptr<Buffer>>& packed, int K, int N,
                       int iters) {
  const int copies = int(packed.size());
  std::vector<float> want(static_cast<size_t>(N)), got(static_cast<size_t>(N));
  cuda::matmulF16(y.data(), x.data(), packed[0]->ptr, bias.data(), 1, K, N);
  ops.download(want.data(), y);
  for (int v = 0; v < cuda::gemvF16VariantCount(); ++v) {
    ops.fill(y.data(), std::nanf(""), N);
    cuda::gemvF16Variant(v, y.data(), x.data(), packed[0]->ptr, bias.data(), K, N);
    ops.download(got.data(), y);
    const bool same = std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0;
    int i = 0;
    const double ms = cudaMedianMs(
        [&] {
          cuda::gemvF16Variant(v, y.data(), x.data(), packed[size_t(i++ % copies)]->ptr,
                               bias.data(), K, N);
        },
        iters);
    const size_t bytes = cuda::f16PackedBytes(K, N);
    std::printf(
        "peer=ptllm mode=gemv_variant variant=%s bit_identical=%d K=%d N=%d copies=%d us=%.2f "
        "gbs=%.1f\n",
        cuda::gemvF16VariantName(v), int(same), K, N, copies, ms * 1e3, double(bytes) / ms / 1e6);
  }
}

// One M=1 matmul per path, rotating over enough weight copies (>= 1 GiB of packed weights)
// that no call finds its matrix in the 60 MB L2.
void benchGemv(Ops& ops, PathSet& paths, int K, int N, int iters) {
  const std::vector<float> hw = uniform(size_t(K) * N, 11, -0.2f, 0.2f);
  const std::vector<float> hx = uniform(size_t(K), 12, -1.f, 1.f);
  Tensor x = ops.alloc({1, K}), y = ops.alloc({1, N}), bias = ops.alloc({N});
  ops.upload(x, hx.data());
  struct Candidate {
    std::string name;
    const PathEntry* entry;  // null: the canonical f32 matmul
  };
  std::vector<Candidate> cands{{"f32", nullptr}};
  for (const PathEntry& e : paths.entries()) cands.push_back({e.name, &e});
  for (const Candidate& c : cands) {
    std::string verdict = "canonical";
    if (c.entry) {
      const GateResult r = paths.ready(c.name).get();
      verdict = !r.supported ? "unsupported" : r.pass ? "PASS" : "FAIL";
      if (!r.supported) continue;
    }
    const size_t bytes = c.entry ? c.entry->packedBytes(K, N) : size_t(K) * N * sizeof(float);
    const int copies = int(std::clamp<size_t>((size_t(1) << 30) / bytes + 1, 2, 64));
    std::vector<Tensor> w32;
    std::vector<std::shared_ptr<Buffer>> packed;
    Tensor staging = ops.alloc({K, N});
    ops.upload(staging, hw.data());
    for (int i = 0; i < copies; ++i) {
      if (c.entry) {
        packed.push_back(ops.allocBytes(bytes));
        if (!c.entry->prepare(packed.back()->ptr, staging.data(), K, N))
          fail("bench cuda: {} refused the benchmark's weights", c.name);
      } else {
        w32.push_back(ops.alloc({K, N}));
        ops.copy(w32.back().data(), staging.data(), int64_t(K) * N);
      }
    }
    auto call = [&](int j) {  // the GEMV on weight copy j
      if (c.entry)
        c.entry->dispatch(y.data(), x.data(), packed[size_t(j)]->ptr, bias.data(), 1, K, N);
      else
        ops.matmul(y.data(), x.data(), w32[size_t(j)].data(), bias.data(), 1, K, N);
    };
    int i = 0;
    const double ms = cudaMedianMs([&] { call(i++ % copies); }, iters);
    std::printf(
        "peer=ptllm mode=gemv path=%s gate=%s K=%d N=%d copies=%d us=%.2f weight_bytes=%zu "
        "gbs=%.1f\n",
        c.name.c_str(), verdict.c_str(), K, N, copies, ms * 1e3, bytes, double(bytes) / ms / 1e6);
    // The kernels alone: one call per copy recorded into a graph, the replay's median over the
    // copies (no per-call launch from the host; the peer's gemv_graph is the same).
    ops.beginStepCapture();
    for (int j = 0; j < copies; ++j) call(j);
    const std::unique_ptr<Ops::StepGraph> graph = ops.endStepCapture();
    const double graphMs = cudaMedianMs([&] { graph->replay(); }, iters) / copies;
    std::printf(
        "peer=ptllm mode=gemv_graph path=%s gate=%s K=%d N=%d copies=%d us=%.2f weight_bytes=%zu "
        "gbs=%.1f\n",
        c.name.c_str(), verdict.c_str(), K, N, copies, graphMs * 1e3, bytes,
        double(bytes) / graphMs / 1e6);
    if (c.name == "f16-storage") benchGemvVariants(ops, y, x, bias, packed, K, N, iters);
  }
}

void benchGemm(Ops& ops, int n, int iters) {
  const int Kp = cuda::paddedK(n);
  // Operands: f16 [n][Kp] through the f16 pack (A's rows are its rows, B's its columns).
  std::shared_ptr<Buffer> a16 = ops.allocBytes(cuda::f16PackedBytes(n, n)),
                          b16 = ops.allocBytes(cuda::f16PackedBytes(n, n));
  {
    Tensor staging = ops.alloc({n, n});
    ops.upload(staging, uniform(size_t(n) * n, 21, -1.f, 1.f).data());
    PTLLM_ASSERT(cuda::packF16(a16->ptr, staging.data(), n, n));
    ops.upload(staging, uniform(size_t(n) * n, 22, -1.f, 1.f).data());
    PTLLM_ASSERT(cuda::packF16(b16->ptr, staging.data(), n, n));
  }
  Tensor c1 = ops.alloc({n, n}), c2 = ops.alloc({n, n});
  const double msOurs = cudaMedianMs(
      [&] { cuda::gemmF16TensorCore(c1.data(), a16->ptr, b16->ptr, n, n, Kp); }, iters);
  const double msLt =
      cudaMedianMs([&] { cuda::gemmF16CublasLt(c2.data(), a16->ptr, b16->ptr, n, n, Kp); }, iters);
  // The two must agree (both f32-accumulated products of the same f16 operands).
  std::vector<float> h1(size_t(n) * n), h2(h1.size());
  ops.download(h1.data(), c1);
  ops.download(h2.data(), c2);
  auto maxAbsDiff = [&] {  // h1 against cuBLASLt's h2
    double d = 0;
    for (size_t i = 0; i < h1.size(); ++i) d = std::max(d, double(std::fabs(h1[i] - h2[i])));
    return d;
  };
  const double maxDiff = maxAbsDiff();
  double maxRef = 0;
  for (float x : h2) maxRef = std::max(maxRef, double(std::fabs(x)));
  const double flop = 2.0 * n * double(n) * n;
  std::printf(
      "peer=ptllm mode=gemm M=%d N=%d K=%d ours_ms=%.3f cublaslt_ms=%.3f ours_tflops=%.1f "
      "cublaslt_tflops=%.1f ours_over_cublaslt=%.3f max_abs_diff=%.3e max_abs=%.3e\n",
      n, n, n, msOurs, msLt, flop / msOurs / 1e9, flop / msLt / 1e9, msLt / msOurs, maxDiff,
      maxRef);
  // Every tile kernel this GPU runs (the path's first), each against cuBLASLt's result.
  for (int v = 0; v < cuda::gemmF16VariantCount(); ++v) {
    const double ms = cudaMedianMs(
        [&] { cuda::gemmF16Variant(v, c1.data(), a16->ptr, b16->ptr, nullptr, nullptr, n, n, Kp); },
        iters);
    ops.download(h1.data(), c1);
    const double diff = maxAbsDiff();
    std::printf(
        "peer=ptllm mode=gemm-variant kernel=%s M=%d N=%d K=%d ms=%.3f tflops=%.1f "
        "over_cublaslt=%.3f max_abs_diff=%.3e\n",
        cuda::gemmF16VariantName(v), n, n, n, ms, flop / ms / 1e9, msLt / ms, diff);
  }
}

void benchCuda(GlobalOptions g, int iters, bool gemm) {
  g.device = "cuda";
  Engine e = makeEngine(g);
  std::printf("# gpu: %s\n", cudaDeviceInfo().summary().c_str());
  benchCopy(*e.ops, iters);
  for (int n : {16384, 4096}) benchGemv(*e.ops, *e.paths, n, n, iters);
  if (gemm) benchGemm(*e.ops, 8192, std::max(5, iters / 4));
}

}  // namespace

void addCudaBenchSubcommand(CLI::App* bench, GlobalOptions& g) {
  auto iters = std::make_shared<int>(50);
  auto gemm = std::make_shared<bool>(true);
  auto* cmd = bench->add_subcommand(
      "cuda", "GPU: copy GB/s, each path's GEMV, tensor-core GEMM vs cuBLASLt (needs a GPU)");
  cmd->add_option("--iters", *iters)->capture_default_str()->check(intRange(1));
  cmd->add_flag("!--no-gemm", *gemm, "Skip the 8192^3 GEMM");
  cmd->callback([iters, gemm, &g] {
    g.apply();
    benchCuda(g, *iters, *gemm);
  });
}

}  // namespace ptllm::app
