// The fused decode step (Ops::decodeStepFused): the whole one-token forward of a GPT-2 in one
// launch of one thread-block cluster. The op-by-op step is ~46 small dependent kernels whose
// cost is their launch latency; here the same work is phases of one kernel separated by
// hand-offs (5 per layer: hardware cluster barriers, or in form 4 mbarriers that the rows'
// stores complete), every intermediate row in L2 or shared memory.
//
// Phases, per layer (x is the residual stream in global memory):
//   1. each block: LayerNorm(x) into shared memory; qkv = ln @ W_attn + b -> cache row pos
//   2. block h (< NH): attention of head h over cache rows 0..pos -> y
//   3. each block: y -> shared; x[n] += y @ W_proj + b (a column per warp, written once)
//   4. each block: LayerNorm(x) -> shared; h = gelu(ln @ W_fc + b)
//   5. each block: h -> shared; x[n] += h @ W_fcproj + b
// then LayerNorm(x) and the tied head (logits = lnf @ wte^T), and where asked the greedy pick
// (greedyTail; form 4 can also go on to the next token's step in the same launch).
//
// Every element is computed exactly as the op kernels compute it (same operands, same order,
// same rounding), so the logits are bit-identical to the op-by-op step:
//   - LayerNorm and GELU call the op kernels' own code (decode_math.cuh), attention the decode
//     attention's (attention_decode.cuh);
//   - an f16-storage linear repeats matmulF16's M = 1 GEMV (matmul_storage.cu): a warp per
//     output column, lane l accumulating vectors l, l+32, ... of the packed row in order,
//     elements in order, the butterfly warp sum, fmaf(sum, 1, bias); only the load schedule
//     differs (several columns' weights in flight per warp, their butterflies shared out over
//     the lanes: scatterSum);
//   - an f32 linear repeats launchMatmul's M <= 8 GEMV (ops_matmul.cu): 32 columns per block,
//     warp w summing k = w, w+8, ..., the 8 partial sums added in warp order, then the bias;
//   - the head repeats matmulAbt's M <= 8 kernel: a warp per vocabulary row, lanes over k;
//   - the residual adds and the embedding are single f32 adds, as in add / embeddingStep.
// Data written in the launch and read by other blocks goes through L2 (ld.global.cg) after a
// cluster barrier (release/acquire at cluster scope).
#include <cooperative_groups.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cuda/async_copy.cuh"
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
  // Forms 2-4: the head's cached key and value rows staged in shared memory (stageHeadRows):
  // rows of stageRs floats from float stageOff of the dynamic shared memory, keys then values
  // (maxT rows each); stageRs 0: read from global memory.
  int stageRs, stageOff;
  // With the stage, where C and the head size are powers of two: the qkv epilogue (f16 or f32
  // linear) also puts head h's query, key and value into block h's shared memory
  // (Dest::stage), so its attention reads none of them through L2 (run 27).
  int qkvShared;
  // Form 4 with the stage and NH * nLayer <= blocks: block l * NH + h attends head h of layer l
  // and keeps that pair's key and value rows in its stage for the whole launch (staged once at
  // its start; row pos stored there by the qkv phase), so no layer re-stages its rows.
  int resident;
  // Form 4 with greedy tokens: greedy steps this launch runs (1: one step). With more, the
  // step's logits are handed to every block's shared memory (float logitsOff of the dynamic
  // shared memory, V floats) and every block makes the pick itself, then runs the next step.
  int steps, logitsOff;
  const float *wte, *wpe, *lnfw, *lnfb;
  const int32_t* step;
  float *x, *y, *h, *att, *logits;
  // DecodeStepArgs::greedyTokens: the pick's token row and the step (writable), or null.
  int32_t *tokens, *advance;
  unsigned long long* prof;  // PTLLM_DECODE_PROFILE: clock64 deltas per point and block, or null
  // A speculative greedy run (decodeStepKernel2<kAsyncHandoff, true>; DecodeStepArgs::
  // speculativeLanes): `lanes` clusters side by side (blockIdx.y), lane c running the step of
  // the token at base position + c; its scratch x, y, h, att and logits at the pointers above
  // + c * laneFloats. spec: the run's state and synchronisation (the kSpec* words), hist: the token
  // at every position (those below the start given, the run appends), specLogits: where the
  // last emitted pick's logits go.
  int lanes, laneFloats;
  int32_t *spec, *hist;
  float* specLogits;
  int32_t* specStats;  // or null: += {verify steps, tokens emitted}, = lanes, at the run's end
  StepLayer layers[kMaxLayers];
};
static_assert(sizeof(StepParams) <= 4096, "kernel parameters");

