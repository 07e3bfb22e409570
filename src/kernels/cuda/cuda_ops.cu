// CudaOps: the Ops interface over the backend's own f32 kernels (ops_*.cu) on device 0. All
// work is queued on cuda::stream(); the host waits only where it needs data (allocation,
// download, sumSquares). Memory is plain cudaMalloc (never managed).
#include <cstring>
#include <mutex>

#include "core/error.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_device.h"
#include "kernels/cuda/ops_kernels.cuh"
#include "kernels/ops.h"

namespace ptllm {

namespace cuda {

DeviceScratch::~DeviceScratch() {
  if (ptr_) cudaFree(ptr_);  // no throwing from a destructor; errors here are moot
}

void* DeviceScratch::get(size_t bytes) {
  if (bytes <= bytes_) return ptr_;
  if (ptr_) {
    // Kernels queued earlier may still read the old block.
    PTLLM_CUDA_CHECK(cudaStreamSynchronize(stream()));
    PTLLM_CUDA_CHECK(cudaFree(ptr_));
    ptr_ = nullptr;
    bytes_ = 0;
  }
  const size_t grown = bytes + bytes / 4;  // some headroom for slowly growing requests
  PTLLM_CUDA_CHECK(cudaMalloc(&ptr_, grown));
  bytes_ = grown;
  return ptr_;
}

const int32_t* uploadIds(DeviceScratch& scratch, const int32_t* hostIds, int64_t n) {
  int32_t* d = scratch.as<int32_t>(size_t(n));
  // From pageable memory: returns once the host data is staged, so the caller may reuse it.
  PTLLM_CUDA_CHECK(
      cudaMemcpyAsync(d, hostIds, size_t(n) * sizeof(int32_t), cudaMemcpyHostToDevice, stream()));
  return d;
}

}  // namespace cuda

namespace {

class CudaOps final : public Ops {
 public:
  CudaOps() {
    const CudaDeviceInfo& info = cudaDeviceInfo();
    if (!info.available) fail("--device cuda: {}", info.reason);
    PTLLM_CUDA_CHECK(cudaSetDevice(0));
    sms_ = info.multiprocessors;
    cuda::stream();               // created now: errors surface at construction
    cuda::decodeStepMaxBlocks();  // asked now, never inside a step capture
  }
  ~CudaOps() override {
    if (captureStream_) cudaStreamDestroy(captureStream_);
    if (captureReady_) cudaEventDestroy(captureReady_);
    if (stepCopied_) cudaEventDestroy(stepCopied_);
    if (pinnedStep_) cudaFreeHost(pinnedStep_);
    if (pinnedDown_) cudaFreeHost(pinnedDown_);
  }

  Device device() const override { return Device::CUDA; }
  const char* name() const override { return "cuda"; }

  std::shared_ptr<Buffer> allocBytes(size_t bytes) override {
    auto buf = std::make_shared<Buffer>();
    buf->bytes = bytes;
    buf->device = Device::CUDA;
    if (bytes == 0) return buf;
    void* p = nullptr;
    PTLLM_CUDA_CHECK(cudaMalloc(&p, bytes));
    buf->ptr = p;
    buf->free = [](void* q) { cudaFree(q); };
    PTLLM_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, cuda::stream()));
    PTLLM_CUDA_CHECK(cudaStreamSynchronize(cuda::stream()));
    return buf;
  }
  void upload(Tensor& dst, const float* host) override {
    if (dst.bytes() == 0) return;
    PTLLM_CUDA_CHECK(
        cudaMemcpyAsync(dst.data(), host, dst.bytes(), cudaMemcpyHostToDevice, cuda::stream()));
  }
  void download(float* host, const Tensor& src) override {
    downloadBytes(host, src.data(), src.bytes());
  }
  void copy(float* dst, const float* src, int64_t n) override {
    if (n <= 0 || dst == src) return;
    PTLLM_CUDA_CHECK(cudaMemcpyAsync(dst, src, size_t(n) * sizeof(float), cudaMemcpyDeviceToDevice,
                                     cuda::stream()));
  }
  void fill(float* dst, float value, int64_t n) override { cuda::launchFill(dst, value, n); }

