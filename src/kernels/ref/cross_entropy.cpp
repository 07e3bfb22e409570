// Reference softmax cross-entropy (max-subtracted, sums in double).
#include <cmath>

#include "kernels/ref/ref_kernels.h"

namespace ptllm::ref {

void crossEntropy(float* losses, float* dlogits, const float* logits, const int32_t* targets, int M,
                  int V, float dscale) {
  for (int m = 0; m < M; ++m) {
    const float* x = logits + (int64_t)m * V;
    const int tgt = targets[m];
    double mx = -INFINITY;
    for (int v = 0; v < V; ++v) mx = x[v] > mx ? x[v] : mx;
    double sum = 0;
    for (int v = 0; v < V; ++v) sum += std::exp(x[v] - mx);
    const double logZ = mx + std::log(sum);
    losses[m] = tgt < 0 ? 0.0f : float(logZ - x[tgt]);
    if (dlogits) {
      float* d = dlogits + (int64_t)m * V;
      for (int v = 0; v < V; ++v) {
        const double p = std::exp(double(x[v]) - logZ);  // read x before d overwrites it
        d[v] = tgt < 0 ? 0.0f : float((p - (v == tgt ? 1.0 : 0.0)) * dscale);
      }
    }
  }
}

}  // namespace ptllm::ref
