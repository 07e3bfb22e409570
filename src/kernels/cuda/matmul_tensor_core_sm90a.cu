// The Hopper tile kernel of the tensor-core-f16 path: wgmma (warpgroup MMA, f16 operands from
// shared memory, f32 accumulators in registers) fed by the tensor-memory-accelerator (TMA) bulk
// copy engine through an mbarrier pipeline. Same contract and epilogue as matmul_tensor_core.cu's
// mma.sync kernel, which serves every other GPU and the small-M calls:
//   c[M,N] = (a[M,Kp] . b[N,Kp]^T) * rowScale[m] + bias[n]   (rowScale, bias may be null)
// with a and b f16, K-major (rows Kp apart), Kp a multiple of 64; c row-major f32.
//
// This file is compiled for sm_90a only (wgmma and setmaxnreg exist on no other target), as its
// own CMake target; wgmmaGemmAvailable() says whether the running GPU can execute it.
//
// Shape of the kernel (one 128 x 256 output tile per CTA, K in steps of 64):
//   - warpgroup 0 is the producer: one thread issues, per k-step, a TMA load of the A tile
//     (128 rows x 64 halves) and of the B tile (256 rows x 64 halves) into one of kStages
//     shared-memory stages, the copy engine completing on that stage's `full` mbarrier. TMA
//     writes the 128-byte rows with the 128B swizzle the wgmma descriptors name, so there are no
//     bank conflicts and no ldmatrix.
//   - warpgroups 1 and 2 are consumers: each owns 64 rows x 256 columns (128 f32 accumulators
//     per thread) and issues four m64n256k16 wgmmas per stage; once the wgmmas of the previous
//     stage have completed (wait_group 1) it arrives on that stage's `empty` mbarrier, which the
//     producer waits on before refilling it. setmaxnreg moves registers from the producer to
//     the consumers.
//   - kCluster = 2: the two CTAs of a cluster compute vertically adjacent tiles that share their
//     B tile; each CTA loads half of B and the copy engine multicasts it into both CTAs' shared
//     memory, halving the L2 traffic for B. A stage is then refilled only after the consumers
//     of both CTAs released it (each consumer arrives on both CTAs' `empty` barrier).
// Zero-fill: TMA reads past M, N or Kp return zeros, so edge tiles need no masking until the
// store, which is bounds-checked.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <mutex>

#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_device.h"
#include "kernels/cuda/matmul_tensor_core_sm90a.h"

namespace ptllm::cuda {

namespace {

constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 4;
constexpr int kConsumers = 2;  // warpgroups of 64 rows each
constexpr int kThreads = (kConsumers + 1) * 128;
constexpr int kATile = kBM * kBK * 2;  // bytes: 16 KB
constexpr int kBTile = kBN * kBK * 2;  // 32 KB
constexpr int kStageBytes = kATile + kBTile;
constexpr size_t kSmem = size_t(kStages) * kStageBytes + 1024;  // + slack for 1 KB alignment
constexpr int kGroupM = 8;  // grouped tile order: neighbouring CTAs share A and B tiles in L2

using namespace async;

// ---- wgmma ----
// Shared-memory matrix descriptor of a K-major tile written by TMA with the 128B swizzle:
// start address, stride 1024 bytes between 8-row groups, swizzle mode 1 (128B). Within the
// 64-half (128-byte) swizzle atom, the k-th 16-wide slice starts k * 32 bytes further on.
__device__ inline uint64_t wgmmaDesc(uint32_t addr) {
  uint64_t d = (addr & 0x3FFFFu) >> 4;
  d |= uint64_t(1) << 16;          // leading byte offset: unused for swizzled K-major
  d |= uint64_t(1024 >> 4) << 32;  // stride byte offset
  d |= uint64_t(1) << 62;          // 128B swizzle
  return d;
}
__device__ inline void wgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ inline void wgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ inline void wgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// d[64 x 256] += A[64 x 16] . B[256 x 16]^T, both K-major in shared memory. Thread t of the
// warpgroup holds, for j = 0..31: d[4j + {0,1}] at row 16 (t / 32) + (t % 32) / 4, columns
// 8j + 2 (t % 4) + {0,1}, and d[4j + {2,3}] eight rows further down.
#define PTLLM_F8(i)                                                                           \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define PTLLM_F32(i) PTLLM_F8(i), PTLLM_F8(i + 8), PTLLM_F8(i + 16), PTLLM_F8(i + 24)
__device__ inline void wgmma64x256(float (&d)[128], uint64_t descA, uint64_t descB) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, "
      "%111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, "
      "%125, %126, %127}, "
      "%128, %129, p, 1, 1, 0, 0;\n"
      "}\n"
      : PTLLM_F32(0), PTLLM_F32(32), PTLLM_F32(64), PTLLM_F32(96)
      : "l"(descA), "l"(descB), "r"(1));
}
#undef PTLLM_F32
#undef PTLLM_F8