  void matmul(float* out, const float* in, const float* w, const float* bias, int M, int K,
              int N) override {
    cuda::launchMatmul(out, in, w, bias, M, K, N, sms_);
  }
  void matmulAbt(float* out, const float* a, const float* b, int M, int K, int N,
                 bool accumulate) override {
    cuda::launchMatmulAbt(out, a, b, M, K, N, accumulate, sms_);
  }
  void matmulAtb(float* out, const float* a, const float* b, int M, int K, int N,
                 bool accumulate) override {
    cuda::launchMatmulAtb(out, a, b, M, K, N, accumulate, sms_);
  }
  void biasBackward(float* dbias, const float* dout, int M, int N) override {
    cuda::launchBiasBackward(dbias, dout, M, N, sms_, scratch_);
  }

  void add(float* out, const float* a, const float* b, int64_t n) override {
    cuda::launchAdd(out, a, b, n);
  }
  void layernormForward(float* out, float* mean, float* rstd, const float* in, const float* w,
                        const float* b, int M, int C) override {
    cuda::launchLayernormForward(out, mean, rstd, in, w, b, M, C);
  }
  void layernormBackward(float* din, float* dw, float* db, const float* dout, const float* in,
                         const float* w, const float* mean, const float* rstd, int M,
                         int C) override {
    cuda::launchLayernormBackward(din, dw, db, dout, in, w, mean, rstd, M, C, sms_, scratch_);
  }
  void geluForward(float* out, const float* in, int64_t n) override {
    cuda::launchGeluForward(out, in, n);
  }
  void geluBackward(float* din, const float* in, const float* dout, int64_t n) override {
    cuda::launchGeluBackward(din, in, dout, n);
  }

  void attentionForward(float* out, float* att, const float* qkv, int B, int Tq, int Tk, int C,
                        int NH) override {
    cuda::launchAttentionForward(out, att, qkv, B, Tq, Tk, C, NH);
  }
  void attentionBackward(float* dqkv, const float* dout, const float* qkv, const float* att, int B,
                         int T, int C, int NH) override {
    cuda::launchAttentionBackward(dqkv, dout, qkv, att, B, T, C, NH, scratch_);
  }

