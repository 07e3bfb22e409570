// What one cluster barrier of the fused decode step costs, and what the rows it publishes add:
// a 16-block cluster (the step's launch) of 256 threads loops `iters` times over
//   barrier   : barrier.cluster arrive + wait alone,
//   push S    : S threads of each block store one float into all 16 blocks' shared memory
//               (st.shared::cluster, as the step publishes a GEMV's outputs), then the barrier,
//   pull S    : S threads store one float locally, the barrier, then every thread of the block
//               reads S/16.. floats back from all 16 blocks (ld.shared::cluster) and sums them,
//               the other way to hand a row to every block,
//   async S   : S threads of each block store one float into all 16 blocks with st.async, each
//               store completing bytes on the receiving block's mbarrier (double-buffered by
//               iteration parity); each block waits on its own mbarrier for the 16 * S floats,
//               then a __syncthreads (what a phase boundary inside the step has anyway). No
//               cluster barrier: every hand-off is its own point-to-point completion,
//   async4 S  : the same with S / 4 threads each storing a float4 (st.async .v4),
// and prints ns per iteration from %globaltimer in block 0. Not part of the build (CI has no
// GPU): bench/gpu_decode_session.sh does not run it; a device call does
//   nvcc -O3 -arch=sm_90 -Isrc -o /tmp/probe bench/cluster_barrier_probe.cu && /tmp/probe 2000
// Modes 3-4 use the fused step's own helpers (src/kernels/cuda/async_copy.cuh; run 33 ran the
// same instructions written out in this file), check every value they read and count the wrong
// ones; a wrong protocol could also hang, so run it under `timeout`.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "kernels/cuda/async_copy.cuh"

namespace cg = cooperative_groups;
namespace async = ptllm::cuda::async;

constexpr int kBlocks = 16, kThreads = 256, kRow = 256;

__device__ unsigned long long globalNs() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// st.async of a float4 (async::stAsync stores one float): mode 4 only.
__device__ void stAsync4(uint32_t remote, float4 v, uint32_t remoteBar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, "
      "[%5];" ::"r"(remote),
      "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(__float_as_uint(v.z)),
      "r"(__float_as_uint(v.w)), "r"(remoteBar)
      : "memory");
}

