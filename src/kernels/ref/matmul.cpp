// Reference matmuls: out[m,n] = sum_k a[m,k] b[k,n], summed in double.
#include "kernels/ref/ref_kernels.h"

namespace ptllm::ref {

void matmul(float* out, const float* in, const float* w, const float* bias, int M, int K, int N) {
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double s = bias ? bias[n] : 0.0;
      for (int k = 0; k < K; ++k) s += double(in[(int64_t)m * K + k]) * w[(int64_t)k * N + n];
      out[(int64_t)m * N + n] = float(s);
    }
}

void matmulAbt(float* out, const float* a, const float* b, int M, int K, int N, bool accumulate) {
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double s = accumulate ? out[(int64_t)m * N + n] : 0.0;
      for (int k = 0; k < K; ++k) s += double(a[(int64_t)m * K + k]) * b[(int64_t)n * K + k];
      out[(int64_t)m * N + n] = float(s);
    }
}

void matmulAtb(float* out, const float* a, const float* b, int M, int K, int N, bool accumulate) {
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double s = accumulate ? out[(int64_t)m * N + n] : 0.0;
      for (int k = 0; k < K; ++k) s += double(a[(int64_t)k * M + m]) * b[(int64_t)k * N + n];
      out[(int64_t)m * N + n] = float(s);
    }
}

void biasBackward(float* dbias, const float* dout, int M, int N) {
  for (int n = 0; n < N; ++n) {
    double s = 0;
    for (int m = 0; m < M; ++m) s += dout[(int64_t)m * N + n];
    dbias[n] += float(s);
  }
}

}  // namespace ptllm::ref