template <int kCluster>
__global__ void __launch_bounds__(kThreads, 1)
    wgmmaGemmKernel(const __grid_constant__ CUtensorMap mapA,
                    const __grid_constant__ CUtensorMap mapB, float* __restrict__ c,
                    const float* __restrict__ rowScale, const float* __restrict__ bias, int M,
                    int N, int Kp) {
  extern __shared__ unsigned char smemRaw[];
  __shared__ __align__(8) uint64_t fullBar[kStages], emptyBar[kStages];
  // TMA's 128B swizzle repeats every 1024 bytes: the stages start 1 KB-aligned.
  const uint32_t rawAddr = smemAddr(smemRaw);
  const uint32_t base = (rawAddr + 1023u) & ~1023u;
  auto aStage = [&](int s) { return base + uint32_t(s) * kStageBytes; };
  auto bStage = [&](int s) { return base + uint32_t(s) * kStageBytes + kATile; };

  // Tile of this CTA: clusters of kCluster vertically adjacent tiles, in grouped order.
  const int tilesM = (M + kBM - 1) / kBM, tilesN = (N + kBN - 1) / kBN;
  const int rowsOfClusters = (tilesM + kCluster - 1) / kCluster;
  const int rank = kCluster > 1 ? int(blockIdx.x % kCluster) : 0;
  const int pid = int(blockIdx.x / kCluster), perGroup = kGroupM * tilesN;
  const int group = pid / perGroup, first = group * kGroupM;
  const int groupRows = min(rowsOfClusters - first, kGroupM);
  const int tileM = (first + (pid % perGroup) % groupRows) * kCluster + rank;
  const int tileN = (pid % perGroup) / groupRows;
  const int m0 = tileM * kBM, n0 = tileN * kBN;
  const int numK = Kp / kBK;
  const int wg = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarInit(smemAddr(&fullBar[s]), 1);
      mbarInit(smemAddr(&emptyBar[s]), kConsumers * kCluster);
    }
    mbarFenceInit();
  }
  // Every CTA's barriers are initialised before any CTA of the cluster signals them.
  if constexpr (kCluster > 1) {
    asm volatile(
        "barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::
            : "memory");
  } else {
    __syncthreads();
  }

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x == 0) {
      for (int kt = 0; kt < numK; ++kt) {
        const int s = kt % kStages;
        if (kt >= kStages) mbarWait(smemAddr(&emptyBar[s]), ((kt / kStages) - 1) & 1);
        const uint32_t full = smemAddr(&fullBar[s]);
        mbarExpectTx(full, kStageBytes);
        tmaLoad(aStage(s), &mapA, kt * kBK, m0, full);
        if constexpr (kCluster > 1) {
          // This CTA's half of the shared B tile, into both CTAs.
          constexpr int kPart = kBN / kCluster;
          tmaLoadMulticast(bStage(s) + uint32_t(rank) * kPart * kBK * 2, &mapB, kt * kBK,
                           n0 + rank * kPart, full, uint16_t((1u << kCluster) - 1));
        } else {
          tmaLoad(bStage(s), &mapB, kt * kBK, n0, full);
        }
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int cw = wg - 1;  // consumer: rows cw*64 .. cw*64+63 of the tile
    float d[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) d[i] = 0.f;
    const bool signaller = threadIdx.x % 128 == 0;
    for (int kt = 0; kt < numK; ++kt) {
      const int s = kt % kStages;
      mbarWait(smemAddr(&fullBar[s]), (kt / kStages) & 1);
      const uint32_t a = aStage(s) + uint32_t(cw) * 64 * 128, b = bStage(s);
      wgmmaFence();
#pragma unroll
      for (int k = 0; k < kBK / 16; ++k)
        wgmma64x256(d, wgmmaDesc(a + k * 32), wgmmaDesc(b + k * 32));
      wgmmaCommit();
      wgmmaWait<1>();  // the previous stage's wgmmas are done reading it
      if (kt > 0 && signaller) {
        const uint32_t empty = smemAddr(&emptyBar[(kt - 1) % kStages]);
        if constexpr (kCluster > 1) {
          for (int r = 0; r < kCluster; ++r) mbarArriveCluster(empty, uint32_t(r));
        } else {
          mbarArrive(empty);
        }
      }
    }
    wgmmaWait<0>();

    // Epilogue straight from the accumulators: two adjacent columns per store.
    const int t = threadIdx.x % 128;
    const int row0 = m0 + cw * 64 + (t / 32) * 16 + (t % 32) / 4;
    const int col0 = n0 + 2 * (t % 4);
    const bool pairs = N % 2 == 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = row0 + 8 * h;
      if (m >= M) continue;
      const float sc = rowScale ? rowScale[m] : 1.f;
      float* crow = c + size_t(m) * N;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const int n = col0 + 8 * j;
        const float v0 = d[4 * j + 2 * h], v1 = d[4 * j + 2 * h + 1];
        if (pairs && n + 1 < N) {
          const float b0 = bias ? bias[n] : 0.f, b1 = bias ? bias[n + 1] : 0.f;
          *reinterpret_cast<float2*>(crow + n) = make_float2(fmaf(v0, sc, b0), fmaf(v1, sc, b1));
        } else {
          if (n < N) crow[n] = fmaf(v0, sc, bias ? bias[n] : 0.f);
          if (n + 1 < N) crow[n + 1] = fmaf(v1, sc, bias ? bias[n + 1] : 0.f);
        }
      }
    }
  }
  // No CTA leaves while its cluster peer may still multicast into it or arrive on its barriers
  // (not .aligned: the producer warp's lanes arrive from diverged paths).
  if constexpr (kCluster > 1) {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
  }
}

