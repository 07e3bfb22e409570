// Asynchronous copies into shared memory (sm_80 cp.async; sm_90 TMA and the mbarriers it
// completes on), for kernels that stream operands without registers in between: the mma.sync
// GEMM's tiles (matmul_tensor_core.cu) and the wgmma GEMM's TMA tiles
// (matmul_tensor_core_sm90a.cu). (A GEMV that bulk-copied its rows into shared memory
// measured slower than the register schedules: docs/performance.md, run 10.)
#pragma once

#include <cuda.h>

#include <cstdint>

namespace ptllm::cuda::async {

__device__ inline uint32_t smemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- per-thread 16-byte copies (cp.async.cg: through L2), completing per thread ----
// valid == false writes 16 zero bytes instead.
__device__ inline void cpAsync16(void* dst, const void* src, bool valid = true) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smemAddr(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ inline void cpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ inline void cpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- mbarriers ----
__device__ inline void mbarInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
// Makes initialised barriers visible to the copy engine (and, in a cluster, to the peers).
__device__ inline void mbarFenceInit() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ inline void mbarExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
// Waits until the barrier's phase of `parity` has completed. Acquire::Cta (try_wait's default
// semantics) for the CTA's own arrivals and copies; Acquire::Cluster where other CTAs' stAsync
// stores complete on it, so that what they stored is visible after.
enum class Acquire { Cta, Cluster };
template <Acquire kScope = Acquire::Cta>
__device__ inline void mbarWait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    if constexpr (kScope == Acquire::Cluster)
      asm volatile(
          "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], "
          "%2;\n selp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(bar), "r"(parity)
          : "memory");
    else
      asm volatile(
          "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
          " selp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(bar), "r"(parity)
          : "memory");
  } while (!done);
}
__device__ inline void mbarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrive on the barrier at the same shared-memory offset in CTA `rank` of the cluster (this CTA
// included): release at cluster scope orders this thread's completed reads before it.
__device__ inline void mbarArriveCluster(uint32_t bar, uint32_t rank) {
  asm volatile(
      "{\n .reg .b32 remote;\n mapa.shared::cluster.u32 remote, %0, %1;\n"
      " mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
      "r"(rank)
      : "memory");
}

// ---- copies into shared memory, completing on an mbarrier ----
// A 2-D box (x = inner coordinate, y = row) of a tensor map.
__device__ inline void tmaLoad(uint32_t dst, const CUtensorMap* map, int x, int y, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}
// The same box written at offset dst of every CTA in ctaMask, each one's barrier at offset bar.
__device__ inline void tmaLoadMulticast(uint32_t dst, const CUtensorMap* map, int x, int y,
                                        uint32_t bar, uint16_t ctaMask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar), "h"(ctaMask)
      : "memory");
}

// ---- stores into another CTA of the cluster, completing on its mbarrier ----
// The shared::cluster address of shared-memory offset `addr` in CTA `rank` of the cluster. Not
// volatile: a pure address computation, which the compiler may hoist out of a store loop.
__device__ inline uint32_t clusterAddr(uint32_t addr, uint32_t rank) {
  uint32_t remote;
  asm("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
  return remote;
}
// v into `remote` (a clusterAddr), its 4 bytes completed on the mbarrier `remoteBar` of the same
// CTA: the receiver waits on its barrier (mbarWait<Acquire::Cluster>) instead of a cluster barrier.
// Measured on the H200 (bench/cluster_barrier_probe.cu): 16 x 16 floats handed to all 16 CTAs
// this way in 0.34 us, against 0.70 us as plain remote stores and a cluster barrier.
__device__ inline void stAsync(uint32_t remote, float v, uint32_t remoteBar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(remote),
      "r"(__float_as_uint(v)), "r"(remoteBar)
      : "memory");
}
}  // namespace ptllm::cuda::async