struct alignas(16) StepSmem {  // row: 16-byte loads (loadInputs)
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

// The E = 8 inputs xs[k0, k0 + E) of one packed f16 weight vector into registers, read once for
// all of a warp's columns: two 16-byte shared loads where the whole vector lies below K (xs
// 16-byte aligned, k0 a multiple of E), else element-wise with zeros past K (whose products the
// callers skip). Element-wise reads at the lanes' 32-byte stride were an 8-way bank conflict
// each, repeated for every column: 8 warps x CB columns x 8 loads x 8 wavefronts per vector,
// ~2 us of the shared-memory pipe per linear at CB = 8 (run 41: the bundled model's linears
// 0.8-1.9 -> 0.5-1.0 us each, 57.0 -> 42.9 us/token).
__device__ __forceinline__ void loadInputs(const float* xs, int k0, int K, float (&x)[8]) {
  static_assert(perVec<Fmt::F16>() == 8, "an f16 vector is 8 elements");
  if (k0 + 8 <= K) {
    const float4 a = *reinterpret_cast<const float4*>(xs + k0);
    const float4 b = *reinterpret_cast<const float4*>(xs + k0 + 4);
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
    x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = k0 + j < K ? xs[k0 + j] : 0.f;
  }
}

// acc[c] += x[j] * w_c[j] in order, j < valid, for the CB columns' vector i (wv[c][i]). The
// whole-vector case (every vector but a row's last where K is not a multiple of 8) has no
// per-element test.
template <int CB, int VPL>
__device__ __forceinline__ void columnsFma(float (&acc)[CB], const uint4 (&wv)[CB][VPL], int i,
                                           const float (&x)[8], int valid) {
  auto fmas = [&](auto whole) {
#pragma unroll
    for (int c = 0; c < CB; ++c) {
      float wf[8];
      unpackVec<Fmt::F16>(wv[c][i], wf);
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (decltype(whole)::value || j < valid) acc[c] = fmaf(x[j], wf[j], acc[c]);
    }
  };
  if (valid == 8)
    fmas(std::true_type{});
  else
    fmas(std::false_type{});
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
      // Per column the products still go in order: vector i = 0, 1, ..., elements in order.
#pragma unroll
      for (int i = 0; i < VPL; ++i) {
        const int k0 = (v0 + lane + 32 * i) * E;
        if (k0 >= K) continue;  // padding (zeros) or past the row
        float x[E];
        loadInputs(xs, k0, K, x);
        columnsFma<CB>(acc, wv, i, x, k0 + E <= K ? E : K - k0);
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

// The greedy pick over logits [0, V) by one warp, every lane returning it: each lane keeps the
// first largest non-NaN logit of its strided share, then a butterfly of the kept pairs in the
// pick's order (decode_math.cuh): greedyAdvanceKernel's token. load(v) reads logit v.
template <class Load>
__device__ __forceinline__ int warpGreedyPick(int V, Load load) {
  const int lane = int(threadIdx.x & 31);
  float best = -INFINITY;
  int arg = -1;  // -1: nothing seen (all NaN so far)
  for (int v = lane; v < V; v += 32) pickConsider(best, arg, load(v), v);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ob = __shfl_xor_sync(kFullMask, best, o);
    const int oi = __shfl_xor_sync(kFullMask, arg, o);
    pickMerge(best, arg, ob, oi);
  }
  return pickToken(load(0), arg);
}

// Ops::greedyAdvance at the end of the step (DecodeStepArgs::greedyTokens), called by every
// thread once the step's logits are written: a cluster barrier, then warp 0 of block 0 picks.
__device__ void greedyTail(const StepParams& p, int pos) {
  if (!p.tokens) return;
  cg::this_cluster().sync();  // every block's logits, visible at cluster scope
  if (blockIdx.x != 0 || threadIdx.x >= 32) return;
  const int next = warpGreedyPick(p.V, [&](int v) { return __ldcg(p.logits + v); });
  if (threadIdx.x == 0) {
    p.tokens[pos] = next;
    p.advance[0] = next;
    p.advance[1] = pos + 1;
  }
}

// ---- the profile (PTLLM_DECODE_PROFILE=1): a timeline of thread 0 of every block ----
// Each stamp adds clock64 since the block's start (a launch of several steps: since the step's
// start) into shared memory (no memory traffic inside the step, so the stamps do not hold back
// the barriers' release), and counts the mark; the launch's end adds the marks into a device
// buffer, per mark, lane and block. A multi-step launch's marks are so the mean step. A mark's
// point names the phase that ended there; the printout gives every mark's time (block 0, and
// the earliest and latest block with their ranks; a speculative run: the latest block of every
// lane) and the points summed over layers.
// Points: 0 LayerNorm 1 (with the embedding or the row load), 1 qkv, 2 barrier, 3 attention,
// 4 barrier, 5 proj (with its row load), 6 barrier, 7 LayerNorm 2, 8 fc, 9 barrier, 10 fcProj
// (with its row load), 11 barrier, 12 final LayerNorm, 13 head; a speculative run's own: 14 the
// qkv flag published and the lower lanes' rows read, 15 every lane's pick read, 16 the next
// drafts.
constexpr int kMaxLanes = Ops::DecodeStepArgs::kMaxSpeculativeLanes;
constexpr int kProfPoints = 17;
constexpr int kTraceMarks = 128;  // marks kept per step (12 per layer and 2 more per step)
// Buffer: sums [kTraceMarks][kMaxLanes][kMaxCluster], the marks' points [kTraceMarks], the
// most marks a step made, the steps that made each mark [kTraceMarks] (a mark's mean is over
// those), the launch count. The speculative kernel adds into a second such buffer.
constexpr int kProfIds = kTraceMarks * kMaxLanes * kMaxCluster;
constexpr int kProfCounts = kProfIds + kTraceMarks + 1;
constexpr int kProfSlots = kProfCounts + kTraceMarks + 1;

struct Trace {
  long long t0;
  int n;
  long long* ts;
  unsigned char* ids;
  unsigned short* counts;
};

// Thread 0: the marks' sums and counts start at zero.
__device__ __forceinline__ void startTrace(const StepParams& p, Trace& t) {
  if (p.prof && threadIdx.x == 0)
    for (int i = 0; i < kTraceMarks; ++i) t.ts[i] = 0, t.counts[i] = 0;
}

// A multi-step launch: the step's marks count from here.
__device__ __forceinline__ void startStepTrace(const StepParams& p, Trace& t) {
  if (p.prof && threadIdx.x == 0) t.t0 = clock64(), t.n = 0;
}

__device__ __forceinline__ void stamp(const StepParams& p, Trace& t, int point) {
  if (p.prof && threadIdx.x == 0 && t.n < kTraceMarks) {
    t.ts[t.n] += clock64() - t.t0;
    t.ids[t.n] = static_cast<unsigned char>(point);
    ++t.counts[t.n];
    ++t.n;
  }
}

__device__ void flushTrace(const StepParams& p, const Trace& t) {
  if (!p.prof || threadIdx.x != 0) return;
  for (int i = 0; i < kTraceMarks && t.counts[i] > 0; ++i)
    atomicAdd(p.prof + (i * kMaxLanes + blockIdx.y) * kMaxCluster + blockIdx.x,
              (unsigned long long)t.ts[i]);
  if (blockIdx.x == 0 && blockIdx.y == 0) {
    int marks = 0;
    for (int i = 0; i < kTraceMarks && t.counts[i] > 0; ++i, ++marks) {
      p.prof[kProfIds + i] = t.ids[i];
      atomicAdd(p.prof + kProfCounts + i, (unsigned long long)t.counts[i]);
    }
    atomicMax(p.prof + kProfIds + kTraceMarks, (unsigned long long)marks);
    atomicAdd(p.prof + kProfSlots - 1, 1ull);
  }
}

#define PTLLM_DECODE_TRACE(t)                                            \
  __shared__ long long traceTs[kTraceMarks];                             \
  __shared__ unsigned char traceIds[kTraceMarks];                        \
  __shared__ unsigned short traceCounts[kTraceMarks];                    \
  Trace t = {p.prof ? clock64() : 0, 0, traceTs, traceIds, traceCounts}; \
  startTrace(p, t)

// ---- the second form (the default): rows in distributed shared memory, loads before barriers --
// Same phases, barriers and per-element arithmetic as decodeStepKernel; what moves is where the
// rows live and when the read-only operands are fetched:
//   - every block holds the whole residual x (xs), the current linear input (lnY: a LayerNorm
//     output or y) and h (hb) in its own shared memory; the block that computes an element of
//     y, h or x stores it into every block's copy (st.shared::cluster), so after a barrier no
//     block reads its next input from L2 (the global x, y, h are still written, as outputs);
//   - each linear issues its first round of weight and bias loads, and the LayerNorm before it
//     its w and b, before the barrier that makes its input final, so that latency overlaps
//     the barrier (an L1 prefetch of the next phase's weights instead was measured slower:
//     bench/results/cuda-20261203-1343.txt);
//   - where every block has at most one head of size 32 or 64 and it fits, block h copies its
//     head's cached key and value rows 0..pos-1 of the next layer into shared memory (the
//     stage, cp.async) a phase ahead, and attends from there; row pos and the query, which
//     this launch writes, are read through L2 after the barrier, or (qkvShared) stored into
//     the stage and the attention's q by the qkv phase itself. Measured: attention 15.8 ->
//     12.3 us per step, but the copies' issue sits on the same blocks' path (~100 KB per
//     layer at the SM's L2 bandwidth), so the step gains ~0.6 us
//     (bench/results/cuda-20261204-1555.txt); qkvShared 12.1 -> 10.75 (run 27).
// Buffers are reused only across a barrier: lnY is written remotely in the attention phase
// (y) and locally in the LayerNorm phases; hb (shared with the attention's scratch, whose q
// the qkv phase writes remotely) remotely in the fc phase; xs remotely in the two residual
// phases; each is read only in the phase after its writes. The stage is its owner's alone
// (but for row pos, which the qkv phase may write remotely): written by the copies and row
// pos, read by its attention, rewritten only after it.
__host__ __device__ constexpr int rowFloats(int C) {
  return (C + 3) / 4 * 4;
}
__host__ __device__ constexpr int hbFloats(int C) {
  return 4 * rowFloats(C) > int((sizeof(decode::Smem) + 15) / 16 * 4)
             ? 4 * rowFloats(C)
             : int((sizeof(decode::Smem) + 15) / 16 * 4);
}
__host__ __device__ constexpr int smem2Floats(int C) {
  return 2 * rowFloats(C) + hbFloats(C) + kWarps * 33;
}

// Starts the copies (cp.async, one group) of head h's cached key and value rows 0..rows-1 of
// `cache` into the stage: they were written by earlier steps, so the copy runs while the block
// does other work, and attendStaged waits for it. Consecutive threads copy consecutive 16-byte
// pieces of a row.
template <int HS>
__device__ void stageHeadRows(const StepParams& p, float* base, const float* cache, int h,
                              int rows) {
  constexpr int kPieces = HS / 4;
  const int C = p.C, rs = p.stageRs;
  const int64_t stride = 3 * (int64_t)C;
  float* stage = base + p.stageOff;
  for (int i = threadIdx.x; i < rows * 2 * kPieces; i += kThreads) {
    const int row = i / (2 * kPieces), part = i / kPieces % 2, c = i % kPieces;
    async::cpAsync16(stage + (part * p.maxT + row) * rs + 4 * c,
                     cache + row * stride + (1 + part) * C + h * HS + 4 * c);
  }
  async::cpAsyncCommit();
}
// This block's rows to stage: head blockIdx.x of `cache` (forms 2-4), or with p.resident the
// block's own (layer, head) pair, whose rows stay for the launch.
__device__ __forceinline__ void stageRows(const StepParams& p, float* base, const float* cache,
                                          int h, int rows) {
  if (p.C / p.NH == 64)
    stageHeadRows<64>(p, base, cache, h, rows);
  else
    stageHeadRows<32>(p, base, cache, h, rows);
}
__device__ __forceinline__ void stageHead(const StepParams& p, float* base, const float* cache,
                                          int pos) {
  if (!p.stageRs || p.resident || int(blockIdx.x) >= p.NH) return;
  stageRows(p, base, cache, int(blockIdx.x), pos);
}
__device__ __forceinline__ void stageResident(const StepParams& p, float* base, int pos) {
  const int b = int(blockIdx.x);
  if (!p.resident || b >= p.NH * p.nLayer) return;
  stageRows(p, base, p.layers[b / p.NH].cache, b % p.NH, pos);
}

// Rows row0 .. row0 + rows - 1 of head h of `cache`, written in this launch, into the stage
// through L2 (plain loads: the caller's next block barrier publishes them).
__device__ __forceinline__ void loadStageRows(const StepParams& p, float* base, const float* cache,
                                              int h, int row0, int rows) {
  const int C = p.C, hs = C / p.NH, rs = p.stageRs;
  const int64_t stride = 3 * (int64_t)C;
  float* ks = base + p.stageOff;
  float* vs = ks + p.maxT * rs;
  for (int i = threadIdx.x; i < rows * 2 * hs; i += kThreads) {
    const int row = row0 + i / (2 * hs), part = i / hs % 2, d = i % hs;
    (part ? vs : ks)[row * rs + d] = __ldcg(cache + row * stride + (1 + part) * C + h * hs + d);
  }
}

// Head h's attention (queryFixedHsTo) over its staged rows 0..pos-1 and row pos, which the qkv
// phase of this launch wrote: read through L2 into the stage first, or (p.qkvShared) already
// stored there and into sm.q by the qkv phase. The output goes to emit(copy, d, o).
template <class Emit>
__device__ __forceinline__ void attendStaged(const StepParams& p, float* base, decode::Smem& sm,
                                             Emit&& emit, const float* cache, float* att, int h,
                                             int pos) {
  const int C = p.C, hs = C / p.NH, rs = p.stageRs;
  const int64_t stride = 3 * (int64_t)C;
  const float* head = cache + h * hs;
  float* ks = base + p.stageOff;
  float* vs = ks + p.maxT * rs;
  async::cpAsyncWait<0>();
  if (!p.qkvShared) loadStageRows(p, base, cache, h, pos, 1);
  // queryFixedHs's first barrier publishes row pos and every thread's copies.
  const decode::SharedKv kv{ks, vs, rs};
  float* attRow = att + (int64_t)h * p.maxT;
  const float* qRow = p.qkvShared ? nullptr : head + pos * stride;
  if (hs == 64)
    decode::queryFixedHsTo<64>(sm, emit, attRow, qRow, kv, pos + 1, hs);
  else
    decode::queryFixedHsTo<32>(sm, emit, attRow, qRow, kv, pos + 1, hs);
}

__device__ __forceinline__ int f16Vpl(int K) {
  const int nvec = (K + 63) / 64 * 64 / perVec<Fmt::F16>();
  return nvec <= 32 ? 1 : nvec <= 64 ? 2 : nvec <= 128 ? 4 : 8;
}
// Columns per warp at a time: the fewest that give every warp of the cluster its share of N
// (ceil(N / warps), rounded up to an instantiated count: 1, 2, 3, 4, 6, 8), at most
// kGemvLoads / VPL. A column's arithmetic does not depend on it (lane l sums vectors
// l, l+32, ... in order whatever the schedule); fewer columns per warp is a shorter phase (the
// bundled qkv: 6 columns on each of 128 warps, where 8 left a quarter of them idle).
__device__ __forceinline__ int f16Cb(int K, int N) {
  const int W = int(gridDim.x) * kWarps, most = kGemvLoads / f16Vpl(K);
  const int want = min(most, (N + W - 1) / W);
  return want <= 4 ? max(want, 1) : want <= 6 ? 6 : 8;
}

struct Rows {
  float *xs, *lnY, *hb;
  float (*red)[33];
};

// A LayerNorm's w and b for this thread's channels (c = threadIdx.x + kThreads * i), read
// ahead of the barrier that precedes the LayerNorm.
struct LnParams {
  float w[kMaxC / kThreads], b[kMaxC / kThreads];
};
__device__ __forceinline__ LnParams loadLn(const float* w, const float* b, int C) {
  LnParams q;
#pragma unroll
  for (int i = 0; i < kMaxC / kThreads; ++i) {
    const int c = int(threadIdx.x) + kThreads * i;
    q.w[i] = c < C ? __ldg(w + c) : 0.f;
    q.b[i] = c < C ? __ldg(b + c) : 0.f;
  }
  return q;
}

// dst = LayerNorm(src) (layernormRow's arithmetic), every thread of the block. Every warp
// computes the statistics itself (the same function on the same row: the same bits), so no
// block barrier and shared-memory hand-off separates them from the normalisation.
__device__ void layernormTo(float* dst, const float* src, const LnParams& q, int C) {
  float mu, rs;
  layernormRowStats(src, C, int(threadIdx.x & 31), mu, rs);
#pragma unroll
  for (int i = 0; i < kMaxC / kThreads; ++i) {
    const int c = int(threadIdx.x) + kThreads * i;
    if (c < C) dst[c] = layernormApply(src[c], mu, rs, q.w[i], q.b[i]);
  }
  __syncthreads();
}

// Where a linear's outputs go: Store (global only: the cache row), Residual (x[n] += v into
// every block's xs and the global x), Gelu (gelu(v) into every block's hb and the global h).
struct Dest {
  Epi e;
  float* global;
  float* shared;  // this block's copy (the same offset in every block)
  // Store of the qkv row with StepParams::qkvShared: element j of head h's query also into
  // block h's attention query (qs[j]), of its key and value into block h's stage row pos
  // (stage[part * kvFloats + pos * rs + j], part 0 keys, 1 values). C = 1 << logC,
  // head size 1 << logHs.
  float *qs = nullptr, *stage = nullptr;
  int logC = 0, logHs = 0, rs = 0, kvFloats = 0, pos = 0;
  int rank0 = 0;  // head h's block: rank0 + h (StepParams::resident: the layer's first pair)
  // Form 4: the hand-off's mbarrier (shared-memory address, the same in every block); the
  // remote stores are st.async completing on it. 0: plain stores and a cluster barrier.
  uint32_t bar = 0;
};

// v into dst (shared memory, the same offset in every block) of block `rank`: a plain remote
// store, published by the cluster barrier that follows (forms 2 and 3), or with bar (form 4)
// st.async, its bytes completed on that block's mbarrier of the hand-off.
__device__ __forceinline__ void putShared(cg::cluster_group& cl, float* dst, unsigned rank, float v,
                                          uint32_t bar) {
  if (bar)
    async::stAsync(async::clusterAddr(async::smemAddr(dst), rank), v,
                   async::clusterAddr(bar, rank));
  else
    *cl.map_shared_rank(dst, rank) = v;
}

// The qkv element n (Dest::stage set) where its head's block reads it in the attention phase.
__device__ __forceinline__ void storeQkvShared(cg::cluster_group& cl, const Dest& d, int n,
                                               float v) {
  const int part = n >> d.logC, w = n & ((1 << d.logC) - 1);
  const int head = w >> d.logHs, j = w & ((1 << d.logHs) - 1);
  float* dst = part == 0 ? d.qs + j : d.stage + (part - 1) * d.kvFloats + d.pos * d.rs + j;
  putShared(cl, dst, unsigned(d.rank0 + head), v, d.bar);
}

// One thread with its own column n.
__device__ __forceinline__ void storeOne(cg::cluster_group& cl, const Dest& d, int n, float v) {
  if (d.e == Epi::Store) {
    d.global[n] = v;
    if (d.stage) storeQkvShared(cl, d, n, v);
    return;
  }
  const float o = d.e == Epi::Residual ? __fadd_rn(d.shared[n], v) : geluTanh(v);
  for (unsigned r = 0; r < gridDim.x; ++r) putShared(cl, d.shared + n, r, o, d.bar);
  d.global[n] = o;
}

// ---- the warp's CB column sums, scattered over its lanes ----
// warpSum (the butterfly: v += shfl_xor(v, o) for o = 16, 8, ..., 1) of every column, with the
// work shared out: at each of the first log2(P) levels (P: CB rounded up to a power of two) a
// lane keeps half of its columns and sends its partner the other half, so one shuffle per kept
// column instead of one per column; the remaining levels sum the one column left. Lane l ends
// with the sum of the column it returns, as do the R = 32 / P lanes that differ from it only in the
// low log2(R) bits. The additions are the butterfly's, pair for pair: at every level a lane adds
// its partner's partial of the same column, which the partner (that kept the same columns so
// far) holds, so each column's sum is bitwise the warpSum value. bias[] travels alongside
// (selected, not added). Returns the lane's column (>= CB: padding, no column).
template <int CB>
__host__ __device__ constexpr int scatterWidth() {
  return CB <= 1 ? 1 : CB <= 2 ? 2 : CB <= 4 ? 4 : CB <= 8 ? 8 : 16;
}
template <int CB>
__device__ __forceinline__ int scatterSum(const float (&acc)[CB], const float (&bias)[CB], int lane,
                                          float& sum, float& b) {
  constexpr int P = scatterWidth<CB>();
  float v[P], bs[P];
#pragma unroll
  for (int c = 0; c < P; ++c) {
    v[c] = c < CB ? acc[c] : 0.f;
    bs[c] = c < CB ? bias[c] : 0.f;
  }
  int column = 0, o = 16;
#pragma unroll
  for (int half = P / 2; half >= 1; half /= 2, o /= 2) {
    const bool upper = (lane & o) != 0;  // keeps the upper half of its columns
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float keep = upper ? v[half + i] : v[i], send = upper ? v[i] : v[half + i];
      v[i] = keep + __shfl_xor_sync(kFullMask, send, o);
      bs[i] = upper ? bs[half + i] : bs[i];
    }
    column += upper ? half : 0;
  }
  for (; o > 0; o >>= 1) v[0] += __shfl_xor_sync(kFullMask, v[0], o);
  sum = v[0];
  b = bs[0];
  return column;
}

// Column n's value v (held by the R lanes scatterSum left it in) where d says: Store, lane
// q == 0 (q = lane mod R) into the global row; Residual and Gelu, o = x[n] + v or gelu(v) into
// every block's copy (these lanes to ranks q, q + R, ...) and lane q == 0 into the global row.
template <int CB>
__device__ __forceinline__ void storeScattered(cg::cluster_group& cl, const Dest& d, int n, float v,
                                               int lane) {
  constexpr int R = 32 / scatterWidth<CB>();
  const int q = lane & (R - 1);
  if (d.e == Epi::Store) {
    if (q == 0) {
      d.global[n] = v;
      if (d.stage) storeQkvShared(cl, d, n, v);
    }
    return;
  }
  const float o = d.e == Epi::Residual ? __fadd_rn(d.shared[n], v) : geluTanh(v);
  for (int r = q; r < int(gridDim.x); r += R) putShared(cl, d.shared + n, unsigned(r), o, d.bar);
  if (q == 0) d.global[n] = o;
}

// gemvF16's arithmetic. The first round's weights and biases are loaded before pre() (the
// barrier that makes the input row final, and the LayerNorm that writes it): every thread calls
// pre() exactly once, warps without a column too, so the loads' latency hides behind it.
template <int VPL, int CB, class Pre>
__device__ void gemvF16L1(cg::cluster_group& cl, const float* xs, const unsigned char* w,
                          const float* bias, int K, int N, const Dest& d, Pre& pre) {
  constexpr int E = perVec<Fmt::F16>();
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), W = gridDim.x * kWarps;
  const int Kp = (K + 63) / 64 * 64;
  const int nvec = Kp / E;
  bool waiting = true;
  for (int n0 = gw * CB;; n0 += W * CB) {
    const bool active = n0 < N;
    if (!active && !waiting) break;
    float acc[CB], bs[CB];
#pragma unroll
    for (int c = 0; c < CB; ++c) {
      acc[c] = 0.f;
      bs[c] = active && n0 + c < N ? __ldg(bias + n0 + c) : 0.f;
    }
    for (int v0 = 0; v0 < nvec; v0 += 32 * VPL) {
      uint4 wv[CB][VPL];
#pragma unroll
      for (int c = 0; c < CB; ++c) {
        const int n = n0 + c;
        const uint4* row = reinterpret_cast<const uint4*>(w + size_t(n < N ? n : 0) * Kp * 2);
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
          const int v = v0 + lane + 32 * i;
          wv[c][i] = n < N && v < nvec ? __ldg(row + v) : make_uint4(0, 0, 0, 0);
        }
      }
      if (waiting) {
        pre();
        waiting = false;
      }
      if (!active) break;
        // Per column the products still go in order: vector i = 0, 1, ..., elements in order.
#pragma unroll
      for (int i = 0; i < VPL; ++i) {
        const int k0 = (v0 + lane + 32 * i) * E;
        if (k0 >= K) continue;
        float x[E];
        loadInputs(xs, k0, K, x);
        columnsFma<CB>(acc, wv, i, x, k0 + E <= K ? E : K - k0);
      }
    }
    if (!active) break;
    float v, b;
    const int c = scatterSum<CB>(acc, bs, lane, v, b);
    const int n = n0 + c;
    if (c < CB && n < N) storeScattered<CB>(cl, d, n, fmaf(v, 1.f, b), lane);
  }
}

