// Token + position embeddings (forward and a deterministic backward: positions grouped by token
// on the host, one block per distinct token, no atomics), softmax cross-entropy one block per
// row, and the gradient norm's sum of squares as a two-stage reduction in double.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_reduce.cuh"
#include "kernels/cuda/decode_math.cuh"
#include "kernels/cuda/ops_kernels.cuh"

namespace ptllm::cuda {
namespace {

constexpr int kThreads = 256;

// out[r, :] = wte[tok[r], :] + wpe[pos0 + r % T, :], one block per row r of B*T.
__global__ void embeddingForwardKernel(float* out, const int32_t* tokens, const float* wte,
                                       const float* wpe, int T, int C, int pos0) {
  const int r = blockIdx.x, t = r % T;
  const float* te = wte + (int64_t)tokens[r] * C;
  const float* pe = wpe + (int64_t)(pos0 + t) * C;
  float* o = out + (int64_t)r * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) o[c] = te[c] + pe[c];
}

// dwte[tok, :] += sum of dout rows at the positions holding tok (in position order).
// groups: [n tokens][n + 1 starts into positions][positions].
__global__ void embeddingBackwardTokensKernel(float* dwte, const float* dout, const int32_t* groups,
                                              int n, int C) {
  const int g = blockIdx.x;
  const int32_t tok = groups[g], begin = groups[n + g], end = groups[n + g + 1];
  const int32_t* positions = groups + 2 * n + 1;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float s = 0.0f;
    for (int32_t i = begin; i < end; ++i) s += dout[(int64_t)positions[i] * C + c];
    dwte[(int64_t)tok * C + c] += s;
  }
}

// dwpe[t, :] += sum over b of dout[b, t, :]
__global__ void embeddingBackwardPositionsKernel(float* dwpe, const float* dout, int B, int T,
                                                 int C) {
  const int t = blockIdx.x;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float s = 0.0f;
    for (int b = 0; b < B; ++b) s += dout[((int64_t)b * T + t) * C + c];
    dwpe[(int64_t)t * C + c] += s;
  }
}

// One block per row: max, sum of exp in double, loss; then the gradient, each thread reading
// x[v] before writing d[v] (dlogits may alias logits).
__global__ void __launch_bounds__(kThreads)
    crossEntropyKernel(float* losses, float* dlogits, const float* logits, const int32_t* targets,
                       int V, float dscale) {
  __shared__ float redF[32];
  __shared__ double redD[32];
  const int m = blockIdx.x;
  const float* x = logits + (int64_t)m * V;
  const int tgt = targets[m];
  float mx = -INFINITY;
  for (int v = threadIdx.x; v < V; v += blockDim.x) mx = fmaxf(mx, x[v]);
  mx = blockReduce(mx, MaxOp{}, -INFINITY, redF);
  // Read the target's logit now: after the next block-wide barrier, d may overwrite x.
  const float xt = tgt >= 0 ? x[tgt] : 0.0f;
  double s = 0.0;
  for (int v = threadIdx.x; v < V; v += blockDim.x) s += double(expf(x[v] - mx));
  s = blockReduce(s, SumOp{}, 0.0, redD);
  if (threadIdx.x == 0) losses[m] = tgt < 0 ? 0.0f : float(double(mx) + log(s) - double(xt));
  if (!dlogits) return;
  float* d = dlogits + (int64_t)m * V;
  const float inv = float(1.0 / s);
  for (int v = threadIdx.x; v < V; v += blockDim.x) {
    const float p = expf(x[v] - mx) * inv;
    d[v] = tgt < 0 ? 0.0f : (p - (v == tgt ? 1.0f : 0.0f)) * dscale;
  }
}

constexpr int kMaxSumBlocks = 1024;  // fixed (not per-GPU): the same order on every device

__global__ void __launch_bounds__(kThreads)
    sumSquaresPartialKernel(double* partial, const float* x, int64_t n) {
  __shared__ double red[32];
  double s = 0.0;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const double v = x[i];
    s = fma(v, v, s);
  }
  s = blockReduce(s, SumOp{}, 0.0, red);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void __launch_bounds__(kThreads)
    sumSquaresFinishKernel(double* result, const double* partial, int parts) {
  __shared__ double red[32];
  double s = 0.0;
  for (int i = threadIdx.x; i < parts; i += blockDim.x) s += partial[i];
  s = blockReduce(s, SumOp{}, 0.0, red);
  if (threadIdx.x == 0) *result = s;
}

__global__ void embeddingStepKernel(float* out, const int32_t* step, const float* wte,
                                    const float* wpe, int C) {
  const int64_t tok = step[0], pos = step[1];
  for (int c = threadIdx.x; c < C; c += blockDim.x) out[c] = wte[tok * C + c] + wpe[pos * C + c];
}

