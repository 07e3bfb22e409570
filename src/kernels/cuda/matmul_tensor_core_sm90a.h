// The Hopper (sm_90a) wgmma + TMA tile kernel of the tensor-core-f16 path
// (matmul_tensor_core_sm90a.cu). Plain C++17 host interface; device pointers, cuda::stream().
#pragma once

namespace ptllm::cuda {

// True when the running GPU executes sm_90a code (compute capability 9.0 exactly).
bool wgmmaGemmAvailable();
// c[M,N] = (a[M,Kp] . b[N,Kp]^T) * rowScale[m] + bias[n], a and b f16 K-major, Kp % 64 == 0,
// rowScale and bias may be null. Variants are schedules of the same kernel (benchmarks);
// variant 0 is the one the path uses.
int wgmmaGemmVariantCount();
const char* wgmmaGemmVariantName(int variant);
void wgmmaGemm(int variant, float* c, const void* a, const void* b, const float* rowScale,
               const float* bias, int M, int N, int Kp);

}  // namespace ptllm::cuda
