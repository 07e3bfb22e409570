// The fused decode step (Ops::decodeStepFused): the whole one-token forward of a GPT-2 in one
// launch of one thread-block cluster. The op-by-op step is ~46 small dependent kernels whose
// cost is their launch latency; here the same work is phases of one kernel separated by
// hardware cluster barriers (5 per layer), every intermediate row in L2 or shared memory.
//
// Phases, per layer (x is the residual stream in global memory):
//   1. each block: LayerNorm(x) into shared memory; qkv = ln @ W_attn + b -> cache row pos
//   2. block h (< NH): attention of head h over cache rows 0..pos -> y
//   3. each block: y -> shared; x[n] += y @ W_proj + b (a column per warp, written once)
//   4. each block: LayerNorm(x) -> shared; h = gelu(ln @ W_fc + b)
//   5. each block: h -> shared; x[n] += h @ W_fcproj + b
// then LayerNorm(x) and the tied head (logits = lnf @ wte^T).
//
// Every element is computed exactly as the op kernels compute it (same operands, same order,
// same rounding), so the logits are bit-identical to the op-by-op step:
//   - LayerNorm and GELU call the op kernels' own code (decode_math.cuh), attention the decode
//     attention's (attention_decode.cuh);
//   - an f16-storage linear repeats matmulF16's M = 1 GEMV (matmul_storage.cu): a warp per
//     output column, lane l accumulating vectors l, l+32, ... of the packed row in order,
//     elements in order, the butterfly warp sum, fmaf(sum, 1, bias); only the load schedule
//     differs (several columns' weights in flight per warp);
//   - an f32 linear repeats launchMatmul's M <= 8 GEMV (ops_matmul.cu): 32 columns per block,
//     warp w summing k = w, w+8, ..., the 8 partial sums added in warp order, then the bias;
//   - the head repeats matmulAbt's M <= 8 kernel: a warp per vocabulary row, lanes over k;
//   - the residual adds and the embedding are single f32 adds, as in add / embeddingStep.
// Data written in the launch and read by other blocks goes through L2 (ld.global.cg) after a
// cluster barrier (release/acquire at cluster scope).
#include <cooperative_groups.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/attention_decode.cuh"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_reduce.cuh"
#include "kernels/cuda/decode_math.cuh"
#include "kernels/cuda/ops_kernels.cuh"
#include "kernels/cuda/storage_formats.cuh"
#include "kernels/ops.h"

namespace ptllm::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = decode::kThreads;  // the attention's block shape
constexpr int kWarps = kThreads / 32;
constexpr int kMaxC = 2048;     // shared memory holds one row of 4C floats
constexpr int kMaxLayers = 24;  // the layer table travels in the kernel's parameters
constexpr int kPortableCluster = 8;
constexpr int kMaxCluster = 16;  // non-portable; used only where the device allows it
constexpr int kGemvLoads = 8;    // 16-byte weight loads in flight per lane (as matmulF16)

struct StepLinear {
  const void* w;
  const float* b;
  int f16;
};
struct StepLayer {
  const float *ln1w, *ln1b, *ln2w, *ln2b;
  StepLinear attn, proj, fc, fcProj;
  float* cache;
};
struct StepParams {
  int C, NH, V, maxT, nLayer;
  const float *wte, *wpe, *lnfw, *lnfb;
  const int32_t* step;
  float *x, *y, *h, *att, *logits;
  StepLayer layers[kMaxLayers];
};
static_assert(sizeof(StepParams) <= 4096, "kernel parameters");

struct StepSmem {
  union {
    float row[4 * kMaxC];  // the current linear's input: a LayerNorm output, y or h
    decode::Smem att;
  };
  float red[kWarps][33];  // the f32 GEMV's per-warp partial sums
  float stats[2];         // LayerNorm mean, rstd
};

enum class Epi { Store, Residual, Gelu };