// mode 0: barrier; 1: push (S writers); 2: pull (S values per block); 3: st.async push (S
// writers, one float each); 4: st.async push of S floats as float4s (S / 4 writers).
__global__ void __cluster_dims__(kBlocks, 1, 1) __launch_bounds__(kThreads, 1)
    probe(int mode, int writers, int iters, float* sink, unsigned long long* ns, unsigned* errors) {
  // Every block's slice of the published row; modes 3-4 use one copy per iteration parity.
  __shared__ alignas(16) float rows2[2][kBlocks * kRow];
  float* row = rows2[0];
  __shared__ alignas(8) unsigned long long bars[2];  // modes 3-4: their mbarriers
  cg::cluster_group cluster = cg::this_cluster();
  const unsigned rank = cluster.block_rank();
  const int t = threadIdx.x;
  for (int i = t; i < kBlocks * kRow; i += kThreads) rows2[0][i] = rows2[1][i] = 0.0f;
  if (t == 0) {
    for (int b = 0; b < 2; ++b) async::mbarInit(async::smemAddr(&bars[b]), 1);
    async::mbarFenceInit();
  }
  cluster.sync();
  float acc = 0.0f;
  const unsigned long long t0 = globalNs();
  for (int it = 0; it < iters; ++it) {
    if (mode == 1) {
      if (t < writers) {
        const float v = float(it + t);
        for (unsigned b = 0; b < kBlocks; ++b) cluster.map_shared_rank(row, b)[rank * kRow + t] = v;
      }
      cluster.sync();
      acc += row[((it * 7) % kBlocks) * kRow + (t % writers)];
    } else if (mode == 2) {
      if (t < writers) row[rank * kRow + t] = float(it + t);
      cluster.sync();
      // The block's threads read the whole row (kBlocks * writers floats), strided.
      for (int k = t; k < kBlocks * writers; k += kThreads) {
        const unsigned b = unsigned(k / writers);
        acc += cluster.map_shared_rank(row, b)[b * kRow + k % writers];
      }
      cluster.sync();  // nobody overwrites a slice while another block reads it
    } else if (mode == 3 || mode == 4) {
      const int buf = it & 1;
      const uint32_t bar = async::smemAddr(&bars[buf]);
      // Every block receives kBlocks * writers floats into this buffer for this iteration.
      if (t == 0) async::mbarExpectTx(bar, uint32_t(kBlocks * writers * sizeof(float)));
      const uint32_t slot = async::smemAddr(&rows2[buf][rank * kRow]);
      if (mode == 3 && t < writers) {
        const float v = float(it + t);
        for (unsigned b = 0; b < kBlocks; ++b)
          async::stAsync(async::clusterAddr(slot + 4u * unsigned(t), b), v,
                         async::clusterAddr(bar, b));
      } else if (mode == 4 && t < writers / 4) {
        const float4 v = make_float4(float(it + t), 1.0f, 2.0f, 3.0f);
        for (unsigned b = 0; b < kBlocks; ++b)
          stAsync4(async::clusterAddr(slot + 16u * unsigned(t), b), v, async::clusterAddr(bar, b));
      }
      async::mbarWait<async::Acquire::Cluster>(bar, unsigned(it >> 1) & 1u);
      // Check what arrived (the protocol, not only its time): slice src, element j.
      const int src = (it * 7 + t) % kBlocks, j = t % writers;
      const float got = rows2[buf][src * kRow + j];
      const float want = mode == 3 ? float(it + j) : j % 4 == 0 ? float(it + j / 4) : float(j % 4);
      if (got != want) atomicAdd(errors, 1u);
      acc += got;
      __syncthreads();  // nobody in this block still reads rows2[buf] when it is written again
    } else {
      cluster.sync();
    }
  }
  const unsigned long long t1 = globalNs();
  if (mode >= 3) cluster.sync();  // no block exits while a peer's stores may still target it
  if (rank == 0 && t == 0) *ns = t1 - t0;
  if (acc == -1.0f) sink[t] = acc;  // keep the loads
}

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 2000;
  cudaFuncSetAttribute(probe, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  float* sink;
  unsigned long long* ns;
  unsigned* errors;
  cudaMalloc(&sink, kThreads * sizeof(float));
  cudaMalloc(&ns, sizeof(unsigned long long));
  cudaMalloc(&errors, sizeof(unsigned));
  cudaMemset(errors, 0, sizeof(unsigned));
  struct Case {
    const char* name;
    int mode, writers;
  } cases[] = {{"barrier", 0, 0},     {"push 16", 1, 16},   {"push 64", 1, 64},
               {"push 256", 1, 256},  {"pull 16", 2, 16},   {"pull 64", 2, 64},
               {"pull 256", 2, 256},  {"async 16", 3, 16},  {"async 64", 3, 64},
               {"async 256", 3, 256}, {"async4 16", 4, 16}, {"async4 64", 4, 64},
               {"async4 256", 4, 256}};
  bool anyBad = false;
  for (const Case& c : cases) {
    double best = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
      probe<<<kBlocks, kThreads>>>(c.mode, c.writers, iters, sink, ns, errors);
      if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
        std::printf("probe %s: %s\n", c.name, cudaGetErrorString(e));
        return 1;
      }
      unsigned long long h = 0;
      cudaMemcpy(&h, ns, sizeof h, cudaMemcpyDeviceToHost);
      best = std::min(best, double(h) / iters);
    }
    unsigned bad = 0;
    cudaMemcpy(&bad, errors, sizeof bad, cudaMemcpyDeviceToHost);
    cudaMemset(errors, 0, sizeof(unsigned));
    anyBad = anyBad || bad != 0;
    // pull runs two barriers per iteration; its figure is per iteration (one hand-off).
    std::printf("cluster_probe case=\"%s\" blocks=%d threads=%d ns_per_iter=%.1f wrong_values=%u\n",
                c.name, kBlocks, kThreads, best, bad);
  }
  return anyBad ? 1 : 0;
}
