// The CPU backend's kernels (Highway SIMD, runtime dispatch; multithreaded through the core
// pool). Each family lives in the file of its name next to the reference's file of the same
// name in kernels/ref/. Shapes and semantics as in kernels/ops.h.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ptllm::cpu {

// matmul.cpp — canonical f32 matmuls (f32 multiply, f32 accumulate).
void matmul(float* out, const float* in, const float* w, const float* bias, int M, int K, int N);
void matmulAbt(float* out, const float* a, const float* b, int M, int K, int N, bool accumulate);
void matmulAtb(float* out, const float* a, const float* b, int M, int K, int N, bool accumulate);
void biasBackward(float* dbias, const float* dout, int M, int N);
// matmulAtb(out, a, b, M, K, N, accumulate) and biasBackward(dbias, b, K, N) in one pass over
// b: the column sums are taken while b is packed (f32, per k block of the GEMM).
void matmulAtbBias(float* out, float* dbias, const float* a, const float* b, int M, int K, int N,
                   bool accumulate);
// The GEMM micro-kernel's arithmetic ceiling on this machine: GFLOP/s of its register tile's
// FMAs alone (no loads), summed over the pool's threads, each running ~`seconds` (bench gemm).
double fmaCeilingGflops(double seconds);

// matmul_f16.cpp — the f16-storage path: w packed once to IEEE binary16, products and sums f32.
// The packed layout is panel-major: [ceil(N/NB)][K][NB] binary16, NB = detail::kF16PanelCols
// columns a panel, the last panel zero padded past N; element (k, n) is at
// (n/NB)*K*NB + k*NB + n%NB. Read it only through matmulF16 / f16PackedAt.
size_t f16PackedBytes(int K, int N);  // 0 when K or N is 0
// Round-to-nearest-even conversion of w[K,N] into dst; false if any |w| overflows f16 (or is
// NaN/Inf): the matrix is then ineligible and stays on f32.
bool packF16(void* dst, const float* w, int K, int N);
// out[M,N] = in[M,K] @ unpack(w16)[K,N] + bias[N]
void matmulF16(float* out, const float* in, const void* w16, const float* bias, int M, int K,
               int N);
// unpack(packed)[k, n] of a packF16 buffer of w[K,N] (tests and debugging).
float f16PackedAt(const void* packed, int K, int N, int k, int n);

// layernorm.cpp — eps 1e-5, biased variance; saves mean/rstd (either may be null); the
// backward accumulates into din, dw, db.
void layernormForward(float* out, float* mean, float* rstd, const float* in, const float* w,
                      const float* b, int M, int C);
void layernormBackward(float* din, float* dw, float* db, const float* dout, const float* in,
                       const float* w, const float* mean, const float* rstd, int M, int C);

// gelu.cpp — tanh approximation; out/din may alias in/dout.
void geluForward(float* out, const float* in, int64_t n);
void geluBackward(float* din, const float* in, const float* dout, int64_t n);

// adamw.cpp — one AdamW step t (1-based) over n parameters.
void adamw(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1,
           float beta2, float eps, float wd, int t);

// attention.cpp
void attentionForward(float* out, float* att, const float* qkv, int B, int Tq, int Tk, int C,
                      int NH);
void attentionBackward(float* dqkv, const float* dout, const float* qkv, const float* att, int B,
                       int T, int C, int NH);

// matmul.cpp's packed GEMM over f16 weights (packF16's layout), used by matmulF16 above its
// GEMV rows.
namespace detail {
inline constexpr int kF16PanelCols = 64;  // NB of the packed f16 layout
void matmulF16Gemm(float* out, const float* in, const uint16_t* w16, const float* bias, int M,
                   int K, int N);
}  // namespace detail

// Name of the SIMD target Highway dispatched to on this machine (e.g. "AVX3_ZEN4").
const char* simdTargetName();

}  // namespace ptllm::cpu
