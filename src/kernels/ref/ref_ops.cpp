// RefOps: the Ops interface over the reference kernels, on the host, single-threaded.
#include <cstring>

#include "kernels/ops.h"
#include "kernels/ref/ref_kernels.h"

namespace ptllm {
namespace {

class RefOps final : public Ops {
 public:
  Device device() const override { return Device::CPU; }
  const char* name() const override { return "ref"; }
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
    for (int64_t i = 0; i < n; ++i) dst[i] = value;
  }
  void matmul(float* out, const float* in, const float* w, const float* bias, int M, int K,
              int N) override {
    ref::matmul(out, in, w, bias, M, K, N);
  }
  void matmulAbt(float* out, const float* a, const float* b, int M, int K, int N,
                 bool accumulate) override {
    ref::matmulAbt(out, a, b, M, K, N, accumulate);
  }
  void matmulAtb(float* out, const float* a, const float* b, int M, int K, int N,
                 bool accumulate) override {
    ref::matmulAtb(out, a, b, M, K, N, accumulate);
  }
  void biasBackward(float* dbias, const float* dout, int M, int N) override {
    ref::biasBackward(dbias, dout, M, N);
  }
  void add(float* out, const float* a, const float* b, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
  }
  void layernormForward(float* out, float* mean, float* rstd, const float* in, const float* w,
                        const float* b, int M, int C) override {
    ref::layernormForward(out, mean, rstd, in, w, b, M, C);
  }
  void layernormBackward(float* din, float* dw, float* db, const float* dout, const float* in,
                         const float* w, const float* mean, const float* rstd, int M,
                         int C) override {
    ref::layernormBackward(din, dw, db, dout, in, w, mean, rstd, M, C);
  }
  void geluForward(float* out, const float* in, int64_t n) override {
    ref::geluForward(out, in, n);
  }
  void geluBackward(float* din, const float* in, const float* dout, int64_t n) override {
    ref::geluBackward(din, in, dout, n);
  }
  void attentionForward(float* out, float* att, const float* qkv, int B, int Tq, int Tk, int C,
                        int NH) override {
    ref::attentionForward(out, att, qkv, B, Tq, Tk, C, NH);
  }
  void attentionBackward(float* dqkv, const float* dout, const float* qkv, const float* att, int B,
                         int T, int C, int NH) override {
    ref::attentionBackward(dqkv, dout, qkv, att, B, T, C, NH);
  }
  void embeddingForward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                        int B, int T, int C, int pos0) override {
    ref::embeddingForward(out, tokens, wte, wpe, B, T, C, pos0);
  }
  void embeddingBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B,
                         int T, int C) override {
    ref::embeddingBackward(dwte, dwpe, dout, tokens, B, T, C);
  }
  void crossEntropy(float* losses, float* dlogits, const float* logits, const int32_t* targets,
                    int M, int V, float dscale) override {
    ref::crossEntropy(losses, dlogits, logits, targets, M, V, dscale);
  }
  double sumSquares(const float* x, int64_t n) override {
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += double(x[i]) * x[i];
    return s;
  }
  void scale(float* x, float s, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) x[i] *= s;
  }
  void adamw(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1,
             float beta2, float eps, float wd, int t) override {
    ref::adamw(p, g, m, v, n, lr, beta1, beta2, eps, wd, t);
  }
};

}  // namespace

std::unique_ptr<Ops> makeRefOps() {
  return std::make_unique<RefOps>();
}

}  // namespace ptllm
