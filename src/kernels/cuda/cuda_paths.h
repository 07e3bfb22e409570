// The CUDA backend's gated matmul paths (registered in cuda_paths.cpp). Every function takes
// device pointers and runs on cuda::stream(); dispatch functions have Ops::matmul's contract
// with the path's packed weight: out[M,N] = in[M,K] @ unpack(w)[K,N] + bias[N].
// Plain C++17 (no CUDA headers): included by host code and tests; without the backend,
// cuda_stub.cpp defines each function as a clear error.
#pragma once

#include <cstddef>

namespace ptllm::cuda {

// ---- matmul_storage.cu: reduced-precision weight storage, f32 FFMA arithmetic ----
// Packed layout of every storage format: transposed, [N][Kp] with Kp = paddedK(K) (zeros past
// K), so a warp streams one output column's weights contiguously; fp8 appends scales[N] (f32).
inline int paddedK(int K) {  // K rounded up to a multiple of 64
  return (K + 63) / 64 * 64;
}
inline size_t f16PackedBytes(int K, int N) {  // also bf16
  return size_t(N) * size_t(paddedK(K)) * 2;
}
inline size_t fp8PackedBytes(int K, int N) {  // bytes + per-channel scales
  return size_t(N) * size_t(paddedK(K)) + size_t(N) * sizeof(float);
}
// False when a weight is not representable (|w| overflows f16, NaN/Inf): the matrix stays f32.
bool packF16(void* dst, const float* w, int K, int N);
bool packBf16(void* dst, const float* w, int K, int N);
// Per-output-channel scale = max_k |w[k,n]| / 448, q = e4m3(w / scale) (round to nearest).
bool packFp8(void* dst, const float* w, int K, int N);
void matmulF16(float* out, const float* in, const void* w, const float* bias, int M, int K, int N);
void matmulBf16(float* out, const float* in, const void* w, const float* bias, int M, int K, int N);
void matmulFp8(float* out, const float* in, const void* w, const float* bias, int M, int K, int N);
// Benchmark variants of matmulF16's M = 1 GEMV (out[N] = in[K] @ w + bias on packF16's layout):
// the same arithmetic per column, so bit-identical to it, on other schedules (warps per block,
// loads in flight, columns per warp, L2 hint, persistent grid). Variant 0 is matmulF16's.
int gemvF16VariantCount();
const char* gemvF16VariantName(int variant);
void gemvF16Variant(int variant, float* out, const float* in, const void* w, const float* bias,
                    int K, int N);
// Test-only: packF16 that drops the low 6 mantissa bits (a plausible packing bug the gate
// must catch). Never registered in the product.
bool packF16Truncated(void* dst, const float* w, int K, int N);

// ---- matmul_tensor_core.cu: f16 tensor cores (f32 accumulate) ----
// Weights: packF16's layout. Activations are converted per call to f16 with a power-of-two
// scale per row (max |row| lands in [256, 512)), so a row's range never overflows f16; the
// scale is undone exactly in the f32 epilogue.
void matmulTensorCoreF16(float* out, const float* in, const void* w, const float* bias, int M,
                         int K, int N);
// The raw tile kernel on f16 operands (benchmarks): c[M,N] = a[M,Kp] . b[N,Kp]^T, f32 out.
// Kp must be a multiple of 64; a and b rows Kp apart. On Hopper (sm_90a) a wgmma + TMA kernel
// serves from 64 rows on, the mma.sync kernel below that and on every other GPU.
void gemmF16TensorCore(float* c, const void* a, const void* b, int M, int N, int Kp);
// Every tile kernel this GPU runs, the path's own first (tests, benchmarks):
// c[M,N] = (a . b^T) * rowScale[m] + bias[n], rowScale and bias may be null.
int gemmF16VariantCount();
const char* gemmF16VariantName(int variant);
void gemmF16Variant(int variant, float* c, const void* a, const void* b, const float* rowScale,
                    const float* bias, int M, int N, int Kp);

// ---- matmul_cublaslt.cu: the platform library (cuBLASLt) on the same operands ----
void matmulCublasLtF16(float* out, const float* in, const void* w, const float* bias, int M, int K,
                       int N);
void gemmF16CublasLt(float* c, const void* a, const void* b, int M, int N, int Kp);

}  // namespace ptllm::cuda
