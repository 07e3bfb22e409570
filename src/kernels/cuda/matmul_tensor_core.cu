// f16 tensor-core matmuls (the spec's cooperative-matrix lever and the platform-library lever):
// our own mma.sync kernel and cuBLASLt, on the same operands. Weights are packF16's [N][Kp]
// f16 (matmul_storage.cu); activations are converted per call to f16 with a power-of-two scale
// per row, so a row whose values exceed f16's range (65504) still converts without overflow
// and the scale comes back out exactly in the f32 epilogue. Products are exact in f32 and sums
// accumulate in f32. The reference is Ops::matmul.
#include <cublasLt.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_paths.h"
#include "kernels/cuda/matmul_tensor_core_sm90a.h"

namespace ptllm::cuda {

namespace {

// ---- activations: f32 -> f16 with a power-of-two row scale ----
constexpr int kRowThreads = 256;

__global__ void __launch_bounds__(kRowThreads)
    rowsToF16Kernel(__half* __restrict__ a16, float* __restrict__ rowScale,
                    const float* __restrict__ in, int K, int Kp) {
  const int m = blockIdx.x;
  const float* x = in + size_t(m) * K;
  float amax = 0.f;
  for (int k = threadIdx.x; k < K; k += kRowThreads) amax = fmaxf(amax, fabsf(x[k]));
  __shared__ float red[kRowThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
  __syncthreads();
  amax = 0.f;
#pragma unroll
  for (int i = 0; i < kRowThreads / 32; ++i) amax = fmaxf(amax, red[i]);
  // amax in [2^e, 2^(e+1)): scale 2^(e-8) puts the row's max in [256, 512). Exact both ways.
  int e = 0;
  if (amax > 0.f && isfinite(amax)) e = ilogbf(amax) - 8;
  const float inv = ldexpf(1.f, -e);
  if (threadIdx.x == 0) rowScale[m] = ldexpf(1.f, e);
  __half* row = a16 + size_t(m) * Kp;
  for (int k = threadIdx.x; k < Kp; k += kRowThreads)
    row[k] = __float2half_rn(k < K ? x[k] * inv : 0.f);  // NaN/Inf stay NaN/Inf: the gate sees it
}

// out[m,n] = out[m,n] * rowScale[m] + bias[n] (cuBLASLt's epilogue of ours).
__global__ void scaleBiasKernel(float* __restrict__ out, const float* __restrict__ rowScale,
                                const float* __restrict__ bias, int M, int N) {
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= size_t(M) * N) return;
  const int m = static_cast<int>(i / N), n = static_cast<int>(i % N);
  out[i] = fmaf(out[i], rowScale[m], bias ? bias[n] : 0.f);
}

// ---- the mma.sync kernel: 128x128x32 block tile, 8 warps of 64x32, 3-stage cp.async ----
constexpr int kBM = 128, kBN = 128, kBK = 32, kStages = 3;
constexpr int kLds = kBK + 8;  // padded row (80 bytes): ldmatrix rows hit distinct banks
constexpr int kGroupM = 8;     // grouped block order: 8 row-tiles share the B tiles in L2
constexpr size_t kMmaSmem = size_t(kStages) * (kBM + kBN) * kLds * sizeof(__half);

using async::cpAsync16;
using async::cpAsyncCommit;
using async::cpAsyncWait;
using async::smemAddr;

__device__ inline void ldmatrixX4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smemAddr(p)));
}
__device__ inline void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c[M,N] = (a[M,Kp] . b[N,Kp]^T) * rowScale[m] + bias[n]; rowScale/bias may be null.
__global__ void __launch_bounds__(256)
    mmaF16Kernel(float* __restrict__ c, const __half* __restrict__ a, const __half* __restrict__ b,
                 const float* __restrict__ rowScale, const float* __restrict__ bias, int M, int N,
                 int Kp) {
  extern __shared__ __align__(16) unsigned char smemRaw[];
  __half* As = reinterpret_cast<__half*>(smemRaw);
  __half* Bs = As + kStages * kBM * kLds;

  // Grouped ordering of the 1-D grid (L2 reuse of B tiles across neighbouring row tiles).
  const int tilesM = (M + kBM - 1) / kBM, tilesN = (N + kBN - 1) / kBN;
  const int pid = blockIdx.x, perGroup = kGroupM * tilesN;
  const int group = pid / perGroup, firstM = group * kGroupM;
  const int groupRows = min(tilesM - firstM, kGroupM);
  const int tileM = firstM + (pid % perGroup) % groupRows, tileN = (pid % perGroup) / groupRows;
  const int m0 = tileM * kBM, n0 = tileN * kBN;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 2, wn = warp & 3;  // 2 x 4 warps: 64 rows x 32 columns each
  const int numK = Kp / kBK;

  auto loadStage = [&](int stage, int k0) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int chunk = tid + i * 256, row = chunk >> 2, col = (chunk & 3) * 8;
      const int gm = m0 + row, gn = n0 + row;
      cpAsync16(As + (stage * kBM + row) * kLds + col,
                a + (gm < M ? size_t(gm) * Kp + k0 + col : 0), gm < M);
      cpAsync16(Bs + (stage * kBN + row) * kLds + col,
                b + (gn < N ? size_t(gn) * Kp + k0 + col : 0), gn < N);
    }
  };

  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < numK) loadStage(s, s * kBK);
    cpAsyncCommit();
  }
  for (int kt = 0; kt < numK; ++kt) {
    cpAsyncWait<kStages - 2>();
    __syncthreads();  // stage kt landed for everyone; stage (kt-1) is no longer read
    const int next = kt + kStages - 1;
    if (next < numK) loadStage(next % kStages, next * kBK);
    cpAsyncCommit();

    const __half* as = As + (kt % kStages) * kBM * kLds;
    const __half* bs = Bs + (kt % kStages) * kBN * kLds;
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      uint32_t af[4][4], bf[2][4];
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
        ldmatrixX4(af[mi], as + (wm * 64 + mi * 16 + (lane & 15)) * kLds + kk + (lane >> 4) * 8);
#pragma unroll
      for (int p = 0; p < 2; ++p)
        ldmatrixX4(bf[p], bs + (wn * 32 + p * 16 + (lane & 7) + (lane >> 4) * 8) * kLds + kk +
                              ((lane >> 3) & 1) * 8);
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
          mma16816(acc[mi][ni], af[mi], bf[ni >> 1][(ni & 1) * 2], bf[ni >> 1][(ni & 1) * 2 + 1]);
    }
  }
  cpAsyncWait<0>();