// gemvF32's arithmetic (warp w sums k = w, w+8, ...; partials added in warp order, then bias).
// For K <= 8 * kF32Ahead the first group's weights are loaded before pre(), as above.
constexpr int kF32Ahead = 32;
template <class Pre>
__device__ void gemvF32L1(cg::cluster_group& cl, const Rows& r, const float* xs, const float* w,
                          const float* bias, int K, int N, const Dest& d, Pre& pre) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int groups = (N + 31) / 32;
  int g = blockIdx.x;
  if (K <= kWarps * kF32Ahead) {
    const int n = g * 32 + lane;
    const bool active = g < groups && n < N;
    float wr[kF32Ahead];
#pragma unroll
    for (int i = 0; i < kF32Ahead; ++i) {
      const int k = warp + kWarps * i;
      wr[i] = active && k < K ? __ldg(w + (int64_t)k * N + n) : 0.f;
    }
    const float b = active ? __ldg(bias + n) : 0.f;
    pre();
    if (g < groups) {
      float acc = 0.0f;
      if (n < N) {
#pragma unroll
        for (int i = 0; i < kF32Ahead; ++i) {
          const int k = warp + kWarps * i;
          if (k < K) acc = fmaf(xs[k], wr[i], acc);
        }
      }
      r.red[warp][lane] = acc;
      __syncthreads();
      if (warp == 0 && n < N) {
        float s = 0.0f;
#pragma unroll
        for (int q = 0; q < kWarps; ++q) s += r.red[q][lane];
        s += b;
        storeOne(cl, d, n, s);
      }
      __syncthreads();
    }
    g += gridDim.x;
  } else {
    pre();
  }
  for (; g < groups; g += gridDim.x) {
    const int n = g * 32 + lane;
    float acc = 0.0f;
    if (n < N) {
#pragma unroll 16
      for (int k = warp; k < K; k += kWarps) acc = fmaf(xs[k], __ldg(w + (int64_t)k * N + n), acc);
    }
    r.red[warp][lane] = acc;
    __syncthreads();
    if (warp == 0 && n < N) {
      float s = 0.0f;
#pragma unroll
      for (int q = 0; q < kWarps; ++q) s += r.red[q][lane];
      s += __ldg(bias + n);
      storeOne(cl, d, n, s);
    }
    __syncthreads();
  }
}

