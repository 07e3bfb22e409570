// Reference causal multi-head attention over a fused qkv[B,Tk,3C]; head h uses channels
// [h*hs, (h+1)*hs) of q, k and v, hs = C/NH, scores scaled by 1/sqrt(hs).
#include <cmath>
#include <vector>

#include "kernels/ref/ref_kernels.h"

namespace ptllm::ref {

void attentionForward(float* out, float* att, const float* qkv, int B, int Tq, int Tk, int C,
                      int NH) {
  const int hs = C / NH;
  const double scale = 1.0 / std::sqrt(double(hs));
  const int q0 = Tk - Tq;  // position of the first query
  std::vector<double> p(Tk);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int i = 0; i < Tq; ++i) {
        const int pos = q0 + i;
        const float* q = qkv + ((int64_t)b * Tk + pos) * 3 * C + h * hs;
        double mx = -INFINITY;
        for (int j = 0; j <= pos; ++j) {
          const float* k = qkv + ((int64_t)b * Tk + j) * 3 * C + C + h * hs;
          double s = 0;
          for (int d = 0; d < hs; ++d) s += double(q[d]) * k[d];
          p[j] = s * scale;
          if (p[j] > mx) mx = p[j];
        }
        double sum = 0;
        for (int j = 0; j <= pos; ++j) sum += (p[j] = std::exp(p[j] - mx));
        float* a = att + (((int64_t)b * NH + h) * Tq + i) * Tk;
        for (int j = 0; j < Tk; ++j) a[j] = j <= pos ? float(p[j] / sum) : 0.0f;
        float* o = out + ((int64_t)b * Tq + i) * C + h * hs;
        for (int d = 0; d < hs; ++d) {
          double s = 0;
          for (int j = 0; j <= pos; ++j)
            s += (p[j] / sum) * qkv[((int64_t)b * Tk + j) * 3 * C + 2 * C + h * hs + d];
          o[d] = float(s);
        }
      }
}

void attentionBackward(float* dqkv, const float* dout, const float* qkv, const float* att, int B,
                       int T, int C, int NH) {
  const int hs = C / NH;
  const double scale = 1.0 / std::sqrt(double(hs));
  for (int64_t i = 0; i < (int64_t)B * T * 3 * C; ++i) dqkv[i] = 0.0f;
  std::vector<double> datt(T), dpre(T);
  // Pointer to head h of part (0 q, 1 k, 2 v) at position t of batch b.
  auto at = [&](auto* base, int b, int t, int part, int h) {
    return base + ((int64_t)b * T + t) * 3 * C + part * C + h * hs;
  };
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int i = 0; i < T; ++i) {
        const float* a = att + (((int64_t)b * NH + h) * T + i) * T;
        const float* dy = dout + ((int64_t)b * T + i) * C + h * hs;
        // out_i = sum_j a_ij v_j
        for (int j = 0; j <= i; ++j) {
          const float* v = at(qkv, b, j, 2, h);
          float* dv = at(dqkv, b, j, 2, h);
          double s = 0;
          for (int d = 0; d < hs; ++d) {
            s += double(dy[d]) * v[d];
            dv[d] += float(double(a[j]) * dy[d]);
          }
          datt[j] = s;
        }
        // softmax backward
        double dot = 0;
        for (int j = 0; j <= i; ++j) dot += a[j] * datt[j];
        for (int j = 0; j <= i; ++j) dpre[j] = a[j] * (datt[j] - dot);
        // pre_ij = scale * q_i . k_j
        const float* q = at(qkv, b, i, 0, h);
        float* dq = at(dqkv, b, i, 0, h);
        for (int j = 0; j <= i; ++j) {
          const float* k = at(qkv, b, j, 1, h);
          float* dk = at(dqkv, b, j, 1, h);
          for (int d = 0; d < hs; ++d) {
            dq[d] += float(dpre[j] * scale * k[d]);
            dk[d] += float(dpre[j] * scale * q[d]);
          }
        }
      }
}

}  // namespace ptllm::ref
