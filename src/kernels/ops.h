// The ops interface: every op the model uses, with shapes in the comments. A backend (CPU,
// CUDA) implements it over pointers into its own memory (Tensor buffers it allocated), so the
// model never touches data directly and weights, activations and KV caches can live on a
// device. Gated fast paths for the forward linear layers are not methods here: they are
// entries of the path registry (kernels/registry.h), picked per call by the model.
//
// Conventions: row-major; linear weights use the GPT-2 Conv1D layout w[K,N] = [in, out].
// "(+=)" marks outputs that accumulate into what is there; all other outputs are overwritten.
// Token and target ids (int32) are host pointers; a device backend copies them (they are small).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"

namespace ptllm {

class Ops {
 private:
  [[noreturn]] void noStepGraphs() const { fail("the {} backend has no step graphs", name()); }

 public:
  virtual ~Ops() = default;
  virtual Device device() const = 0;
  virtual const char* name() const = 0;

  // Memory in this backend's address space (zero-filled).
  virtual std::shared_ptr<Buffer> allocBytes(size_t bytes) = 0;
  Tensor alloc(const Shape& shape) {
    return Tensor(shape, allocBytes(static_cast<size_t>(numelOf(shape)) * sizeof(float)));
  }
  virtual void upload(Tensor& dst, const float* host) = 0;    // host -> dst (dst.numel())
  virtual void download(float* host, const Tensor& src) = 0;  // src -> host
  virtual void copy(float* dst, const float* src, int64_t n) = 0;
  virtual void fill(float* dst, float value, int64_t n) = 0;

  // ---- matmuls ----
  // out[M,N] = in[M,K] @ w[K,N] + bias[N]   (bias may be null). The canonical f32 forward.
  virtual void matmul(float* out, const float* in, const float* w, const float* bias, int M, int K,
                      int N) = 0;
  // out[M,N] (+=) a[M,K] @ b[N,K]^T     backward dIn = dOut @ W^T; the tied head's logits.
  virtual void matmulAbt(float* out, const float* a, const float* b, int M, int K, int N,
                         bool accumulate) = 0;
  // out[M,N] (+=) a[K,M]^T @ b[K,N]     backward dW = In^T @ dOut.
  virtual void matmulAtb(float* out, const float* a, const float* b, int M, int K, int N,
                         bool accumulate) = 0;
  // dbias[N] += sum over m of dout[m,N]
  virtual void biasBackward(float* dbias, const float* dout, int M, int N) = 0;
  // matmulAtb(out, a, b, M, K, N, accumulate), then biasBackward(dbias, b, K, N): a linear
  // layer's dW and db from one read of dOut = b[K,N]. Backends may fuse the two (CPU does).
  virtual void matmulAtbBias(float* out, float* dbias, const float* a, const float* b, int M, int K,
                             int N, bool accumulate) {
    matmulAtb(out, a, b, M, K, N, accumulate);
    biasBackward(dbias, b, K, N);
  }

  // ---- elementwise / normalisation ----
  // out[n] = a[n] + b[n]   (out may alias a or b)
  virtual void add(float* out, const float* a, const float* b, int64_t n) = 0;
  // out[M,C] = (in - mean) * rstd * w + b ; saves mean[M], rstd[M] (either may be null). eps 1e-5.
  virtual void layernormForward(float* out, float* mean, float* rstd, const float* in,
                                const float* w, const float* b, int M, int C) = 0;
  // din[M,C] (+=), dw[C] (+=), db[C] (+=) from dout[M,C] and the saved forward statistics.
  virtual void layernormBackward(float* din, float* dw, float* db, const float* dout,
                                 const float* in, const float* w, const float* mean,
                                 const float* rstd, int M, int C) = 0;
  // GELU, tanh approximation. out may alias in.
  virtual void geluForward(float* out, const float* in, int64_t n) = 0;
  // din[n] = dout[n] * gelu'(in[n])   (din may alias dout)
  virtual void geluBackward(float* din, const float* in, const float* dout, int64_t n) = 0;

  // ---- attention ----
  // Causal multi-head self-attention over a fused qkv. Queries are the last Tq of the Tk
  // positions (Tq == Tk when training; Tq == 1 when decoding with the KV cache).
  //   qkv[B,Tk,3C] (q | k | v per position), out[B,Tq,C], att[B,NH,Tq,Tk] (softmax probs,
  //   saved for backward; masked entries are 0).
  virtual void attentionForward(float* out, float* att, const float* qkv, int B, int Tq, int Tk,
                                int C, int NH) = 0;
  // Training form (Tq == Tk == T). dqkv[B,T,3C] (=).
  virtual void attentionBackward(float* dqkv, const float* dout, const float* qkv, const float* att,
                                 int B, int T, int C, int NH) = 0;