// out = xs @ l (d says where), pre() run by every thread once the weights are on their way.
// Inlined into the kernel (the step's chains are latency-bound: an out-of-line call, which the
// compiler chose once the attention's staging grew the kernel, costs a stack frame and the
// calls' argument traffic on every linear).
template <class Pre>
__device__ __forceinline__ void linear2(cg::cluster_group& cl, const Rows& r, const float* xs,
                                        const StepLinear& l, int K, int N, const Dest& d,
                                        Pre&& pre) {
  if (l.f16) {
    const auto* w = static_cast<const unsigned char*>(l.w);
    switch (f16Vpl(K) * 16 + f16Cb(K, N)) {
      case 16 + 1:
        gemvF16L1<1, 1>(cl, xs, w, l.b, K, N, d, pre);
        break;
      case 16 + 2:
        gemvF16L1<1, 2>(cl, xs, w, l.b, K, N, d, pre);
        break;
      case 16 + 3:
        gemvF16L1<1, 3>(cl, xs, w, l.b, K, N, d, pre);
        break;
      case 16 + 4:
        gemvF16L1<1, 4>(cl, xs, w, l.b, K, N, d, pre);
        break;
      case 16 + 6:
        gemvF16L1<1, 6>(cl, xs, w, l.b, K, N, d, pre);
        break;
      case 16 + 8:
        gemvF16L1<1, 8>(cl, xs, w, l.b, K, N, d, pre);
        break;
      case 32 + 1:
        gemvF16L1<2, 1>(cl, xs, w, l.b, K, N, d, pre);
        break;
      case 32 + 2:
        gemvF16L1<2, 2>(cl, xs, w, l.b, K, N, d, pre);
        break;
      case 32 + 3:
        gemvF16L1<2, 3>(cl, xs, w, l.b, K, N, d, pre);
        break;
      case 32 + 4:
        gemvF16L1<2, 4>(cl, xs, w, l.b, K, N, d, pre);
        break;
      case 64 + 1:
        gemvF16L1<4, 1>(cl, xs, w, l.b, K, N, d, pre);
        break;
      case 64 + 2:
        gemvF16L1<4, 2>(cl, xs, w, l.b, K, N, d, pre);
        break;
      default:
        gemvF16L1<8, 1>(cl, xs, w, l.b, K, N, d, pre);
    }
  } else {
    gemvF32L1(cl, r, xs, static_cast<const float*>(l.w), l.b, K, N, d, pre);
  }
}

// How the blocks of forms 2-4 hand a phase's rows to each other (the five hand-offs of a
// layer: qkv -> attention, attention -> proj, proj -> LayerNorm 2, fc -> fcProj, fcProj -> the
// next layer's LayerNorm 1):
//   kFullBarrier (form 2): remote stores, then a cluster barrier;
//   kSplitBarrier (form 3): every barrier that a linear's early loads sit behind is split into
//     its arrive, before those loads are issued, and its wait, where form 2 has the whole
//     barrier, so the arrive's release has only the phase's own stores to complete. Measured on
//     the H200: the f16-storage step 88.1 -> 85.0 us
//     (bench/results/cuda-20261203-1820-timeline.txt);
//   kAsyncHandoff (form 4): no cluster barrier inside the step. Each hand-off has an mbarrier
//     in every block; the rows' remote stores are st.async completing their bytes on the
//     receiving block's barrier, and every block, once all its threads are past the phase
//     (__syncthreads), also sends each block a 4-byte token on it. A block waits on its own
//     barrier for the bytes it is owed (handoffBytes) — the tokens make that "every block has
//     finished the phase", which is what lets the rows be single-buffered as in forms 2-3: a
//     buffer is written only by a phase that comes after a hand-off every block has sent
//     after its last read of it. Each barrier completes once per layer (parity l & 1), and
//     thread 0 re-arms it (expect_tx) as soon as it has waited, which is before the block's
//     next tokens, so no block's bytes for layer l + 1 can arrive before it is re-armed.
//     Probe (bench/cluster_barrier_probe.cu, H200): 0.34-0.67 us per all-to-all hand-off
//     against 0.70-1.12 us for stores and a barrier. Measured in the step (H100, run 34):
//     hand-offs 24.2 -> 16.9 us per step, 71.9 -> 64.5 us/token
//     (bench/results/cuda-20261206-0325-handoff-form4-h100.txt).
//     Form 4 needs the qkv phase to hand the query and row pos to the attention block in
//     shared memory (StepParams::qkvShared: either GEMV's epilogue does it; f32 models gained
//     it in run 39, 81.2 -> 67.0 us/token with whole-run launches); elsewhere the launch runs
//     form 3.
//     Form 4 also runs whole greedy runs in one launch (StepParams::steps): the head's logits
//     go to every block's shared memory on a sixth mbarrier, every block makes the pick itself
//     (the same bits, so the same token) and goes on to the next step; each barrier's use
//     counts on over the steps (parity of step * nLayer + layer). Where the (layer, head) pairs
//     fit the blocks (StepParams::resident), block l * NH + h keeps its pair's key and value
//     rows in its stage for the launch: staged once at its start, row pos stored there by
//     each step's qkv phase, nothing re-staged per layer. Measured (H100, run 35): 64.4-65.1 ->
//     57.8-58.5 us/token (bench/results/cuda-20261206-0532-persistent-run-h100.txt).
constexpr int kFullBarrier = 0, kSplitBarrier = 1, kAsyncHandoff = 2;
// kLogitsHandoff: a multi-step launch's logits (StepParams::steps), once per step.
enum Handoff {
  kQkvHandoff,
  kAttHandoff,
  kProjHandoff,
  kFcHandoff,
  kFcProjHandoff,
  kLogitsHandoff,
  kHandoffs
};

// The block that attends head 0 of layer l (head h: the next ranks).
__device__ __forceinline__ int headRank0(const StepParams& p, int l) {
  return p.resident ? l * p.NH : 0;
}

// The bytes block blockIdx.x receives in hand-off k of layer l: every block's token, and the
// rows: head h's query, key and value (3 hs floats, the layer's head blocks), y and x (C),
// h (4C); the logits (V floats, no tokens: the pick's order comes from the other hand-offs).
__device__ __forceinline__ uint32_t handoffBytes(const StepParams& p, int k, int l) {
  if (k == kLogitsHandoff) return uint32_t(p.V) * uint32_t(sizeof(float));
  const uint32_t tokens = gridDim.x * uint32_t(sizeof(float));
  const uint32_t C = uint32_t(p.C), hs = uint32_t(p.C / p.NH);
  const int head = int(blockIdx.x) - headRank0(p, l);
  const uint32_t floats = k == kQkvHandoff  ? (head >= 0 && head < p.NH ? 3 * hs : 0)
                          : k == kFcHandoff ? 4 * C
                                            : C;
  return tokens + floats * uint32_t(sizeof(float));
}

// ---- speculative greedy runs (StepParams::lanes > 1) ----
// Greedy text from a small model repeats itself, so the continuation of the latest earlier
// occurrence of the context's last tokens (prompt lookup) is often what the model picks next.
// A speculative run checks such drafts without changing one output bit. `lanes` clusters run
// side by side (blockIdx.y), each the ordinary greedy step of form 4 — the same code, so the
// same bits — lane c on draft token c - 1 at position pos + c (lane 0: the last pick, at pos):
//   - lane c's attention needs the cache rows pos .. pos + c - 1 of its layer, which lanes
//     0 .. c - 1 write in the same phase: every block publishes a flag per layer once its share
//     of the qkv row is in global memory (after its block barrier, a gpu-scope release:
//     publishFlag), and lane c's attention blocks wait for those lanes' flags and read the rows
//     through L2 into their stage. No lane waits for a higher one, so the lanes run skewed by
//     the flags' latency, not one step after another;
//   - after the head, block 0 of every lane publishes its pick, and every block of every lane
//     reads all of them and keeps the same prefix: pick c follows draft c - 1, so it is the
//     greedy pick only if drafts 0 .. c - 1 were; the run emits picks 0 .. a, a the first lane
//     whose draft differs from the pick before it (at least pick 0: one token per step, as a
//     greedy run);
//   - each block keeps the token history in shared memory (the positions below the start from
//     StepParams::hist, then every emitted pick), drafts from it itself (every block the same
//     drafts); where it holds a (layer, head) pair's rows (resident), the accepted rows it
//     does not have yet (those of the lanes above it) come in from L2 with the next step's
//     lower lanes' rows, at that layer's qkv hand-off (not on the way into the next step).
// Flags hold serials (the launch's base StepParams::spec[kSpecEpoch] + step + 1, rising across
// launches), so they are never reset; the picks are double-buffered by step parity (a lane
// rewrites its slot two steps later, after every block has read it: each lane's next pick
// needs every block of the lane past the step that read it). Every cluster must be resident at
// once (the launch runs as many lanes as the device holds; a wait that outlasts kSpecTimeoutNs
// traps).
constexpr int kDraftNgram = 4;  // the longest suffix drafts are matched on
constexpr int kSpecEpoch = 0, kSpecPicks = 1, kSpecPickFlags = kSpecPicks + 2 * kMaxLanes,
              kSpecQkvFlags = kSpecPickFlags + kMaxLanes,
              kSpecWords = kSpecQkvFlags + kMaxLanes * kMaxLayers * kMaxCluster;