// One block: each thread keeps the first largest non-NaN logit of its strided share, then a
// tree of (value, index) pairs merged in the pick's order (decode_math.cuh) — the same token as
// a left-to-right std::max_element, which also never moves onto a NaN.
constexpr int kArgmaxThreads = 256;
__global__ void __launch_bounds__(kArgmaxThreads)
    greedyAdvanceKernel(int32_t* step, int32_t* tokens, const float* logits, int V) {
  float best = -INFINITY;
  int arg = -1;  // -1: nothing seen (all NaN so far)
  for (int v = threadIdx.x; v < V; v += kArgmaxThreads) pickConsider(best, arg, logits[v], v);
  __shared__ float sb[kArgmaxThreads];
  __shared__ int si[kArgmaxThreads];
  sb[threadIdx.x] = best;
  si[threadIdx.x] = arg;
  __syncthreads();
  for (int half = kArgmaxThreads / 2; half > 0; half >>= 1) {
    if (threadIdx.x < half) {
      pickMerge(best, arg, sb[threadIdx.x + half], si[threadIdx.x + half]);
      sb[threadIdx.x] = best;
      si[threadIdx.x] = arg;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const int next = pickToken(logits[0], si[0]);
    const int pos = step[1];
    tokens[pos] = next;
    step[0] = next;
    step[1] = pos + 1;
  }
}

}  // namespace

void launchGreedyAdvance(int32_t* step, int32_t* tokens, const float* logits, int V) {
  greedyAdvanceKernel<<<1, kArgmaxThreads, 0, stream()>>>(step, tokens, logits, V);
  PTLLM_CUDA_LAUNCH_CHECK();
}

void launchEmbeddingStep(float* out, const int32_t* step, const float* wte, const float* wpe,
                         int C) {
  embeddingStepKernel<<<1, 256, 0, stream()>>>(out, step, wte, wpe, C);
  PTLLM_CUDA_LAUNCH_CHECK();
}

void launchEmbeddingForward(float* out, const int32_t* hostTokens, const float* wte,
                            const float* wpe, int B, int T, int C, int pos0,
                            DeviceScratch& idScratch) {
  const int64_t rows = int64_t(B) * T;
  if (rows <= 0 || C <= 0) return;
  const int32_t* tokens = uploadIds(idScratch, hostTokens, rows);
  embeddingForwardKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream()>>>(out, tokens, wte,
                                                                                 wpe, T, C, pos0);
  PTLLM_CUDA_LAUNCH_CHECK();
}

void launchEmbeddingBackward(float* dwte, float* dwpe, const float* dout, const int32_t* hostTokens,
                             int B, int T, int C, DeviceScratch& idScratch) {
  const int rows = B * T;
  if (rows <= 0 || C <= 0) return;
  // Group the positions by token (stable: each group in position order).
  std::vector<int32_t> order(size_t(rows), 0);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return hostTokens[a] < hostTokens[b]; });
  std::vector<int32_t> toks, starts;
  for (int i = 0; i < rows; ++i)
    if (i == 0 || hostTokens[order[size_t(i)]] != hostTokens[order[size_t(i - 1)]]) {
      toks.push_back(hostTokens[order[size_t(i)]]);
      starts.push_back(i);
    }
  starts.push_back(rows);
  const int n = static_cast<int>(toks.size());
  std::vector<int32_t> groups;
  groups.reserve(toks.size() + starts.size() + order.size());
  groups.insert(groups.end(), toks.begin(), toks.end());
  groups.insert(groups.end(), starts.begin(), starts.end());
  groups.insert(groups.end(), order.begin(), order.end());
  const int32_t* dGroups = uploadIds(idScratch, groups.data(), int64_t(groups.size()));
  embeddingBackwardTokensKernel<<<n, kThreads, 0, stream()>>>(dwte, dout, dGroups, n, C);
  PTLLM_CUDA_LAUNCH_CHECK();
  embeddingBackwardPositionsKernel<<<T, kThreads, 0, stream()>>>(dwpe, dout, B, T, C);
  PTLLM_CUDA_LAUNCH_CHECK();
}

void launchCrossEntropy(float* losses, float* dlogits, const float* logits,
                        const int32_t* hostTargets, int M, int V, float dscale,
                        DeviceScratch& idScratch) {
  if (M <= 0) return;
  const int32_t* targets = uploadIds(idScratch, hostTargets, M);
  crossEntropyKernel<<<M, kThreads, 0, stream()>>>(losses, dlogits, logits, targets, V, dscale);
  PTLLM_CUDA_LAUNCH_CHECK();
}

double sumSquares(const float* x, int64_t n, DeviceScratch& scratch) {
  if (n <= 0) return 0.0;
  const int parts = static_cast<int>(std::min<long long>(ceilDiv(n, kThreads), kMaxSumBlocks));
  double* buf = scratch.as<double>(size_t(parts) + 1);  // partials, then the result
  sumSquaresPartialKernel<<<parts, kThreads, 0, stream()>>>(buf, x, n);
  PTLLM_CUDA_LAUNCH_CHECK();
  sumSquaresFinishKernel<<<1, kThreads, 0, stream()>>>(buf + parts, buf, parts);
  PTLLM_CUDA_LAUNCH_CHECK();
  double result = 0.0;
  PTLLM_CUDA_CHECK(
      cudaMemcpyAsync(&result, buf + parts, sizeof(double), cudaMemcpyDeviceToHost, stream()));
  PTLLM_CUDA_CHECK(cudaStreamSynchronize(stream()));
  return result;
}

}  // namespace ptllm::cuda
