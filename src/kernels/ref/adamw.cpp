// Reference AdamW with bias correction and decoupled weight decay.
#include <cmath>

#include "kernels/ref/ref_kernels.h"

namespace ptllm::ref {

void adamw(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1,
           float beta2, float eps, float wd, int t) {
  const double c1 = 1.0 - std::pow(double(beta1), t), c2 = 1.0 - std::pow(double(beta2), t);
  for (int64_t i = 0; i < n; ++i) {
    m[i] = beta1 * m[i] + (1.0f - beta1) * g[i];
    v[i] = beta2 * v[i] + (1.0f - beta2) * g[i] * g[i];
    const double mhat = m[i] / c1, vhat = v[i] / c2;
    p[i] = float(p[i] - lr * (mhat / (std::sqrt(vhat) + eps) + wd * double(p[i])));
  }
}

}  // namespace ptllm::ref