constexpr unsigned long long kSpecTimeoutNs = 2000000000ull;

__device__ __forceinline__ int32_t* qkvFlag(const StepParams& p, int lane, int layer, int block) {
  return p.spec + kSpecQkvFlags + (lane * kMaxLayers + layer) * kMaxCluster + block;
}

// Everything this block wrote before its last block barrier, then flag = v: a release at gpu
// scope, cumulative over the writes the barrier ordered before it (the PTX memory model's
// release pattern; a __threadfence before it would add a sequentially consistent fence and an
// L1 invalidation, MEMBAR.SC.GPU + CCTL.IVALL, for nothing).
__device__ __forceinline__ void publishFlag(int32_t* flag, int32_t v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(flag), "r"(v) : "memory");
}

// Until *flag has reached serial v (acquire, gpu scope). Relaxed polls with one acquire fence
// after were slower (run 53: 29.5-29.8 against 28.5-28.8 us/token).
__device__ __forceinline__ void awaitFlag(const int32_t* flag, int32_t v) {
  unsigned long long start = 0;
  for (unsigned i = 0;; ++i) {
    int32_t x;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(x) : "l"(flag) : "memory");
    if (int32_t(uint32_t(x) - uint32_t(v)) >= 0) return;
    if ((i & 1023u) == 1023u) {
      unsigned long long now;
      asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(now));
      if (start == 0)
        start = now;
      else if (now - start > kSpecTimeoutNs)
        __trap();  // a lane never came: the clusters were not all resident
    }
  }
}

// The rows of head h of layer l that lane `lane`'s stage lacks in the step of serial v, read
// through L2 once their writers' flags are up: pos0 - behind .. pos0 - 1 (the previous step's
// accepted lanes above this one, lane + 1 .. lane + behind, serial v - 1) and pos0 .. pos0 +
// lane - 1 (this step's lower lanes 0 .. lane - 1). Every thread of the block calls it.
__device__ void specRows(const StepParams& p, float* base, int l, int h, int pos0, int lane,
                         int behind, int32_t v) {
  const int G = int(gridDim.x);
  for (int i = threadIdx.x; i < (behind + lane) * G; i += kThreads) {
    const int row = i / G;  // from pos0 - behind
    if (row < behind)
      awaitFlag(qkvFlag(p, lane + 1 + row, l, i % G), v - 1);
    else
      awaitFlag(qkvFlag(p, row - behind, l, i % G), v);
  }
  __syncthreads();
  loadStageRows(p, base, p.layers[l].cache, h, pos0 - behind, behind + lane);
}

// Drafts for positions pos0 + 1 .. pos0 + lanes - 1 (drafts[0 .. lanes - 2]) by warp 0: the
// tokens after the latest earlier occurrence of the history's last n tokens (n = kDraftNgram
// down to 1; hist[0 .. pos0] known), continuing into the drafts themselves where that runs
// past pos0 (a repeating stretch repeats on); with no occurrence, the last token repeated.
__device__ void specDraft(const int* hist, int pos0, int lanes, int* drafts) {
  const int lane = int(threadIdx.x & 31);
  int j = -1;  // where the matched occurrence ends
  for (int n = kDraftNgram; n >= 1 && j < 0; --n)
    for (int e0 = pos0 - 1; e0 >= n - 1 && j < 0; e0 -= 32) {
      const int e = e0 - lane;
      bool match = e >= n - 1;
      for (int i = 0; i < n && match; ++i) match = hist[e - i] == hist[pos0 - i];
      const unsigned hits = __ballot_sync(kFullMask, match);
      if (hits) j = e0 - (__ffs(int(hits)) - 1);  // the lowest lane: the latest end
    }
  if (lane == 0)
    for (int i = 0; i + 1 < lanes; ++i) {
      const int q = j >= 0 ? j + 1 + i : pos0;
      drafts[i] = q <= pos0 ? hist[q] : drafts[q - pos0 - 1];
    }
}