// out[n] = v (Store), out[n] += v (Residual: the add op's one rounding), gelu(v) (Gelu).
__device__ __forceinline__ void epilogue(Epi e, float* out, int n, float v) {
  if (e == Epi::Store)
    out[n] = v;
  else if (e == Epi::Residual)
    out[n] = __fadd_rn(__ldcg(out + n), v);
  else
    out[n] = geluTanh(v);
}

// dst[0, n) = src[0, n) for every block (src written earlier in this launch: read from L2).
__device__ void loadRow(float* dst, const float* src, int n) {
  for (int i = threadIdx.x; i < n; i += kThreads) dst[i] = __ldcg(src + i);
  __syncthreads();
}

// x = wte[tok] + wpe[pos] into shared memory (block 0 also stores the residual stream).
__device__ void embed(StepSmem& sm, const StepParams& p, int tok, int pos) {
  for (int c = threadIdx.x; c < p.C; c += kThreads) {
    const float v = __ldg(p.wte + (int64_t)tok * p.C + c) + __ldg(p.wpe + (int64_t)pos * p.C + c);
    sm.row[c] = v;
    if (blockIdx.x == 0) p.x[c] = v;
  }
  __syncthreads();
}

// sm.row[0, C) = LayerNorm(sm.row[0, C)): warp 0 the statistics, every thread the elements.
__device__ void layernormRow(StepSmem& sm, const float* w, const float* b, int C) {
  if (threadIdx.x < 32) {
    float mu, rs;
    layernormRowStats(sm.row, C, threadIdx.x, mu, rs);
    if (threadIdx.x == 0) {
      sm.stats[0] = mu;
      sm.stats[1] = rs;
    }
  }
  __syncthreads();
  const float mu = sm.stats[0], rs = sm.stats[1];
  for (int c = threadIdx.x; c < C; c += kThreads)
    sm.row[c] = layernormApply(sm.row[c], mu, rs, __ldg(w + c), __ldg(b + c));
  __syncthreads();
}

// f16-storage linear, out[n] (epi) fmaf(sum_k xs[k] w[n][k], 1, bias[n]) over every warp of the
// cluster: CB = kGemvLoads / VPL columns per warp at a time, VPL vectors per lane per column
// in flight, so nvec <= 32 * VPL needs one round (more rounds in order otherwise).
template <int VPL>
__device__ void gemvF16(const float* xs, const unsigned char* w, const float* bias, int K, int N,
                        Epi epi, float* out) {
  constexpr int CB = kGemvLoads / VPL, E = perVec<Fmt::F16>();
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), W = gridDim.x * kWarps;
  const int Kp = (K + 63) / 64 * 64;  // paddedK (cuda_paths.h)
  const int nvec = Kp / E;
  for (int n0 = gw * CB; n0 < N; n0 += W * CB) {
    float acc[CB];
#pragma unroll
    for (int c = 0; c < CB; ++c) acc[c] = 0.f;
    for (int v0 = 0; v0 < nvec; v0 += 32 * VPL) {
      uint4 wv[CB][VPL];
#pragma unroll
      for (int c = 0; c < CB; ++c) {
        const int n = n0 + c;
        const uint4* row = reinterpret_cast<const uint4*>(w + size_t(n < N ? n : 0) * Kp * 2);
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
          const int v = v0 + lane + 32 * i;
          wv[c][i] = n < N && v < nvec ? loadStreaming(row + v) : make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int c = 0; c < CB; ++c) {
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
          const int k0 = (v0 + lane + 32 * i) * E;
          if (k0 >= K) continue;  // padding (zeros) or past the row
          float wf[E];
          unpackVec<Fmt::F16>(wv[c][i], wf);
#pragma unroll
          for (int j = 0; j < E; ++j)
            if (k0 + j < K) acc[c] = fmaf(xs[k0 + j], wf[j], acc[c]);
        }
      }
    }
