// Launchers of the canonical f32 kernels behind CudaOps (cuda_ops.cu). Pointers are device
// memory unless named host*; every launch goes on cuda::stream() and is checked. Shapes and
// (+=) conventions are those of kernels/ops.h. C++17 (nvcc).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/ops.h"

namespace ptllm::cuda {

// Device memory reused across calls, grown on demand (never shrinks). Reuse is safe without
// events because every kernel and copy runs in order on the one stream; growing waits for the
// stream before freeing the old block.
class DeviceScratch {
 public:
  DeviceScratch() = default;
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  ~DeviceScratch();
  void* get(size_t bytes);
  template <class T>
  T* as(size_t count) {
    return static_cast<T*>(get(count * sizeof(T)));
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Copies n int32 ids from the host into the front of `scratch` (stream-ordered); returns them.
const int32_t* uploadIds(DeviceScratch& scratch, const int32_t* hostIds, int64_t n);

// ---- ops_matmul.cu ----
// `sms`: the GPU's multiprocessor count (picks the tile size).
void launchMatmul(float* out, const float* in, const float* w, const float* bias, int M, int K,
                  int N, int sms);
void launchMatmulAbt(float* out, const float* a, const float* b, int M, int K, int N,
                     bool accumulate, int sms);
void launchMatmulAtb(float* out, const float* a, const float* b, int M, int K, int N,
                     bool accumulate, int sms);

// ---- ops_elementwise.cu ----
void launchFill(float* dst, float value, int64_t n);
void launchAdd(float* out, const float* a, const float* b, int64_t n);
void launchScale(float* x, float s, int64_t n);
void launchGeluForward(float* out, const float* in, int64_t n);
void launchGeluBackward(float* din, const float* in, const float* dout, int64_t n);
void launchAdamw(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1,
                 float beta2, float eps, float wd, int t);
void launchBiasBackward(float* dbias, const float* dout, int M, int N, int sms,
                        DeviceScratch& scratch);

// ---- ops_norm.cu ----
void launchLayernormForward(float* out, float* mean, float* rstd, const float* in, const float* w,
                            const float* b, int M, int C);
void launchLayernormBackward(float* din, float* dw, float* db, const float* dout, const float* in,
                             const float* w, const float* mean, const float* rstd, int M, int C,
                             int sms, DeviceScratch& scratch);

// ---- ops_attention.cu ----
void launchAttentionForward(float* out, float* att, const float* qkv, int B, int Tq, int Tk, int C,
                            int NH);
void launchAttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* att,
                             int B, int T, int C, int NH, DeviceScratch& scratch);
// The replayable decode step (Ops::attentionStep): position read from step[1].
void launchAttentionStep(float* out, float* att, float* cache, const float* qkvNew, int C, int NH,
                         int maxT, const int32_t* step);

// ---- ops_embedding_loss.cu ----
void launchEmbeddingForward(float* out, const int32_t* hostTokens, const float* wte,
                            const float* wpe, int B, int T, int C, int pos0,
                            DeviceScratch& idScratch);
// Ops::embeddingStep: out[C] = wte[step[0]] + wpe[step[1]] (ids in device memory).
void launchGreedyAdvance(int32_t* step, int32_t* tokens, const float* logits, int V);
void launchEmbeddingStep(float* out, const int32_t* step, const float* wte, const float* wpe,
                         int C);
void launchEmbeddingBackward(float* dwte, float* dwpe, const float* dout, const int32_t* hostTokens,
                             int B, int T, int C, DeviceScratch& idScratch);
void launchCrossEntropy(float* losses, float* dlogits, const float* logits,
                        const int32_t* hostTargets, int M, int V, float dscale,
                        DeviceScratch& idScratch);
// Synchronises the stream: the host needs the value.
double sumSquares(const float* x, int64_t n, DeviceScratch& scratch);

// ---- decode_step.cu ----
// Ops::decodeStepFused: the blocks launched, or 0 (nothing enqueued) outside its limits.
int launchDecodeStep(const Ops::DecodeStepArgs& args);
// The largest cluster the device co-schedules for the fused step (16 or 8; 0: none). Asked
// once; CudaOps asks at construction so no capture has to.
int decodeStepMaxBlocks();
// The fused step's forms (DecodeStepArgs::form): 1 keeps the rows it shares in L2, 2 in every
// block's shared memory (the default).
int decodeStepForms();

}  // namespace ptllm::cuda