template <int kSync, bool kSpec = false>
__global__ void __launch_bounds__(kThreads, 1)
    decodeStepKernel2(const __grid_constant__ StepParams p) {
  extern __shared__ float4 dynSmem[];
  float* base = reinterpret_cast<float*>(dynSmem);
  const int C = p.C, hs = C / p.NH;
  int tok = p.step[0], pos = p.step[1];
  const int64_t stride = 3 * (int64_t)C;
  // A speculative run: this block's lane (blockIdx.y) and its scratch rows; the run's base
  // position pos0 (lane 0's) and its last emitted token tok0.
  const int sl = kSpec ? int(blockIdx.y) : 0;
  const int64_t laneOff = kSpec ? int64_t(sl) * p.laneFloats : 0;
  float *const gx = p.x + laneOff, *const gy = p.y + laneOff, *const gh = p.h + laneOff;
  float *const gatt = p.att + laneOff, *const glogits = p.logits + laneOff;
  // behind: a speculative run's rows just below pos0 that this lane's stage lacks (accepted
  // lanes above it in the step before).
  int pos0 = pos, tok0 = tok, emitted = 0, behind = 0;
  if constexpr (kSpec) {
    if (pos0 + p.lanes > p.maxT) return;  // no room for the lanes: nothing runs or is written
  }
  Rows r;
  r.xs = base;
  r.lnY = base + rowFloats(C);
  r.hb = base + 2 * rowFloats(C);
  r.red = reinterpret_cast<float(*)[33]>(r.hb + hbFloats(C));
  decode::Smem& att = *reinterpret_cast<decode::Smem*>(r.hb);
  cg::cluster_group cl = cg::this_cluster();
  __shared__ alignas(8) unsigned long long handoffBars[kHandoffs];  // form 4
  __shared__ float tokenSink[kMaxCluster];                          // form 4: the tokens land here
  __shared__ int picked;                                            // a multi-step launch's pick
  auto bar = [&](int k) { return kSync == kAsyncHandoff ? async::smemAddr(&handoffBars[k]) : 0u; };
  // Layers over the launch: hand-off k of layer l of step s is the barrier's use g = s * nLayer
  // + l (parity g & 1); its last use is not re-armed.
  const int steps = kSync == kAsyncHandoff ? p.steps : 1, uses = steps * p.nLayer;
  // Hand-off k of layer use g: arrive(k) where the phase's stores end, wait(k, g) where the next
  // phase needs them. Form 2: the whole barrier at wait(); form 3: the barrier's arrive and
  // wait; form 4: the tokens, and the wait on the block's own mbarrier.
  auto arrive = [&](int k) {
    if constexpr (kSync == kSplitBarrier) {
      asm volatile("barrier.cluster.arrive.aligned;\n" ::: "memory");
    } else if constexpr (kSync == kAsyncHandoff) {
      __syncthreads();  // every thread of the block is past the phase
      if (threadIdx.x < gridDim.x)
        async::stAsync(async::clusterAddr(async::smemAddr(&tokenSink[blockIdx.x]), threadIdx.x),
                       0.f, async::clusterAddr(bar(k), threadIdx.x));
    }
  };
  auto wait = [&](int k, int g) {
    if constexpr (kSync == kSplitBarrier) {
      asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
    } else if constexpr (kSync == kAsyncHandoff) {
      async::mbarWait<async::Acquire::Cluster>(bar(k), unsigned(g) & 1u);
      if (threadIdx.x == 0 && g + 1 < uses)
        async::mbarExpectTx(bar(k), handoffBytes(p, k, (g + 1) % p.nLayer));
    } else {
      cl.sync();
    }
  };
  PTLLM_DECODE_TRACE(t);
  // Every block of the cluster has started (and, form 4, armed its barriers) before any block
  // stores into another's shared memory: arrive here, wait before the first such store.
  if constexpr (kSync == kAsyncHandoff) {
    if (threadIdx.x == 0 && p.nLayer > 0) {
      for (int k = 0; k < kHandoffs; ++k) async::mbarInit(bar(k), 1);
      async::mbarFenceInit();
      for (int k = 0; k < kLogitsHandoff; ++k) async::mbarExpectTx(bar(k), handoffBytes(p, k, 0));
      if (steps > 1) async::mbarExpectTx(bar(kLogitsHandoff), handoffBytes(p, kLogitsHandoff, 0));
    }
  }
  asm volatile("barrier.cluster.arrive.aligned;\n" ::: "memory");
  stageResident(p, base, pos0);

  // A speculative run's state in shared memory after the logits: the token history, the
  // current drafts and the lanes' picks. Every block drafts lane tokens itself (the same).
  int* const hist = reinterpret_cast<int*>(base + p.logitsOff + (p.V + 3) / 4 * 4);
  int* const drafts = hist + p.maxT + 1;
  int* const picks = drafts + kMaxLanes;
  int32_t epoch = 0;
  if constexpr (kSpec) {
    epoch = __ldcg(p.spec + kSpecEpoch);
    for (int i = threadIdx.x; i < pos0; i += kThreads) hist[i] = __ldg(p.hist + i);
    if (threadIdx.x == 0) hist[pos0] = tok0;
    __syncthreads();
    if (threadIdx.x < 32) specDraft(hist, pos0, p.lanes, drafts);
    __syncthreads();
    if (sl > 0) tok = drafts[sl - 1];
    pos = pos0 + sl;
  }

  // A multi-step launch reads the next step's wpe[pos] element before it waits for the logits
  // (where C <= kThreads: one per thread, one register).
  float wpeNext = 0.f;
#pragma unroll 1
  for (int s = 0; s < steps && pos < p.maxT; ++s) {
    const int32_t serial = epoch + s + 1;  // a speculative run's flags for this step
    if (steps > 1) startStepTrace(p, t);
    if (p.nLayer > 0) stageHead(p, base, p.layers[0].cache, pos);
    // x = wte[tok] + wpe[pos] in every block (block 0 also stores the global x).
    for (int c = threadIdx.x; c < C; c += kThreads) {
      const float wp =
          !kSpec && s > 0 && C <= kThreads ? wpeNext : __ldg(p.wpe + (int64_t)pos * C + c);
      const float v = __ldg(p.wte + (int64_t)tok * C + c) + wp;
      r.xs[c] = v;
      if (blockIdx.x == 0) gx[c] = v;
    }
    __syncthreads();
    // Each linear's weights, biases and the LayerNorm parameters before it are read ahead of
    // the barrier that precedes it (pre(): barrier, then the LayerNorm); the rows never leave
    // the blocks' shared memory.
    // One copy of the layer's code (not peeled): the step is bound by latency, and every copy
    // of its ~50k instructions is fetched cold once per step.
#pragma unroll 1
    for (int l = 0; l < p.nLayer; ++l) {
      const StepLayer& L = p.layers[l];
      const int g = s * p.nLayer + l, rank0 = headRank0(p, l);
      {
        if (l > 0) arrive(kFcProjHandoff);
        const LnParams ln = loadLn(L.ln1w, L.ln1b, C);
        Dest qkv{Epi::Store, L.cache + pos * stride, nullptr};
        qkv.bar = bar(kQkvHandoff);
        if (p.qkvShared) {
          qkv.qs = att.q;
          qkv.stage = base + p.stageOff;
          qkv.logC = __ffs(C) - 1;
          qkv.logHs = __ffs(hs) - 1;
          qkv.rs = p.stageRs;
          qkv.kvFloats = p.maxT * p.stageRs;
          qkv.pos = pos;
          qkv.rank0 = rank0;
        }
        linear2(cl, r, r.lnY, L.attn, C, 3 * C, qkv, [&] {
          if (l > 0) {
            wait(kFcProjHandoff, g - 1);
            stamp(p, t, 11);
          } else if (s == 0) {
            asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");  // every block started
          }  // later steps: every block's pick came after its last read of these rows
          layernormTo(r.lnY, r.xs, ln, C);
          stamp(p, t, 0);
        });
      }
      stamp(p, t, 1);
      if constexpr (kSync == kAsyncHandoff) {
        arrive(kQkvHandoff);
        if constexpr (kSpec) {
          // This block's share of the row is out; a head block of the layer then takes the
          // lower lanes' rows while its own cluster's hand-off completes (other rows of the
          // stage than the qkv phase's stores).
          if (threadIdx.x == 0) publishFlag(qkvFlag(p, sl, l, int(blockIdx.x)), serial);
          const int h = int(blockIdx.x) - rank0;
          if (sl + behind > 0 && h >= 0 && h < p.NH)
            specRows(p, base, l, h, pos0, sl, behind, serial);
          stamp(p, t, 14);
        }
        wait(kQkvHandoff, g);
      } else {
        cl.sync();
      }
      stamp(p, t, 2);
      // Head h on block rank0 + h (rank0 is 0 unless resident); with the stage that is one head
      // per block (NH <= blocks), so the stride ends the loop after it.
      for (int h = int(blockIdx.x) - rank0; h >= 0 && h < p.NH; h += int(gridDim.x)) {
        float* y = r.lnY + h * hs;
        if (p.stageRs) {
          // Then this block attends one head of the layer (no next head reuses att), and each
          // thread sends the channel it holds a copy of to its share of the blocks (this one's
          // y too): no store of the row and block barrier before the sends.
          const int copies = kThreads / hs;
          attendStaged(
              p, base, att,
              [&](int copy, int d, float o) {
                for (int b = copy; b < int(gridDim.x); b += copies)
                  putShared(cl, y + d, unsigned(b), o, bar(kAttHandoff));
                if (copy == 0) gy[h * hs + d] = o;
              },
              L.cache, gatt, h, pos);
        } else {
          decode::query(att, y, p.att + (int64_t)h * p.maxT, L.cache + h * hs, stride, pos + 1, C,
                        hs);
          __syncthreads();
          for (int i = threadIdx.x; i < hs * int(gridDim.x); i += kThreads)
            putShared(cl, y + i % hs, unsigned(i / hs), y[i % hs], bar(kAttHandoff));
          for (int i = threadIdx.x; i < hs; i += kThreads) p.y[h * hs + i] = y[i];
          __syncthreads();  // att is reused by the next head
        }
      }
      stamp(p, t, 3);
      arrive(kAttHandoff);
      // The next layer's rows, while the proj phase runs (this layer's stage reads are done).
      if (l + 1 < p.nLayer) stageHead(p, base, p.layers[l + 1].cache, pos);
      Dest proj{Epi::Residual, gx, r.xs};
      proj.bar = bar(kProjHandoff);
      linear2(cl, r, r.lnY, L.proj, C, C, proj, [&] {
        wait(kAttHandoff, g);
        stamp(p, t, 4);
      });
      stamp(p, t, 5);
      {
        arrive(kProjHandoff);
        const LnParams ln = loadLn(L.ln2w, L.ln2b, C);
        Dest fc{Epi::Gelu, gh, r.hb};
        fc.bar = bar(kFcHandoff);
        linear2(cl, r, r.lnY, L.fc, C, 4 * C, fc, [&] {
          wait(kProjHandoff, g);
          stamp(p, t, 6);
          layernormTo(r.lnY, r.xs, ln, C);
          stamp(p, t, 7);
        });
      }
      stamp(p, t, 8);
      arrive(kFcHandoff);
      Dest fcProj{Epi::Residual, gx, r.xs};
      fcProj.bar = bar(kFcProjHandoff);
      linear2(cl, r, r.hb, L.fcProj, 4 * C, C, fcProj, [&] {
        wait(kFcHandoff, g);
        stamp(p, t, 9);
      });
      stamp(p, t, 10);
    }
    // The head's first rows (a warp per vocabulary row, lanes over k) and the final LayerNorm's
    // parameters, read before the last barrier.
    if (p.nLayer > 0) arrive(kFcProjHandoff);
    const LnParams lnf = loadLn(p.lnfw, p.lnfb, C);
    const int lane = threadIdx.x & 31;
    const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), W = gridDim.x * kWarps;
    constexpr int kHeadAhead = 8;  // C <= 256: the whole row
    float hr[kHeadAhead];
#pragma unroll
    for (int i = 0; i < kHeadAhead; ++i) {
      const int k = lane + 32 * i;
      hr[i] = gw < p.V && k < C ? __ldg(p.wte + (int64_t)gw * C + k) : 0.f;
    }
    if (p.nLayer > 0) {
      wait(kFcProjHandoff, (s + 1) * p.nLayer - 1);
      stamp(p, t, 11);
    } else {
      asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
    }
    layernormTo(r.lnY, r.xs, lnf, C);
    stamp(p, t, 12);
    float* logitsS = base + p.logitsOff;  // steps > 1
    for (int n = gw; n < p.V; n += W) {
      const float* brow = p.wte + (int64_t)n * C;
      float acc = 0.0f;
      if (n == gw && C <= 32 * kHeadAhead) {
#pragma unroll
        for (int i = 0; i < kHeadAhead; ++i)
          if (lane + 32 * i < C) acc = fmaf(r.lnY[lane + 32 * i], hr[i], acc);
      } else {
#pragma unroll 8
        for (int k = lane; k < C; k += 32) acc = fmaf(r.lnY[k], __ldg(brow + k), acc);
      }
      const float v = warpSum(acc);  // every lane: the same bits (a butterfly)
      if (lane == 0) glogits[n] = v;
      if (steps > 1 && lane < int(gridDim.x))
        putShared(cl, logitsS + n, unsigned(lane), v, bar(kLogitsHandoff));
    }
    stamp(p, t, 13);
    if constexpr (kSync == kAsyncHandoff) {
      if (steps > 1) {
        // Every block picks from its copy of the logits (warpGreedyPick: the same bits in every
        // block, so the same token) and goes on with it; block 0 writes the token row.
        if (!kSpec && C <= kThreads && int(threadIdx.x) < C && pos + 1 < p.maxT)
          wpeNext = __ldg(p.wpe + (int64_t)(pos + 1) * C + threadIdx.x);
        async::mbarWait<async::Acquire::Cluster>(bar(kLogitsHandoff), unsigned(s) & 1u);
        if (threadIdx.x == 0 && s + 1 < steps)
          async::mbarExpectTx(bar(kLogitsHandoff), handoffBytes(p, kLogitsHandoff, 0));
        if (threadIdx.x < 32) {
          const int next = warpGreedyPick(p.V, [&](int v) { return logitsS[v]; });
          if (lane == 0) {
            picked = next;
            if (!kSpec && blockIdx.x == 0) {
              p.tokens[pos] = next;
              if (s + 1 == steps || pos + 1 == p.maxT) {
                p.advance[0] = next;
                p.advance[1] = pos + 1;
              }
            }
          }
        }
        __syncthreads();
        if constexpr (!kSpec) {
          tok = picked;
          ++pos;
          continue;
        } else {
          // Every lane's pick; the accepted prefix (the same in every block of every lane).
          const int R = p.lanes;
          int32_t* const slots = p.spec + kSpecPicks + (s & 1) * kMaxLanes;
          if (blockIdx.x == 0 && threadIdx.x == 0) {
            slots[sl] = picked;
            publishFlag(p.spec + kSpecPickFlags + sl, serial);
          }
          if (int(threadIdx.x) < R) {
            awaitFlag(p.spec + kSpecPickFlags + threadIdx.x, serial);
            picks[threadIdx.x] = __ldcg(slots + threadIdx.x);
          }
          __syncthreads();
          stamp(p, t, 15);
          int take = 1;
          while (take < R && drafts[take - 1] == picks[take - 1]) ++take;
          take = min(take, p.steps - emitted);
          emitted += take;
          const bool last = emitted >= p.steps || pos0 + take + R > p.maxT;
          if (sl == 0 && blockIdx.x == 0 && int(threadIdx.x) < take)
            p.tokens[pos0 + threadIdx.x] = picks[threadIdx.x];
          if (last && sl == take - 1 && blockIdx.x == 0)  // the last emitted pick's logits
            for (int v = threadIdx.x; v < p.V; v += kThreads) p.specLogits[v] = logitsS[v];
          if (int(threadIdx.x) < take) hist[pos0 + 1 + threadIdx.x] = picks[threadIdx.x];
          // The accepted lanes' rows above this one come into the stage with the next step's
          // lower lanes' rows (the qkv hand-off of each layer, specRows).
          behind = max(take - 1 - sl, 0);
          pos0 += take;
          tok0 = picks[take - 1];
          if (last) {
            if (sl == 0 && blockIdx.x == 0 && threadIdx.x == 0) {
              p.advance[0] = tok0;
              p.advance[1] = pos0;
              p.spec[kSpecEpoch] = serial;  // the next launch's serials start above this one's
              if (p.specStats) {
                p.specStats[0] += s + 1;
                p.specStats[1] += emitted;
                p.specStats[2] = R;
              }
            }
            break;
          }
          __syncthreads();  // the history is whole; every thread has read the drafts and picks
          if (threadIdx.x < 32) specDraft(hist, pos0, R, drafts);
          __syncthreads();
          stamp(p, t, 16);
          tok = sl == 0 ? tok0 : drafts[sl - 1];
          pos = pos0 + sl;
          continue;
        }
      }
    }
    greedyTail(p, pos);
    ++pos;
  }
  flushTrace(p, t);
}