#pragma unroll
  for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int m = m0 + wm * 64 + mi * 16 + (lane >> 2) + half * 8;
      if (m >= M) continue;
      const float s = rowScale ? rowScale[m] : 1.f;
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int n = n0 + wn * 32 + ni * 8 + (lane & 3) * 2 + j;
          if (n < N)
            c[size_t(m) * N + n] = fmaf(acc[mi][ni][half * 2 + j], s, bias ? bias[n] : 0.f);
        }
      }
    }
  }
}

void launchMma(float* c, const void* a, const void* b, const float* rowScale, const float* bias,
               int M, int N, int Kp) {
  static const bool attrSet = [] {
    PTLLM_CUDA_CHECK(cudaFuncSetAttribute(mmaF16Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(kMmaSmem)));
    return true;
  }();
  (void)attrSet;
  const unsigned blocks = ceilDiv(M, kBM) * ceilDiv(N, kBN);
  mmaF16Kernel<<<blocks, 256, kMmaSmem, stream()>>>(
      c, static_cast<const __half*>(a), static_cast<const __half*>(b), rowScale, bias, M, N, Kp);
  PTLLM_CUDA_LAUNCH_CHECK();
}

// The tile kernel of a call: on Hopper the wgmma + TMA kernel (matmul_tensor_core_sm90a.cu)
// from kWgmmaMinRows rows on; below that its 128-row tile is mostly padding, and the mma.sync
// kernel (every other GPU too) serves. The gate's shapes cover both (M = 1, 2 and M = 64, 300).
constexpr int kWgmmaMinRows = 64;
void launchTensorCore(float* c, const void* a, const void* b, const float* rowScale,
                      const float* bias, int M, int N, int Kp) {
  if (M >= kWgmmaMinRows && wgmmaGemmAvailable())
    wgmmaGemm(0, c, a, b, rowScale, bias, M, N, Kp);
  else
    launchMma(c, a, b, rowScale, bias, M, N, Kp);
}

// ---- per-call scratch: the f16 activations and their row scales ----
// One dispatch enqueues convert + matmul under the lock: another thread (the gate's) must not
// convert into the scratch between the two.
struct ActScratch {
  std::mutex mutex;
  __half* a16 = nullptr;
  float* rowScale = nullptr;
  size_t a16Elems = 0, rows = 0;
  void ensure(size_t elems, size_t m) {
    if (elems > a16Elems) {
      if (a16) PTLLM_CUDA_CHECK(cudaFree(a16));  // synchronizes: no kernel still reads it
      PTLLM_CUDA_CHECK(cudaMalloc(&a16, elems * sizeof(__half)));
      a16Elems = elems;
    }
    if (m > rows) {
      if (rowScale) PTLLM_CUDA_CHECK(cudaFree(rowScale));
      PTLLM_CUDA_CHECK(cudaMalloc(&rowScale, m * sizeof(float)));
      rows = m;
    }
  }
  void convert(const float* in, int M, int K, int Kp) {
    ensure(size_t(M) * Kp, size_t(M));
    rowsToF16Kernel<<<M, kRowThreads, 0, stream()>>>(a16, rowScale, in, K, Kp);
    PTLLM_CUDA_LAUNCH_CHECK();
  }
};
ActScratch& scratch() {
  static ActScratch s;
  return s;
}

// ---- cuBLASLt ----
#define PTLLM_CUBLAS_CHECK(call)                                                          \
  do {                                                                                    \
    cublasStatus_t st_ = (call);                                                          \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                     \
      ::ptllm::fail("cuBLASLt error in {} ({}:{}): status {}", #call, __FILE__, __LINE__, \
                    static_cast<int>(st_));                                               \
  } while (0)

