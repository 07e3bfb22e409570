// The strict f32 reference kernels: plain loops, single-threaded, sums accumulated in double,
// compiled without fast-math or FMA contraction. This is the truth every backend's kernels are
// tested against; shapes as in kernels/ops.h. Each family lives in the file of its name, and
// the CPU backend's fast version lives in kernels/cpu/ under the same file name.
#pragma once

#include <cstdint>

namespace ptllm::ref {

// matmul.cpp
void matmul(float* out, const float* in, const float* w, const float* bias, int M, int K, int N);
void matmulAbt(float* out, const float* a, const float* b, int M, int K, int N, bool accumulate);
void matmulAtb(float* out, const float* a, const float* b, int M, int K, int N, bool accumulate);
void biasBackward(float* dbias, const float* dout, int M, int N);

// layernorm.cpp (rows [r0, r1) so a backend can split the work by rows)
void layernormForward(float* out, float* mean, float* rstd, const float* in, const float* w,
                      const float* b, int M, int C);
void layernormBackward(float* din, float* dw, float* db, const float* dout, const float* in,
                       const float* w, const float* mean, const float* rstd, int M, int C);

// gelu.cpp
float gelu(float x);
float geluGrad(float x);
void geluForward(float* out, const float* in, int64_t n);
void geluBackward(float* din, const float* in, const float* dout, int64_t n);

// attention.cpp
void attentionForward(float* out, float* att, const float* qkv, int B, int Tq, int Tk, int C,
                      int NH);
void attentionBackward(float* dqkv, const float* dout, const float* qkv, const float* att, int B,
                       int T, int C, int NH);

// embedding.cpp
void embeddingForward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int B,
                      int T, int C, int pos0);
void embeddingBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B,
                       int T, int C);

// cross_entropy.cpp
void crossEntropy(float* losses, float* dlogits, const float* logits, const int32_t* targets, int M,
                  int V, float dscale);

// adamw.cpp
void adamw(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1,
           float beta2, float eps, float wd, int t);

}  // namespace ptllm::ref