__global__ void __launch_bounds__(kThreads, 1)
    decodeStepKernel(const __grid_constant__ StepParams p) {
  __shared__ StepSmem sm;
  cg::cluster_group cluster = cg::this_cluster();
  const int C = p.C, tok = p.step[0], pos = p.step[1], hs = C / p.NH;
  const int64_t stride = 3 * (int64_t)C;
  PTLLM_DECODE_TRACE(t);
  for (int l = 0; l < p.nLayer; ++l) {
    const StepLayer& L = p.layers[l];
    if (l == 0)
      embed(sm, p, tok, pos);
    else
      loadRow(sm.row, p.x, C);
    layernormRow(sm, L.ln1w, L.ln1b, C);
    stamp(p, t, 0);
    linear(sm, L.attn, C, 3 * C, Epi::Store, L.cache + pos * stride);
    stamp(p, t, 1);
    cluster.sync();
    stamp(p, t, 2);
    for (int h = blockIdx.x; h < p.NH; h += gridDim.x) {
      decode::query(sm.att, p.y + h * hs, p.att + (int64_t)h * p.maxT, L.cache + h * hs, stride,
                    pos + 1, C, hs);
      __syncthreads();  // sm.att is reused by the next head
    }
    stamp(p, t, 3);
    cluster.sync();
    stamp(p, t, 4);
    loadRow(sm.row, p.y, C);
    linear(sm, L.proj, C, C, Epi::Residual, p.x);
    stamp(p, t, 5);
    cluster.sync();
    stamp(p, t, 6);
    loadRow(sm.row, p.x, C);
    layernormRow(sm, L.ln2w, L.ln2b, C);
    stamp(p, t, 7);
    linear(sm, L.fc, C, 4 * C, Epi::Gelu, p.h);
    stamp(p, t, 8);
    cluster.sync();
    stamp(p, t, 9);
    loadRow(sm.row, p.h, 4 * C);
    linear(sm, L.fcProj, 4 * C, C, Epi::Residual, p.x);
    stamp(p, t, 10);
    cluster.sync();
    stamp(p, t, 11);
  }
  if (p.nLayer == 0)
    embed(sm, p, tok, pos);
  else
    loadRow(sm.row, p.x, C);
  layernormRow(sm, p.lnfw, p.lnfb, C);
  stamp(p, t, 12);
  head(sm, p);
  stamp(p, t, 13);
  greedyTail(p, pos);
  flushTrace(p, t);
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

// The forms (Ops::DecodeStepArgs::form): 1 is decodeStepKernel (rows shared through L2), 2
// decodeStepKernel2 (rows in every block's shared memory), the default, 3 the same with its
// barriers split around the early loads, 4 the same with mbarrier hand-offs instead of
// cluster barriers (where StepParams::qkvShared; else form 3 runs).
constexpr int kForms = 4, kDefaultForm = 2;

const void* formKernel(int form) {
  return form == 1   ? reinterpret_cast<const void*>(decodeStepKernel)
         : form == 2 ? reinterpret_cast<const void*>(decodeStepKernel2<kFullBarrier>)
         : form == 3 ? reinterpret_cast<const void*>(decodeStepKernel2<kSplitBarrier>)
                     : reinterpret_cast<const void*>(decodeStepKernel2<kAsyncHandoff>);
}

// The dynamic shared memory a block of `kernel` may ask for: the device's per-block opt-in
// (48 KB where it cannot say) less the kernel's static shared memory; 0 where the kernel's
// attributes cannot be read.
int kernelSmemCap(const void* kernel) {
  int dev = 0, optin = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
    cudaGetLastError();
    optin = 48 * 1024;
  }
  cudaFuncAttributes fa = {};
  if (cudaFuncGetAttributes(&fa, kernel) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return std::max(0, optin - int(fa.sharedSizeBytes));
}

// Lets `kernel` launch in clusters of up to kMaxCluster blocks where the device allows it (else
// portable sizes only), asking for up to smem bytes of dynamic shared memory; the carveout
// preference leaves the rest of the SM's 256 KB to L1.
void allowClusterLaunch(const void* kernel, int smem) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) !=
      cudaSuccess)
    cudaGetLastError();  // then only portable sizes
  if (smem <= 0) return;
  PTLLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  PTLLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        cudaSharedmemCarveoutMaxL1));
}

// kernelSmemCap of form `form`'s kernel (forms 2-4; their static shared memory holds the
// profile's trace marks), asked once per process.
int dynSmemCapBytes(int form) {
  static const std::vector<int> caps = [] {
    std::vector<int> c(kForms + 1, 0);
    for (int f = 2; f <= kForms; ++f) c[size_t(f)] = kernelSmemCap(formKernel(f));
    return c;
  }();
  return form >= 2 && form <= kForms ? caps[size_t(form)] : 0;
}

// Forms 2-4: the rows' shared memory, plus the staged key and value rows of one head where
// every block has at most one head, the head size is 32 or 64 (queryFixedHs), the rows are
// 16-byte vectors and it all fits (p.stageRs, p.stageOff set; else 0). Form 1: none.
size_t smemBytes(int form, StepParams& p, int blocks) {
  p.stageRs = p.stageOff = p.qkvShared = 0;
  if (form == 1) return 0;
  const size_t rows = size_t(smem2Floats(p.C)) * sizeof(float);
  const int hs = p.C / p.NH;
  bool aligned = p.C % 4 == 0;
  for (int l = 0; l < p.nLayer; ++l)
    aligned = aligned && (reinterpret_cast<uintptr_t>(p.layers[l].cache) & 15) == 0;
  // rs / 4 odd: the 8 rows a quarter-warp reads as 16-byte vectors fall in distinct banks.
  const int rs = hs + 4;
  const int off = (smem2Floats(p.C) + 3) / 4 * 4;
  const size_t staged = (size_t(off) + 2 * size_t(p.maxT) * rs) * sizeof(float);
  if (p.nLayer > 0 && p.NH <= blocks && (hs == 64 || hs == 32) && aligned &&
      staged <= size_t(dynSmemCapBytes(form))) {
    p.stageRs = rs;
    p.stageOff = off;
    p.qkvShared = (p.C & (p.C - 1)) == 0;  // hs is 32 or 64
    return staged;
  }
  return rows;
}

// PTLLM_DECODE_PROFILE=1: two device buffers of kProfSlots counters (the forms' launches, the
// speculative runs') that every launch adds its timeline to; printed to stderr at exit,
// averaged over the steps. Force one form and one cluster size (bench sample --decode-form N)
// for a timeline that means something: a launch of one step counts from the block's start,
// one of several from each step's.
unsigned long long* gProf = nullptr;
int gProfForms = 0;   // bit f-1: form f was launched (the profile adds up every launch)
int gProfBlocks = 0;  // the largest cluster launched
int gProfLanes = 0;   // the most lanes a speculative run launched

void printTimeline(const std::vector<unsigned long long>& h, const char* what, int blocks,
                   int lanes, int khz) {
  const double n = double(h[kProfSlots - 1]);
  const int marks = int(std::min<unsigned long long>(h[kProfIds + kTraceMarks], kTraceMarks));
  blocks = std::min(blocks, kMaxCluster);
  lanes = std::clamp(lanes, 1, kMaxLanes);
  if (n <= 0 || blocks <= 0) return;
  static const char* names[kProfPoints] = {
      "ln1 (+row/embed)", "qkv",   "barrier", "attention",     "barrier", "proj (+row)", "barrier",
      "ln2 (+row)",       "fc",    "barrier", "fcProj (+row)", "barrier", "final ln",    "head",
      "qkv flag+rows",    "picks", "drafts"};
  auto us = [&](int mark, int lane, int block) {
    const double steps = std::max(1.0, double(h[size_t(kProfCounts + mark)]));
    const size_t slot = (size_t(mark) * kMaxLanes + size_t(lane)) * kMaxCluster + size_t(block);
    return double(h[slot]) / steps / (khz * 1e-3);
  };
  // " | lane c v" for lanes 1 .. lanes - 1 (lane 0 has columns of its own).
  auto laneCells = [&](auto&& value) {
    std::string cells;
    for (int c = 1; c < lanes; ++c) {
      char cell[32];
      std::snprintf(cell, sizeof cell, " | lane %d %7.2f", c, double(value(c)));
      cells += cell;
    }
    return cells;
  };
  const std::string perLane = lanes > 1 ? " per lane, " + std::to_string(lanes) + " lanes" : "";
  std::fprintf(stderr,
               "[decode profile] %s: %.0f launches, %d blocks%s, clock %d MHz; us since the "
               "block's start (a multi-step launch: the step's), thread 0, mean over the steps "
               "that reached the mark\n",
               what, n, blocks, perLane.c_str(), khz / 1000);
  std::vector<std::vector<double>> sums(size_t(lanes), std::vector<double>(kProfPoints, 0.0));
  std::vector<double> sum0(kProfPoints, 0.0), prev(size_t(lanes), 0.0);
  double prev0 = 0;
  for (int i = 0; i < marks; ++i) {
    const int point = int(h[size_t(kProfIds) + size_t(i)]) % kProfPoints;
    double lo = us(i, 0, 0), hi = lo;
    int first = 0, last = 0;  // lane 0's blocks that reached the mark first and last
    for (int b = 1; b < blocks; ++b) {
      if (us(i, 0, b) < lo) lo = us(i, 0, b), first = b;
      if (us(i, 0, b) > hi) hi = us(i, 0, b), last = b;
    }
    const std::string line = laneCells([&](int c) {  // the latest block of every other lane
      double top = 0;
      for (int b = 0; b < blocks; ++b) top = std::max(top, us(i, c, b));
      sums[size_t(c)][size_t(point)] += top - prev[size_t(c)];
      prev[size_t(c)] = top;
      return top;
    });
    std::fprintf(stderr,
                 "[decode profile] mark %3d %-17s block0 %7.2f  first %7.2f (b%-2d) last %7.2f "
                 "(b%-2d)  (+%.2f)%s\n",
                 i, names[point], us(i, 0, 0), lo, first, hi, last, hi - prev[0], line.c_str());
    sum0[size_t(point)] += us(i, 0, 0) - prev0;
    sums[0][size_t(point)] += hi - prev[0];
    prev0 = us(i, 0, 0);
    prev[0] = hi;
  }
  for (int i = 0; i < kProfPoints; ++i)
    std::fprintf(stderr, "[decode profile] %2d %-17s block0 %7.2f  last block %7.2f%s\n", i,
                 names[i], sum0[size_t(i)], sums[0][size_t(i)],
                 laneCells([&](int c) { return sums[size_t(c)][size_t(i)]; }).c_str());
  std::fprintf(stderr, "[decode profile] total: block0 %.2f us, last block %.2f us\n", prev0,
               prev[0]);
}