class LtGemm {
 public:
  static LtGemm& get() {
    static LtGemm g;
    return g;
  }
  // c[M,N] (row-major f32) = a[M,Kp] . b[N,Kp]^T, operands f16. Column-major, that is
  // C^T[N,M] = op_T(B as Kp x N) . A as Kp x M: the TN layout cuBLASLt is fastest at.
  void run(float* c, const void* a, const void* b, int M, int N, int Kp) {
    std::lock_guard<std::mutex> lock(mutex_);
    Plan& p = plan(M, N, Kp);
    const float alpha = 1.f, beta = 0.f;
    PTLLM_CUBLAS_CHECK(cublasLtMatmul(handle_, p.op, &alpha, b, p.bLayout, a, p.aLayout, &beta, c,
                                      p.cLayout, c, p.cLayout, &p.algo, workspace_, kWorkspace,
                                      stream()));
  }

 private:
  static constexpr size_t kWorkspace = 32u << 20;
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t aLayout = nullptr, bLayout = nullptr, cLayout = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  LtGemm() {
    PTLLM_CUBLAS_CHECK(cublasLtCreate(&handle_));
    PTLLM_CUDA_CHECK(cudaMalloc(&workspace_, kWorkspace));
  }
  Plan& plan(int M, int N, int Kp) {
    const auto key = std::make_tuple(M, N, Kp);
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second;
    Plan p;
    PTLLM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t opT = CUBLAS_OP_T, opN = CUBLAS_OP_N;
    PTLLM_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &opT, sizeof(opT)));
    PTLLM_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &opN, sizeof(opN)));
    PTLLM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.bLayout, CUDA_R_16F, Kp, N, Kp));
    PTLLM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.aLayout, CUDA_R_16F, Kp, M, Kp));
    PTLLM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.cLayout, CUDA_R_32F, N, M, N));
    cublasLtMatmulPreference_t pref = nullptr;
    PTLLM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const size_t ws = kWorkspace;
    PTLLM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    PTLLM_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(
        handle_, p.op, p.bLayout, p.aLayout, p.cLayout, p.cLayout, pref, 1, &result, &found));
    cublasLtMatmulPreferenceDestroy(pref);
    if (found == 0) fail("cuBLASLt has no algorithm for {}x{}x{} f16", M, N, Kp);
    p.algo = result.algo;
    return plans_.emplace(key, p).first->second;
  }
  std::mutex mutex_;
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::map<std::tuple<int, int, int>, Plan> plans_;
};

}  // namespace

void matmulTensorCoreF16(float* out, const float* in, const void* w, const float* bias, int M,
                         int K, int N) {
  if (M <= 0 || N <= 0) return;
  const int Kp = paddedK(K);
  ActScratch& s = scratch();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.convert(in, M, K, Kp);
  launchTensorCore(out, s.a16, w, s.rowScale, bias, M, N, Kp);
}

void gemmF16TensorCore(float* c, const void* a, const void* b, int M, int N, int Kp) {
  if (Kp % 64 != 0) fail("gemmF16TensorCore: Kp={} is not a multiple of 64", Kp);
  launchTensorCore(c, a, b, nullptr, nullptr, M, N, Kp);
}

// The variants: the Hopper kernel's schedules where this GPU runs them, then mma.sync.
int hopperVariants() {
  return wgmmaGemmAvailable() ? wgmmaGemmVariantCount() : 0;
}
int gemmF16VariantCount() {
  return hopperVariants() + 1;
}
const char* gemmF16VariantName(int variant) {
  return variant < hopperVariants() ? wgmmaGemmVariantName(variant) : "mma.sync-128x128";
}
void gemmF16Variant(int variant, float* c, const void* a, const void* b, const float* rowScale,
                    const float* bias, int M, int N, int Kp) {
  if (Kp % 64 != 0) fail("gemmF16Variant: Kp={} is not a multiple of 64", Kp);
  if (variant < hopperVariants())
    wgmmaGemm(variant, c, a, b, rowScale, bias, M, N, Kp);
  else
    launchMma(c, a, b, rowScale, bias, M, N, Kp);
}

void matmulCublasLtF16(float* out, const float* in, const void* w, const float* bias, int M, int K,
                       int N) {
  if (M <= 0 || N <= 0) return;
  const int Kp = paddedK(K);
  ActScratch& s = scratch();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.convert(in, M, K, Kp);
  LtGemm::get().run(out, s.a16, w, M, N, Kp);
  const size_t n = size_t(M) * N;
  scaleBiasKernel<<<ceilDiv(static_cast<long long>(n), 256), 256, 0, stream()>>>(out, s.rowScale,
                                                                                 bias, M, N);
  PTLLM_CUDA_LAUNCH_CHECK();
}

void gemmF16CublasLt(float* c, const void* a, const void* b, int M, int N, int Kp) {
  LtGemm::get().run(c, a, b, M, N, Kp);
}

}  // namespace ptllm::cuda