// ---- host side ----
PFN_cuTensorMapEncodeTiled_v12000 encodeFn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    PTLLM_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                                      cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || p == nullptr)
      fail("the CUDA driver has no cuTensorMapEncodeTiled (needs a CUDA 12+ driver)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// A [rows][Kp] f16 matrix read in boxes of boxRows x 64 halves (128 bytes, the swizzle span).
CUtensorMap tensorMap(const void* ptr, int rows, int Kp, int boxRows) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {cuuint64_t(Kp), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(Kp) * 2};
  const cuuint32_t box[2] = {cuuint32_t(kBK), cuuint32_t(boxRows)};
  const cuuint32_t elemStrides[2] = {1, 1};
  const CUresult r =
      encodeFn()(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, const_cast<void*>(ptr), dims, strides,
                 box, elemStrides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    fail("cuTensorMapEncodeTiled failed ({}) for a {}x{} f16 matrix", static_cast<int>(r), rows,
         Kp);
  return map;
}

template <int kCluster>
void launch(float* c, const void* a, const void* b, const float* rowScale, const float* bias, int M,
            int N, int Kp) {
  static const bool attrSet = [] {
    PTLLM_CUDA_CHECK(cudaFuncSetAttribute(wgmmaGemmKernel<kCluster>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(kSmem)));
    return true;
  }();
  (void)attrSet;
  const CUtensorMap mapA = tensorMap(a, M, Kp, kBM);
  const CUtensorMap mapB = tensorMap(b, N, Kp, kBN / kCluster);
  const int tilesM = int(ceilDiv(M, kBM)), tilesN = int(ceilDiv(N, kBN));
  const int clusterRows = (tilesM + kCluster - 1) / kCluster;

  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(clusterRows * kCluster * tilesN));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = kSmem;
  cfg.stream = stream();
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kCluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  PTLLM_CUDA_CHECK(
      cudaLaunchKernelEx(&cfg, wgmmaGemmKernel<kCluster>, mapA, mapB, c, rowScale, bias, M, N, Kp));
}

}  // namespace

bool wgmmaGemmAvailable() {
  const CudaDeviceInfo& d = cudaDeviceInfo();
  return d.available && d.wgmma;
}

int wgmmaGemmVariantCount() {
  return 2;
}
// Variant 1 multicasts B across 2-CTA clusters: it halves the L2 reads of B but couples the
// two CTAs' pipelines, and measured slower on the H200 (474 vs 734 TFLOP/s at 8192^3,
// docs/performance.md); it stays as a benchmark variant, tested like the path's kernel.
const char* wgmmaGemmVariantName(int variant) {
  return variant == 0 ? "wgmma-128x256" : "wgmma-128x256-cluster2";
}
void wgmmaGemm(int variant, float* c, const void* a, const void* b, const float* rowScale,
               const float* bias, int M, int N, int Kp) {
  if (Kp % kBK != 0) fail("wgmmaGemm: Kp={} is not a multiple of {}", Kp, kBK);
  if (variant == 0)
    launch<1>(c, a, b, rowScale, bias, M, N, Kp);
  else
    launch<2>(c, a, b, rowScale, bias, M, N, Kp);
}

}  // namespace ptllm::cuda