void printProfile() {
  std::vector<unsigned long long> h(2 * size_t(kProfSlots));
  if (cudaDeviceSynchronize() != cudaSuccess ||
      cudaMemcpy(h.data(), gProf, h.size() * sizeof(h[0]), cudaMemcpyDeviceToHost) != cudaSuccess)
    return;
  int dev = 0, khz = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev);
  if (khz <= 0) return;
  const std::vector<unsigned long long> spec(h.begin() + kProfSlots, h.end());
  h.resize(size_t(kProfSlots));
  const std::string forms = "forms launched (bits) " + std::to_string(gProfForms);
  printTimeline(h, forms.c_str(), gProfBlocks, 1, khz);
  printTimeline(spec, "speculative runs", gProfBlocks, gProfLanes, khz);
}

unsigned long long* profileBuffer() {
  static unsigned long long* buf = [] {
    const char* e = std::getenv("PTLLM_DECODE_PROFILE");
    if (!e || std::strcmp(e, "1") != 0) return static_cast<unsigned long long*>(nullptr);
    const size_t bytes = 2 * size_t(kProfSlots) * sizeof(unsigned long long);
    PTLLM_CUDA_CHECK(cudaMalloc(&gProf, bytes));
    PTLLM_CUDA_CHECK(cudaMemset(gProf, 0, bytes));
    std::atexit(printProfile);
    return gProf;
  }();
  return buf;
}

// A speculative greedy run (DecodeStepArgs::speculativeLanes): the greedy run's launch (cfg, p:
// form 4, resident rows, logits in shared memory) with the lanes side by side, as many as the
// device holds at once (all must be resident) up to those asked for; false, nothing enqueued,
// where it cannot run (the form, or fewer than 2 lanes fit).
bool launchSpeculative(const Ops::DecodeStepArgs& a, StepParams& p, cudaLaunchConfig_t& cfg,
                       int run) {
  if (run != 4 || !p.resident || p.steps < 2 || a.speculativeLanes > kMaxLanes || !a.history)
    return false;
  const void* kernel = reinterpret_cast<const void*>(decodeStepKernel2<kAsyncHandoff, true>);
  static const int cap = [&] {
    const int bytes = kernelSmemCap(kernel);
    allowClusterLaunch(kernel, bytes);
    return bytes;
  }();
  // After the logits: the history (maxT + 1 tokens), the drafts and the picks.
  cfg.dynamicSmemBytes += (size_t(p.maxT) + 1 + 2 * kMaxLanes) * sizeof(int32_t);
  if (cfg.dynamicSmemBytes > size_t(cap)) return false;
  // As many lanes as the device holds at once (all must be resident), at most those asked for.
  int fit = 0;
  if (cudaOccupancyMaxActiveClusters(&fit, kernel, &cfg) != cudaSuccess) cudaGetLastError();
  const int lanes = std::min(a.speculativeLanes, fit);
  if (lanes < 2) return false;
  // The lanes' scratch rows and the run's flags: one set per process (every launch is on the
  // one stream), grown as needed; the flags are zeroed once and only rise after.
  static float* scratch = nullptr;
  static size_t scratchFloats = 0;
  static int32_t* words = nullptr;
  // A lane's rows, each starting 16-byte aligned: x, y, h, att, logits.
  auto round4 = [](int64_t n) { return (n + 3) / 4 * 4; };
  const int64_t atY = round4(p.C), atH = atY + round4(p.C), atAtt = atH + round4(4 * int64_t(p.C)),
                atLogits = atAtt + round4(int64_t(p.NH) * p.maxT),
                laneFloats = atLogits + round4(p.V);
  if (size_t(laneFloats * lanes) > scratchFloats) {
    if (scratch) PTLLM_CUDA_CHECK(cudaFree(scratch));
    scratchFloats = size_t(laneFloats * lanes);
    PTLLM_CUDA_CHECK(cudaMalloc(&scratch, scratchFloats * sizeof(float)));
  }
  if (!words) {
    PTLLM_CUDA_CHECK(cudaMalloc(&words, kSpecWords * sizeof(int32_t)));
    PTLLM_CUDA_CHECK(cudaMemset(words, 0, kSpecWords * sizeof(int32_t)));
  }
  p.lanes = lanes;
  p.laneFloats = int(laneFloats);
  p.x = scratch;
  p.y = scratch + atY;
  p.h = scratch + atH;
  p.att = scratch + atAtt;
  p.logits = scratch + atLogits;
  p.spec = words;
  p.hist = const_cast<int32_t*>(a.history);
  p.specLogits = a.logits;
  p.specStats = a.speculativeStats;
  if (p.prof) {  // the speculative runs' own timeline
    p.prof += kProfSlots;
    gProfBlocks = std::max(gProfBlocks, int(cfg.gridDim.x));
    gProfLanes = std::max(gProfLanes, lanes);
  }
  cfg.gridDim.y = unsigned(lanes);
  void* params[] = {&p};
  PTLLM_CUDA_CHECK(cudaLaunchKernelExC(&cfg, kernel, params));
  return true;
}

}  // namespace

int decodeStepMaxBlocks() {
  // Asked once per process (the first CudaOps, outside any capture): the largest cluster the
  // device co-schedules for every form, 16 (non-portable) or 8; 0 when clusters are unavailable.
  static const int blocks = [] {
    int common = kMaxCluster;
    for (int form = 1; form <= kForms; ++form) {
      const void* kernel = formKernel(form);
      // A launch asks for what its shapes need (smemBytes), at most this.
      const size_t smem = size_t(dynSmemCapBytes(form));
      allowClusterLaunch(kernel, int(smem));
      int fits = 0;
      for (int b : {kMaxCluster, kPortableCluster}) {
        if (b > common) continue;
        cudaLaunchAttribute attr;
        cudaLaunchConfig_t cfg = clusterLaunch(b, &attr);
        cfg.dynamicSmemBytes = smem;  // the most a launch asks for
        int clusters = 0;
        if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess &&
            clusters > 0) {
          fits = b;
          break;
        }
        cudaGetLastError();
      }
      common = std::min(common, fits);
    }
    return common;
  }();
  profileBuffer();  // allocated here, outside any step capture
  return blocks;
}

int decodeStepForms() {
  return kForms;
}

int launchDecodeStep(const Ops::DecodeStepArgs& a) {
  const int maxBlocks = decodeStepMaxBlocks();
  const int nLayer = int(a.layers.size());
  const int form = a.form == 0 ? kDefaultForm : a.form;
  if (maxBlocks == 0 || form < 1 || form > kForms || a.C < 1 || a.C > kMaxC || a.NH < 1 ||
      a.C % a.NH != 0 || a.C / a.NH > decode::kMaxHs || a.maxT < 1 || a.maxT > decode::kMaxTk ||
      a.V < 1 || nLayer > kMaxLayers)
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
  p.tokens = a.greedyTokens;
  p.advance = a.greedyTokens ? const_cast<int32_t*>(a.step) : nullptr;
  p.prof = profileBuffer();
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
  cudaLaunchConfig_t cfg = clusterLaunch(blocks, &attr);
  cfg.dynamicSmemBytes = smemBytes(form, p, blocks);
  void* params[] = {&p};
  // Form 4 hands the query and row pos over in shared memory only (qkvShared); else form 3,
  // whose static shared memory is smaller, so the same dynamic size fits it.
  const int run = form == 4 && !p.qkvShared ? 3 : form;
  p.steps = 1;
  p.resident = run == 4 && p.NH * nLayer <= blocks;
  if (a.greedySteps > 1) {
    // Several greedy steps in this launch: form 4 only, the logits in shared memory after
    // the stage.
    const size_t off = (cfg.dynamicSmemBytes / sizeof(float) + 3) / 4 * 4;
    const size_t bytes = (off + size_t(a.V + 3) / 4 * 4) * sizeof(float);
    if (run != 4 || !a.greedyTokens || nLayer < 1 || a.greedySteps > a.maxT ||
        bytes > size_t(dynSmemCapBytes(run)))
      return 0;
    p.steps = a.greedySteps;
    p.logitsOff = int(off);
    cfg.dynamicSmemBytes = bytes;
  }
  if (a.speculativeLanes > 1) return launchSpeculative(a, p, cfg, run) ? blocks : 0;
  PTLLM_CUDA_CHECK(cudaLaunchKernelExC(&cfg, formKernel(run), params));
  if (p.prof) {
    gProfForms |= 1 << (form - 1);
    gProfBlocks = std::max(gProfBlocks, blocks);
  }
  return blocks;
}

}  // namespace ptllm::cuda