#pragma unroll
    for (int c = 0; c < CB; ++c) {
      const int n = n0 + c;
      const float sum = warpSum(acc[c]);
      if (lane == 0 && n < N) epilogue(epi, out, n, fmaf(sum, 1.f, bias[n]));
    }
  }
}

// f32 linear (w[K,N]): column groups of 32 over the blocks; lane = column, warp w sums
// k = w, w+8, ...; the 8 partial sums meet in shared memory, added in warp order, then the bias.
__device__ void gemvF32(StepSmem& sm, const float* xs, const float* w, const float* bias, int K,
                        int N, Epi epi, float* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int groups = (N + 31) / 32;
  for (int g = blockIdx.x; g < groups; g += gridDim.x) {
    const int n = g * 32 + lane;
    float acc = 0.0f;
    if (n < N) {
#pragma unroll 8
      for (int k = warp; k < K; k += kWarps) acc = fmaf(xs[k], __ldg(w + (int64_t)k * N + n), acc);
    }
    sm.red[warp][lane] = acc;
    __syncthreads();
    if (warp == 0 && n < N) {
      float s = 0.0f;
#pragma unroll
      for (int p = 0; p < kWarps; ++p) s += sm.red[p][lane];
      s += bias[n];
      epilogue(epi, out, n, s);
    }
    __syncthreads();  // red is reused by the next group
  }
}

__device__ void linear(StepSmem& sm, const StepLinear& l, int K, int N, Epi epi, float* out) {
  if (l.f16) {
    const auto* w = static_cast<const unsigned char*>(l.w);
    const int nvec = (K + 63) / 64 * 64 / perVec<Fmt::F16>();
    if (nvec <= 32)
      gemvF16<1>(sm.row, w, l.b, K, N, epi, out);
    else if (nvec <= 64)
      gemvF16<2>(sm.row, w, l.b, K, N, epi, out);
    else if (nvec <= 128)
      gemvF16<4>(sm.row, w, l.b, K, N, epi, out);
    else
      gemvF16<8>(sm.row, w, l.b, K, N, epi, out);
  } else {
    gemvF32(sm, sm.row, static_cast<const float*>(l.w), l.b, K, N, epi, out);
  }
}

// logits[n] = sum_k xs[k] wte[n][k]: a warp per vocabulary row over the cluster, lanes over k.
__device__ void head(const StepSmem& sm, const StepParams& p) {
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), W = gridDim.x * kWarps;
  for (int n = gw; n < p.V; n += W) {
    const float* brow = p.wte + (int64_t)n * p.C;
    float acc = 0.0f;
#pragma unroll 8
    for (int k = lane; k < p.C; k += 32) acc = fmaf(sm.row[k], __ldg(brow + k), acc);
    const float s = warpSum(acc);
    if (lane == 0) p.logits[n] = s;
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    decodeStepKernel(const __grid_constant__ StepParams p) {
  __shared__ StepSmem sm;
  cg::cluster_group cluster = cg::this_cluster();
  const int C = p.C, tok = p.step[0], pos = p.step[1], hs = C / p.NH;
  const int64_t stride = 3 * (int64_t)C;
  for (int l = 0; l < p.nLayer; ++l) {
    const StepLayer& L = p.layers[l];
    if (l == 0)
      embed(sm, p, tok, pos);
    else
      loadRow(sm.row, p.x, C);
    layernormRow(sm, L.ln1w, L.ln1b, C);
    linear(sm, L.attn, C, 3 * C, Epi::Store, L.cache + pos * stride);
    cluster.sync();
    for (int h = blockIdx.x; h < p.NH; h += gridDim.x) {
      decode::query(sm.att, p.y + h * hs, p.att + (int64_t)h * p.maxT, L.cache + h * hs, stride,
                    pos + 1, C, hs);
      __syncthreads();  // sm.att is reused by the next head
    }
    cluster.sync();
    loadRow(sm.row, p.y, C);
    linear(sm, L.proj, C, C, Epi::Residual, p.x);
    cluster.sync();
    loadRow(sm.row, p.x, C);
    layernormRow(sm, L.ln2w, L.ln2b, C);
    linear(sm, L.fc, C, 4 * C, Epi::Gelu, p.h);
    cluster.sync();
    loadRow(sm.row, p.h, 4 * C);
    linear(sm, L.fcProj, 4 * C, C, Epi::Residual, p.x);
    cluster.sync();
  }
  if (p.nLayer == 0)
    embed(sm, p, tok, pos);
  else
    loadRow(sm.row, p.x, C);
  layernormRow(sm, p.lnfw, p.lnfb, C);
  head(sm, p);
}

cudaLaunchConfig_t clusterLaunch(int blocks, cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(blocks));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream();
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = unsigned(blocks);
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

StepLinear stepLinear(const Ops::DecodeLinear& l) {
  return {l.w, l.b, l.f16Storage ? 1 : 0};
}

}  // namespace

