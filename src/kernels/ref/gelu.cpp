// Reference GELU, tanh approximation (GPT-2's "gelu_new").
#include <cmath>

#include "kernels/ref/ref_kernels.h"

namespace ptllm::ref {

namespace {
constexpr double kSqrt2OverPi = 0.7978845608028654;
}

float gelu(float xf) {
  const double x = xf;
  return float(0.5 * x * (1.0 + std::tanh(kSqrt2OverPi * (x + 0.044715 * x * x * x))));
}

float geluGrad(float xf) {
  const double x = xf;
  const double u = kSqrt2OverPi * (x + 0.044715 * x * x * x);
  const double th = std::tanh(u);
  const double sech2 = 1.0 - th * th;
  return float(0.5 * (1.0 + th) + 0.5 * x * sech2 * kSqrt2OverPi * (1.0 + 3.0 * 0.044715 * x * x));
}

void geluForward(float* out, const float* in, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = gelu(in[i]);
}

void geluBackward(float* din, const float* in, const float* dout, int64_t n) {
  for (int64_t i = 0; i < n; ++i) din[i] = geluGrad(in[i]) * dout[i];
}

}  // namespace ptllm::ref