  // ---- embeddings and loss ----
  // out[B,T,C] = wte[tok[b,t]] + wpe[pos0 + t]
  virtual void embeddingForward(float* out, const int32_t* tokens, const float* wte,
                                const float* wpe, int B, int T, int C, int pos0) = 0;
  // dwte[V,C] (+=), dwpe[T,C] (+=) from dout[B,T,C]
  virtual void embeddingBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                                 int B, int T, int C) = 0;
  // Softmax cross-entropy over logits[M,V]: losses[M] = -log p[target]; when dlogits is not
  // null, dlogits[M,V] = (p - onehot(target)) * dscale (dlogits may alias logits).
  // A target < 0 is ignored (loss 0, zero gradient).
  virtual void crossEntropy(float* losses, float* dlogits, const float* logits,
                            const int32_t* targets, int M, int V, float dscale) = 0;

  // ---- decode steps replayed as a graph (optional: CUDA) ----
  // A backend that can record one decode step and replay it: the model captures its step once
  // per path and replays it for every later token. The token and its position live in device
  // memory (`step`, 2 int32: token id, position), so one recording serves every position.
  // Backends without graphs return false and the model runs each step op by op.
  class StepGraph {
   public:
    virtual ~StepGraph() = default;
    virtual void replay() = 0;  // enqueues the recorded step
  };
  virtual bool supportsStepGraphs() const { return false; }
  // Between these two, this thread's ops are recorded, not run (no host reads allowed).
  virtual void beginStepCapture() { noStepGraphs(); }
  virtual std::unique_ptr<StepGraph> endStepCapture() { noStepGraphs(); }
  // step[0] = token, step[1] = pos (a small host-to-device copy, outside any capture).
  virtual void setDecodeStep(int32_t* /*step*/, int32_t /*token*/, int32_t /*pos*/) {
    noStepGraphs();
  }
  // out[C] = wte[step[0]] + wpe[step[1]]
  virtual void embeddingStep(float* /*out*/, const int32_t* /*step*/, const float* /*wte*/,
                             const float* /*wpe*/, int /*C*/) {
    noStepGraphs();
  }
  // Greedy decoding without host round trips: after a replayed step, next = the first index of
  // the largest of logits[V] (std::max_element's choice: NaNs never win unless logits[0] is
  // NaN, then it is 0); tokens[step[1]] = next, step[0] = next, step[1] += 1, so the next replay
  // decodes it. Queued like a kernel (no host wait).
  virtual void greedyAdvance(int32_t* /*step*/, int32_t* /*tokens*/, const float* /*logits*/,
                             int /*V*/) {
    noStepGraphs();
  }
  // host[0, n) = src[0, n) (device ids), after the work queued before it.
  virtual void downloadIds(int32_t* /*host*/, const int32_t* /*src*/, int /*n*/) { noStepGraphs(); }
  // dst[0, n) = host[0, n) (device ids), queued; host may be reused once it returns.
  virtual void uploadIds(int32_t* /*dst*/, const int32_t* /*host*/, int /*n*/) { noStepGraphs(); }
  // Writes the new position's fused row qkvNew[3C] into cache row step[1], then attends its
  // query over cache rows [0, step[1]]: out[C], att[NH][maxT] (probabilities of the row; the
  // entries past step[1] are not written).
  virtual void attentionStep(float* /*out*/, float* /*att*/, float* /*cache*/,
                             const float* /*qkvNew*/, int /*C*/, int /*NH*/, int /*maxT*/,
                             const int32_t* /*step*/) {
    noStepGraphs();
  }