  void embeddingForward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                        int B, int T, int C, int pos0) override {
    cuda::launchEmbeddingForward(out, tokens, wte, wpe, B, T, C, pos0, ids_);
  }
  void embeddingBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B,
                         int T, int C) override {
    cuda::launchEmbeddingBackward(dwte, dwpe, dout, tokens, B, T, C, ids_);
  }
  void crossEntropy(float* losses, float* dlogits, const float* logits, const int32_t* targets,
                    int M, int V, float dscale) override {
    cuda::launchCrossEntropy(losses, dlogits, logits, targets, M, V, dscale, ids_);
  }

  // ---- replayable decode steps ----
  class Graph final : public StepGraph {
   public:
    explicit Graph(cudaGraphExec_t exec) : exec_(exec) {}
    ~Graph() override { cudaGraphExecDestroy(exec_); }
    void replay() override { PTLLM_CUDA_CHECK(cudaGraphLaunch(exec_, cuda::stream())); }

   private:
    cudaGraphExec_t exec_;
  };
  bool supportsStepGraphs() const override { return true; }
  void beginStepCapture() override {
    if (!captureStream_) {
      PTLLM_CUDA_CHECK(cudaStreamCreateWithFlags(&captureStream_, cudaStreamNonBlocking));
      PTLLM_CUDA_CHECK(cudaEventCreateWithFlags(&captureReady_, cudaEventDisableTiming));
    }
    // The recording starts after what this thread already queued.
    PTLLM_CUDA_CHECK(cudaEventRecord(captureReady_, cuda::stream()));
    PTLLM_CUDA_CHECK(cudaStreamWaitEvent(captureStream_, captureReady_, 0));
    PTLLM_CUDA_CHECK(cudaStreamBeginCapture(captureStream_, cudaStreamCaptureModeThreadLocal));
    cuda::setThreadStream(captureStream_);
  }
  std::unique_ptr<StepGraph> endStepCapture() override {
    cuda::setThreadStream(nullptr);
    cudaGraph_t graph = nullptr;
    PTLLM_CUDA_CHECK(cudaStreamEndCapture(captureStream_, &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    PTLLM_CUDA_CHECK(err);
    return std::make_unique<Graph>(exec);
  }
  void setDecodeStep(int32_t* step, int32_t token, int32_t pos) override {
    if (!pinnedStep_) {
      PTLLM_CUDA_CHECK(cudaMallocHost(&pinnedStep_, 2 * sizeof(int32_t)));
      PTLLM_CUDA_CHECK(cudaEventCreateWithFlags(&stepCopied_, cudaEventDisableTiming));
    } else {
      PTLLM_CUDA_CHECK(cudaEventSynchronize(stepCopied_));  // the last copy has read it
    }
    pinnedStep_[0] = token;
    pinnedStep_[1] = pos;
    PTLLM_CUDA_CHECK(cudaMemcpyAsync(step, pinnedStep_, 2 * sizeof(int32_t), cudaMemcpyHostToDevice,
                                     cuda::stream()));
    PTLLM_CUDA_CHECK(cudaEventRecord(stepCopied_, cuda::stream()));
  }
  void greedyAdvance(int32_t* step, int32_t* tokens, const float* logits, int V) override {
    cuda::launchGreedyAdvance(step, tokens, logits, V);
  }
  void downloadIds(int32_t* host, const int32_t* src, int n) override {
    if (n > 0) downloadBytes(host, src, size_t(n) * sizeof(int32_t));
  }
  void uploadIds(int32_t* dst, const int32_t* host, int n) override {
    // From pageable memory: returns once the host data is staged.
    if (n > 0)
      PTLLM_CUDA_CHECK(cudaMemcpyAsync(dst, host, size_t(n) * sizeof(int32_t),
                                       cudaMemcpyHostToDevice, cuda::stream()));
  }
  void embeddingStep(float* out, const int32_t* step, const float* wte, const float* wpe,
                     int C) override {
    cuda::launchEmbeddingStep(out, step, wte, wpe, C);
  }
  void attentionStep(float* out, float* att, float* cache, const float* qkvNew, int C, int NH,
                     int maxT, const int32_t* step) override {
    cuda::launchAttentionStep(out, att, cache, qkvNew, C, NH, maxT, step);
  }
  int decodeStepFused(const DecodeStepArgs& args) override { return cuda::launchDecodeStep(args); }
  int decodeStepForms() const override { return cuda::decodeStepForms(); }

  double sumSquares(const float* x, int64_t n) override { return cuda::sumSquares(x, n, scratch_); }
  void scale(float* x, float s, int64_t n) override { cuda::launchScale(x, s, n); }
  void adamw(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1,
             float beta2, float eps, float wd, int t) override {
    cuda::launchAdamw(p, g, m, v, n, lr, beta1, beta2, eps, wd, t);
  }

 private:
  void downloadBytes(void* host, const void* src, size_t bytes) {
    if (bytes == 0) return;
    if (bytes <= kPinnedDownloadBytes) {
      // Small reads (a decode step's logits, generated ids) through page-locked staging: a true
      // async copy, without the pageable path's extra staging on every token.
      std::lock_guard<std::mutex> lock(pinnedDownMutex_);
      if (!pinnedDown_) PTLLM_CUDA_CHECK(cudaMallocHost(&pinnedDown_, kPinnedDownloadBytes));
      PTLLM_CUDA_CHECK(
          cudaMemcpyAsync(pinnedDown_, src, bytes, cudaMemcpyDeviceToHost, cuda::stream()));
      PTLLM_CUDA_CHECK(cudaStreamSynchronize(cuda::stream()));
      std::memcpy(host, pinnedDown_, bytes);
      return;
    }
    PTLLM_CUDA_CHECK(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, cuda::stream()));
    PTLLM_CUDA_CHECK(cudaStreamSynchronize(cuda::stream()));
  }

  int sms_ = 0;
  cudaStream_t captureStream_ = nullptr;  // this object's step recordings
  cudaEvent_t captureReady_ = nullptr, stepCopied_ = nullptr;
  int32_t* pinnedStep_ = nullptr;  // setDecodeStep's staging (page-locked: a true async copy)
  static constexpr size_t kPinnedDownloadBytes = size_t(64) << 10;
  std::mutex pinnedDownMutex_;
  void* pinnedDown_ = nullptr;   // download's staging for small reads
  cuda::DeviceScratch scratch_;  // reductions' partial sums, attention backward's dscores
  cuda::DeviceScratch ids_;      // token / target ids copied from the host
};

}  // namespace

std::unique_ptr<Ops> makeCudaOps() {
  return std::make_unique<CudaOps>();
}

}  // namespace ptllm