int decodeStepMaxBlocks() {
  // Asked once per process (the first CudaOps, outside any capture): the largest cluster the
  // device will co-schedule, 16 (non-portable) or 8; 0 when clusters are unavailable.
  static const int blocks = [] {
    if (cudaFuncSetAttribute(decodeStepKernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) !=
        cudaSuccess)
      cudaGetLastError();  // then only portable sizes
    for (int b : {kMaxCluster, kPortableCluster}) {
      cudaLaunchAttribute attr;
      const cudaLaunchConfig_t cfg = clusterLaunch(b, &attr);
      int clusters = 0;
      if (cudaOccupancyMaxActiveClusters(&clusters, decodeStepKernel, &cfg) == cudaSuccess &&
          clusters > 0)
        return b;
      cudaGetLastError();
    }
    return 0;
  }();
  return blocks;
}

int launchDecodeStep(const Ops::DecodeStepArgs& a) {
  const int maxBlocks = decodeStepMaxBlocks();
  const int nLayer = int(a.layers.size());
  if (maxBlocks == 0 || a.C < 1 || a.C > kMaxC || a.NH < 1 || a.C % a.NH != 0 ||
      a.C / a.NH > decode::kMaxHs || a.maxT < 1 || a.maxT > decode::kMaxTk || a.V < 1 ||
      nLayer > kMaxLayers)
    return 0;
  StepParams p = {};
  p.C = a.C;
  p.NH = a.NH;
  p.V = a.V;
  p.maxT = a.maxT;
  p.nLayer = nLayer;
  p.wte = a.wte;
  p.wpe = a.wpe;
  p.lnfw = a.lnfw;
  p.lnfb = a.lnfb;
  p.step = a.step;
  p.x = a.x;
  p.y = a.y;
  p.h = a.h;
  p.att = a.att;
  p.logits = a.logits;
  for (int l = 0; l < nLayer; ++l) {
    const Ops::DecodeLayer& s = a.layers[size_t(l)];
    StepLayer& d = p.layers[l];
    d.ln1w = s.ln1w;
    d.ln1b = s.ln1b;
    d.ln2w = s.ln2w;
    d.ln2b = s.ln2b;
    d.attn = stepLinear(s.attn);
    d.proj = stepLinear(s.proj);
    d.fc = stepLinear(s.fc);
    d.fcProj = stepLinear(s.fcProj);
    d.cache = s.cache;
  }
  // Default: the largest cluster the device co-schedules; the bench compares it with 8
  // (docs/performance.md has the figures).
  const int blocks = std::min(a.clusterBlocks > 0 ? a.clusterBlocks : maxBlocks, maxBlocks);
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = clusterLaunch(blocks, &attr);
  PTLLM_CUDA_CHECK(cudaLaunchKernelEx(&cfg, decodeStepKernel, p));
  return blocks;
}

}  // namespace ptllm::cuda