  // ---- the whole decode step in one launch (optional: CUDA) ----
  // One linear layer of the step: the canonical f32 weight w[K,N], or the packed copy of a path
  // whose M = 1 product the fused step reproduces bit for bit (PathEntry::fusedDecode).
  struct DecodeLinear {
    const void* w = nullptr;
    const float* b = nullptr;  // [N]
    bool f16Storage = false;   // w is the CUDA f16-storage pack [N][Kp], not f32 [K,N]
  };
  struct DecodeLayer {
    const float *ln1w = nullptr, *ln1b = nullptr, *ln2w = nullptr, *ln2b = nullptr;  // [C]
    DecodeLinear attn, proj, fc, fcProj;  // [C,3C], [C,C], [C,4C], [4C,C]
    float* cache = nullptr;               // [maxT, 3C]: row step[1] written, rows up to it read
  };
  struct DecodeStepArgs {
    int C = 0, NH = 0, V = 0, maxT = 0;
    std::vector<DecodeLayer> layers;
    const float *wte = nullptr, *wpe = nullptr, *lnfw = nullptr, *lnfb = nullptr;
    const int32_t* step = nullptr;  // [token, pos] in device memory
    // Scratch: the residual x[C] (left holding the last block's output), y[C], h[4C] and
    // att[NH, maxT] as attentionStep leaves them; logits[V] is the step's output.
    float *x = nullptr, *y = nullptr, *h = nullptr, *att = nullptr, *logits = nullptr;
    int clusterBlocks = 0;  // blocks of the launch; 0: the backend's choice (benchmarks vary it)
    // The fused kernel's form, 1..decodeStepForms() (all bit-identical; which is fastest
    // depends on the device and the weight format); 0: the backend's default.
    int form = 0;
    // Set: the step ends with greedyAdvance(step, greedyTokens, logits, V) (the same pick and
    // writes, without a second launch); step must then be writable.
    int32_t* greedyTokens = nullptr;
    // With greedyTokens: this many greedy steps in the one launch, each fed the token the one
    // before picked (positions step[1], step[1] + 1, ...; the caller keeps them inside maxT),
    // with no host or launch boundary between them; the picks, logits and cache as that many
    // single greedy steps leave them. A backend that cannot returns 0 and enqueues nothing.
    int greedySteps = 1;
    // With greedySteps = n >= 2: speculativeLanes > 1 makes the run speculative (CUDA form 4):
    // that many copies of the step side by side, copy c on a drafted token c positions ahead
    // (drafts: the continuation of the latest earlier occurrence of the context's last tokens),
    // keeping the picks whose drafts were the greedy picks. The picks, step buffer, cache rows
    // below the new position and logits are bit for bit those of the same number of greedy
    // steps (x, y, h and att are not kept). Where the device cannot hold that many copies at
    // once, it runs as many as it can (at least 2; else it refuses). It may stop early (it needs
    // as many free positions as copies): step[1] says how far it went (possibly nowhere).
    // history: [maxT] in device memory, the tokens at positions 0 .. step[1] - 1.
    // speculativeStats (optional, [kSpeculativeStats] in device memory): += {verify steps,
    // tokens emitted}, and [2] = the copies it ran.
    int speculativeLanes = 0;
    static constexpr int kMaxSpeculativeLanes = 8;  // more: refused
    const int32_t* history = nullptr;
    int32_t* speculativeStats = nullptr;
    static constexpr int kSpeculativeStats = 3;
  };
  virtual int decodeStepForms() const { return 0; }
  // Enqueues the whole one-token step of a GPT-2 — embeddingStep; per layer LayerNorm, the qkv
  // linear, attentionStep, the projection plus the residual, LayerNorm, the MLP linear, GELU,
  // its projection plus the residual; the final LayerNorm and the tied head (matmulAbt) — in
  // one launch, each element computed in the same order as those ops compute it, so the logits
  // are bit-identical to the op-by-op step. Returns the blocks it launched with, or 0 (nothing
  // enqueued) when the backend has no fused step or these shapes are outside its limits.
  virtual int decodeStepFused(const DecodeStepArgs& /*args*/) { return 0; }

  // ---- optimiser ----
  // Sum of squares of x[n] in double (for gradient-norm clipping).
  virtual double sumSquares(const float* x, int64_t n) = 0;
  virtual void scale(float* x, float s, int64_t n) = 0;
  // AdamW step t (1-based) with bias correction; decoupled weight decay wd * lr * p.
  virtual void adamw(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1,
                     float beta2, float eps, float wd, int t) = 0;
};

// The plain single-threaded f32 reference (kernels/ref): the truth every backend is tested
// against. Slow by design.
std::unique_ptr<Ops> makeRefOps();
// The CPU backend (kernels/cpu): Highway SIMD with runtime dispatch, multithreaded.
std::unique_ptr<Ops> makeCpuOps();
// The CUDA backend (kernels/cuda): own f32 kernels on device 0, TF32 off, all work on one
// stream. Throws ptllm::Error naming the reason when the binary has no CUDA backend or the
// machine no usable GPU (kernels/cuda/cuda_device.h says which).
std::unique_ptr<Ops> makeCudaOps();

}  // namespace ptllm
