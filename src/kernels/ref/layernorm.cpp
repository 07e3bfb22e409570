// Reference LayerNorm (eps 1e-5, biased variance), forward and backward.
#include <cmath>

#include "kernels/ref/ref_kernels.h"

namespace ptllm::ref {

void layernormForward(float* out, float* mean, float* rstd, const float* in, const float* w,
                      const float* b, int M, int C) {
  for (int m = 0; m < M; ++m) {
    const float* x = in + (int64_t)m * C;
    double mu = 0;
    for (int c = 0; c < C; ++c) mu += x[c];
    mu /= C;
    double var = 0;
    for (int c = 0; c < C; ++c) var += (x[c] - mu) * (x[c] - mu);
    var /= C;
    const double rs = 1.0 / std::sqrt(var + 1e-5);
    float* y = out + (int64_t)m * C;
    for (int c = 0; c < C; ++c) y[c] = float((x[c] - mu) * rs * w[c] + b[c]);
    if (mean) mean[m] = float(mu);
    if (rstd) rstd[m] = float(rs);
  }
}

void layernormBackward(float* din, float* dw, float* db, const float* dout, const float* in,
                       const float* w, const float* mean, const float* rstd, int M, int C) {
  for (int m = 0; m < M; ++m) {
    const float* x = in + (int64_t)m * C;
    const float* dy = dout + (int64_t)m * C;
    const double mu = mean[m], rs = rstd[m];
    double dnormMean = 0, dnormNormMean = 0;
    for (int c = 0; c < C; ++c) {
      const double norm = (x[c] - mu) * rs, dnorm = double(w[c]) * dy[c];
      dnormMean += dnorm;
      dnormNormMean += dnorm * norm;
    }
    dnormMean /= C;
    dnormNormMean /= C;
    float* dx = din + (int64_t)m * C;
    for (int c = 0; c < C; ++c) {
      const double norm = (x[c] - mu) * rs, dnorm = double(w[c]) * dy[c];
      db[c] += dy[c];
      dw[c] += float(norm * dy[c]);
      dx[c] += float((dnorm - dnormMean - norm * dnormNormMean) * rs);
    }
  }
}

}  // namespace ptllm::ref
