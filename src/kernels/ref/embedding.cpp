// Reference token + position embedding.
#include "kernels/ref/ref_kernels.h"

namespace ptllm::ref {

void embeddingForward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int B,
                      int T, int C, int pos0) {
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) {
      const float* te = wte + (int64_t)tokens[b * T + t] * C;
      const float* pe = wpe + (int64_t)(pos0 + t) * C;
      float* o = out + ((int64_t)b * T + t) * C;
      for (int c = 0; c < C; ++c) o[c] = te[c] + pe[c];
    }
}

void embeddingBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B,
                       int T, int C) {
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) {
      const float* d = dout + ((int64_t)b * T + t) * C;
      float* te = dwte + (int64_t)tokens[b * T + t] * C;
      float* pe = dwpe + (int64_t)t * C;
      for (int c = 0; c < C; ++c) {
        te[c] += d[c];
        pe[c] += d[c];
      }
    }
}

}  // namespace ptllm::ref
