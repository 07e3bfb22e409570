// CpuOps: the CPU backend. Matmuls, attention, LayerNorm, GELU and AdamW are the Highway
// kernels of this folder; the light row-wise ops are threaded loops over rows written for the
// compiler to vectorise.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/thread_pool.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/ops.h"
#include "kernels/ref/ref_kernels.h"

namespace ptllm {
namespace {

constexpr int64_t kElemGrain = 1 << 14;  // elementwise work per thread below which we stay serial

class CpuOps final : public Ops {
 public:
  Device device() const override { return Device::CPU; }
  const char* name() const override { return "cpu"; }
  std::shared_ptr<Buffer> allocBytes(size_t bytes) override { return allocHost(bytes); }
  void upload(Tensor& dst, const float* host) override {
    std::memcpy(dst.data(), host, dst.bytes());
  }
  void download(float* host, const Tensor& src) override {
    std::memcpy(host, src.data(), src.bytes());
  }
  void copy(float* dst, const float* src, int64_t n) override {
    std::memmove(dst, src, size_t(n) * sizeof(float));
  }
  void fill(float* dst, float value, int64_t n) override {
    pool().parallelFor(n, kElemGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) dst[i] = value;
    });
  }

  void matmul(float* out, const float* in, const float* w, const float* bias, int M, int K,
              int N) override {
    cpu::matmul(out, in, w, bias, M, K, N);
  }
  void matmulAbt(float* out, const float* a, const float* b, int M, int K, int N,
                 bool accumulate) override {
    cpu::matmulAbt(out, a, b, M, K, N, accumulate);
  }
  void matmulAtb(float* out, const float* a, const float* b, int M, int K, int N,
                 bool accumulate) override {
    cpu::matmulAtb(out, a, b, M, K, N, accumulate);
  }
  void biasBackward(float* dbias, const float* dout, int M, int N) override {
    cpu::biasBackward(dbias, dout, M, N);
  }
  void matmulAtbBias(float* out, float* dbias, const float* a, const float* b, int M, int K, int N,
                     bool accumulate) override {
    cpu::matmulAtbBias(out, dbias, a, b, M, K, N, accumulate);
  }

  void add(float* out, const float* a, const float* b, int64_t n) override {
    pool().parallelFor(n, kElemGrain, [&](int64_t s, int64_t e) {
      for (int64_t i = s; i < e; ++i) out[i] = a[i] + b[i];
    });
  }

  void layernormForward(float* out, float* mean, float* rstd, const float* in, const float* w,
                        const float* b, int M, int C) override {
    cpu::layernormForward(out, mean, rstd, in, w, b, M, C);
  }
  void layernormBackward(float* din, float* dw, float* db, const float* dout, const float* in,
                         const float* w, const float* mean, const float* rstd, int M,
                         int C) override {
    cpu::layernormBackward(din, dw, db, dout, in, w, mean, rstd, M, C);
  }

  void geluForward(float* out, const float* in, int64_t n) override {
    cpu::geluForward(out, in, n);
  }
  void geluBackward(float* din, const float* in, const float* dout, int64_t n) override {
    cpu::geluBackward(din, in, dout, n);
  }

  void attentionForward(float* out, float* att, const float* qkv, int B, int Tq, int Tk, int C,
                        int NH) override {
    cpu::attentionForward(out, att, qkv, B, Tq, Tk, C, NH);
  }
  void attentionBackward(float* dqkv, const float* dout, const float* qkv, const float* att, int B,
                         int T, int C, int NH) override {
    cpu::attentionBackward(dqkv, dout, qkv, att, B, T, C, NH);
  }

  void embeddingForward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                        int B, int T, int C, int pos0) override {
    pool().parallelFor(int64_t(B) * T, 64, [&](int64_t s, int64_t e) {
      for (int64_t i = s; i < e; ++i) {
        const float* te = wte + int64_t(tokens[i]) * C;
        const float* pe = wpe + (pos0 + i % T) * int64_t(C);
        float* o = out + i * C;
        for (int c = 0; c < C; ++c) o[c] = te[c] + pe[c];
      }
    });
  }
  void embeddingBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B,
                         int T, int C) override {
    // Split over channels so no two threads write the same row element.
    pool().parallelFor(C, 16, [&](int64_t c0, int64_t c1) {
      for (int64_t i = 0; i < int64_t(B) * T; ++i) {
        const float* d = dout + i * C;
        float* te = dwte + int64_t(tokens[i]) * C;
        float* pe = dwpe + (i % T) * C;
        for (int64_t c = c0; c < c1; ++c) {
          te[c] += d[c];
          pe[c] += d[c];
        }
      }
    });
  }

  void crossEntropy(float* losses, float* dlogits, const float* logits, const int32_t* targets,
                    int M, int V, float dscale) override {
    pool().parallelFor(M, 8, [&](int64_t r0, int64_t r1) {
      for (int64_t m = r0; m < r1; ++m) {
        const float* x = logits + m * V;
        const int tgt = targets[m];
        float mx = -INFINITY;
        for (int v = 0; v < V; ++v) mx = std::max(mx, x[v]);
        double sum = 0;
        for (int v = 0; v < V; ++v) sum += std::exp(x[v] - mx);
        const float logZ = mx + float(std::log(sum));
        losses[m] = tgt < 0 ? 0.0f : logZ - x[tgt];
        if (dlogits) {
          float* d = dlogits + m * V;
          for (int v = 0; v < V; ++v) {
            const float p = std::exp(x[v] - logZ);
            d[v] = tgt < 0 ? 0.0f : (p - (v == tgt ? 1.0f : 0.0f)) * dscale;
          }
        }
      }
    });
  }

  double sumSquares(const float* x, int64_t n) override {
    const int threads = threadCount();
    std::vector<double> part(threads, 0.0);
    pool().run(threads, [&](int t) {
      const int64_t s = n * t / threads, e = n * (t + 1) / threads;
      double acc = 0;
      for (int64_t i = s; i < e; ++i) acc += double(x[i]) * x[i];
      part[t] = acc;
    });
    double s = 0;
    for (double p : part) s += p;
    return s;
  }
  void scale(float* x, float s, int64_t n) override {
    pool().parallelFor(n, kElemGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) x[i] *= s;
    });
  }
  void adamw(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1,
             float beta2, float eps, float wd, int t) override {
    cpu::adamw(p, g, m, v, n, lr, beta1, beta2, eps, wd, t);
  }
};

}  // namespace

std::unique_ptr<Ops> makeCpuOps() {
  return std::make_unique<CpuOps>();
}

}  // namespace ptllm
