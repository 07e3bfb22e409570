// What one cluster barrier of the fused decode step costs, and what the rows it publishes add:
// a 16-block cluster (the step's launch) of 256 threads loops `iters` times over
//   barrier   : barrier.cluster arrive + wait alone,
//   push S    : S threads of each block store one float into all 16 blocks' shared memory
//               (st.shared::cluster, as the step publishes a GEMV's outputs), then the barrier,
//   pull S    : S threads store one float locally, the barrier, then every thread of the block
//               reads S/16.. floats back from all 16 blocks (ld.shared::cluster) and sums them,
//               the other way to hand a row to every block,
// and prints ns per iteration from %globaltimer in block 0. Not part of the build (CI has no
// GPU): bench/gpu_decode_session.sh does not run it; a device call does
//   nvcc -O3 -arch=sm_90 -o /tmp/probe bench/cluster_barrier_probe.cu && /tmp/probe
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace cg = cooperative_groups;

constexpr int kBlocks = 16, kThreads = 256, kRow = 256;

__device__ unsigned long long globalNs() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// mode 0: barrier; 1: push (S writers); 2: pull (S values per block).
__global__ void __cluster_dims__(kBlocks, 1, 1) __launch_bounds__(kThreads, 1)
    probe(int mode, int writers, int iters, float* sink, unsigned long long* ns) {
  __shared__ float row[kBlocks * kRow];  // every block's slice of the published row
  cg::cluster_group cluster = cg::this_cluster();
  const unsigned rank = cluster.block_rank();
  const int t = threadIdx.x;
  for (int i = t; i < kBlocks * kRow; i += kThreads) row[i] = 0.0f;
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
    } else {
      cluster.sync();
    }
  }
  const unsigned long long t1 = globalNs();
  if (rank == 0 && t == 0) *ns = t1 - t0;
  if (acc == -1.0f) sink[t] = acc;  // keep the loads
}

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 2000;
  cudaFuncSetAttribute(probe, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  float* sink;
  unsigned long long* ns;
  cudaMalloc(&sink, kThreads * sizeof(float));
  cudaMalloc(&ns, sizeof(unsigned long long));
  struct Case {
    const char* name;
    int mode, writers;
  } cases[] = {{"barrier", 0, 0},  {"push 16", 1, 16}, {"push 64", 1, 64},  {"push 256", 1, 256},
               {"pull 16", 2, 16}, {"pull 64", 2, 64}, {"pull 256", 2, 256}};
  for (const Case& c : cases) {
    double best = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
      probe<<<kBlocks, kThreads>>>(c.mode, c.writers, iters, sink, ns);
      if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
        std::printf("probe %s: %s\n", c.name, cudaGetErrorString(e));
        return 1;
      }
      unsigned long long h = 0;
      cudaMemcpy(&h, ns, sizeof h, cudaMemcpyDeviceToHost);
      best = std::min(best, double(h) / iters);
    }
    // pull runs two barriers per iteration; its figure is per iteration (one hand-off).
    std::printf("cluster_probe case=\"%s\" blocks=%d threads=%d ns_per_iter=%.1f\n", c.name,
                kBlocks, kThreads, best);
  }
  return 0;
}
