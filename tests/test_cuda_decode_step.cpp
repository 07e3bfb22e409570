// The fused decode step (Ops::decodeStepFused, kernels/cuda/decode_step.cu) over a table of
// model shapes: bit for bit against the op-by-op step on the same GPU (the ops Gpt2 records,
// with f32, f16-storage and mixed weights, at several cluster sizes), and against the strict
// CPU reference (RefOps, on the weights the GPU stores) within a stated tolerance. Outputs and
// the cache row being written are poisoned with NaN first; cache rows past the position hold
// guard values that must survive. Then the model: greedy decode with the fused step equals the
// op-by-op kernels (recorded and not) bit for bit. Every test skips without a usable GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/half.h"
#include "gate/paths.h"
#include "kernels/cuda/cuda_device.h"
#include "kernels/cuda/cuda_paths.h"
#include "kernels/ops.h"
#include "model/gpt2.h"
#include "test_util.h"

namespace ptllm {
namespace {

constexpr float kGuardValue = 12345.5f;

// weights: "f32" (every linear f32), "f16" (every linear f16-storage), "mixed" (alternating).
struct StepShape {
  int C, NH, L, V, maxT, pos;
  const char* weights;
};
// The bundled model's shape at its first, a middle and its last position; head sizes 64 and 32
// (the attention's fixed-size loads) and odd ones (16, 18, 10, 100: the general loop); C not a
// multiple of 4 or 32 (GEMV tails, f16 padding K < Kp); one head, many heads; one layer, no
// layer; vocabularies of 1 to 5000; C = 2048 (the largest: K = 8192, several rounds per lane).
const StepShape kShapes[] = {
    {256, 4, 4, 65, 256, 0, "f16"},    {256, 4, 4, 65, 256, 100, "f16"},
    {256, 4, 4, 65, 256, 255, "f16"},  {256, 4, 4, 65, 256, 131, "f32"},
    {256, 4, 4, 65, 256, 77, "mixed"}, {48, 3, 2, 17, 16, 5, "f32"},
    {48, 3, 2, 17, 16, 15, "f16"},     {64, 1, 1, 1, 8, 7, "f16"},
    {128, 4, 3, 300, 64, 33, "mixed"}, {200, 2, 2, 129, 40, 39, "f16"},
    {36, 2, 1, 7, 5, 2, "f16"},        {30, 3, 2, 11, 9, 4, "mixed"},
    {32, 2, 0, 5, 4, 1, "f32"},        {768, 12, 2, 5000, 128, 70, "f16"},
    {2048, 16, 1, 33, 32, 31, "f16"},  {2048, 32, 1, 9, 32, 12, "f32"},
};

bool isF16(const StepShape& s, int layer, int which) {
  const std::string w = s.weights;
  return w == "f16" || (w == "mixed" && (layer + which) % 2 == 0);
}

float roundF16(float x) {
  return f16ToF32(f32ToF16(x));
}

// One step's inputs on the host: weights per layer (attn, proj, fc, fcProj in that order), the
// KV cache rows before `pos` (random), and the token.
struct HostLinear {
  int K, N;
  std::vector<float> w, b;  // w[K,N] (rounded to f16 when the linear is f16-storage)
  bool f16;
};
struct HostLayer {
  std::vector<float> ln1w, ln1b, ln2w, ln2b, cache;
  HostLinear lin[4];
};
struct HostStep {
  StepShape s;
  int token;
  std::vector<float> wte, wpe, lnfw, lnfb;
  std::vector<HostLayer> layers;
};

HostStep makeStep(const StepShape& s, uint64_t seed) {
  HostStep h{s, int(seed % uint64_t(s.V)), {}, {}, {}, {}, {}};
  const int C = s.C;
  h.wte = test::randomVector(size_t(s.V) * C, ++seed);
  h.wpe = test::randomVector(size_t(s.maxT) * C, ++seed, -0.5f, 0.5f);
  h.lnfw = test::randomVector(size_t(C), ++seed, 0.5f, 1.5f);
  h.lnfb = test::randomVector(size_t(C), ++seed, -0.1f, 0.1f);
  for (int l = 0; l < s.L; ++l) {
    HostLayer L;
    L.ln1w = test::randomVector(size_t(C), ++seed, 0.5f, 1.5f);
    L.ln1b = test::randomVector(size_t(C), ++seed, -0.1f, 0.1f);
    L.ln2w = test::randomVector(size_t(C), ++seed, 0.5f, 1.5f);
    L.ln2b = test::randomVector(size_t(C), ++seed, -0.1f, 0.1f);
    const int dims[4][2] = {{C, 3 * C}, {C, C}, {C, 4 * C}, {4 * C, C}};
    for (int i = 0; i < 4; ++i) {
      HostLinear& lin = L.lin[i];
      lin.K = dims[i][0];
      lin.N = dims[i][1];
      const float a = 1.0f / std::sqrt(float(lin.K));  // outputs of order 1
      lin.w = test::randomVector(size_t(lin.K) * lin.N, ++seed, -a, a);
      lin.b = test::randomVector(size_t(lin.N), ++seed, -0.1f, 0.1f);
      lin.f16 = isF16(s, l, i);
      if (lin.f16)
        for (float& x : lin.w) x = roundF16(x);  // what the pack stores (exactly representable)
    }
    // Rows before pos: earlier tokens' q|k|v; row pos: poison (the step writes it); after:
    // guards (never touched).
    L.cache.assign(size_t(s.maxT) * 3 * C, kGuardValue);
    const auto earlier = test::randomVector(size_t(s.pos) * 3 * C, ++seed);
    std::copy(earlier.begin(), earlier.end(), L.cache.begin());
    std::fill_n(L.cache.begin() + int64_t(s.pos) * 3 * C, 3 * C, std::nanf(""));
    h.layers.push_back(std::move(L));
  }
  return h;
}

// The step's outputs, on the host.
struct StepOut {
  std::vector<float> logits, x, y, hidden;
  std::vector<std::vector<float>> cache;  // every layer's whole cache
};

// The reference step on RefOps (host memory): the op sequence of Gpt2::forwardCached for one
// token at `pos`, the new q|k|v row stored into the cache before attending.
StepOut referenceStep(Ops& ref, const HostStep& h) {
  const StepShape& s = h.s;
  const int C = s.C;
  StepOut o;
  o.x.resize(size_t(C));
  o.y.assign(size_t(C), 0.f);
  o.hidden.assign(size_t(4) * C, 0.f);
  const size_t c = static_cast<size_t>(C);
  std::vector<float> ln(c), qkv(3 * c), proj(c), att(size_t(s.NH) * (s.pos + 1));
  const int32_t tok = h.token;
  ref.embeddingForward(o.x.data(), &tok, h.wte.data(), h.wpe.data(), 1, 1, C, s.pos);
  for (int l = 0; l < s.L; ++l) {
    const HostLayer& L = h.layers[size_t(l)];
    std::vector<float> cache = L.cache;
    ref.layernormForward(ln.data(), nullptr, nullptr, o.x.data(), L.ln1w.data(), L.ln1b.data(), 1,
                         C);
    ref.matmul(qkv.data(), ln.data(), L.lin[0].w.data(), L.lin[0].b.data(), 1, C, 3 * C);
    std::copy(qkv.begin(), qkv.end(), cache.begin() + int64_t(s.pos) * 3 * C);
    ref.attentionForward(o.y.data(), att.data(), cache.data(), 1, 1, s.pos + 1, C, s.NH);
    ref.matmul(proj.data(), o.y.data(), L.lin[1].w.data(), L.lin[1].b.data(), 1, C, C);
    ref.add(o.x.data(), o.x.data(), proj.data(), C);
    ref.layernormForward(ln.data(), nullptr, nullptr, o.x.data(), L.ln2w.data(), L.ln2b.data(), 1,
                         C);
    ref.matmul(o.hidden.data(), ln.data(), L.lin[2].w.data(), L.lin[2].b.data(), 1, C, 4 * C);
    ref.geluForward(o.hidden.data(), o.hidden.data(), 4 * C);
    ref.matmul(proj.data(), o.hidden.data(), L.lin[3].w.data(), L.lin[3].b.data(), 1, 4 * C, C);
    ref.add(o.x.data(), o.x.data(), proj.data(), C);
    o.cache.push_back(std::move(cache));
  }
  std::vector<float> lnf(c);
  ref.layernormForward(lnf.data(), nullptr, nullptr, o.x.data(), h.lnfw.data(), h.lnfb.data(), 1,
                       C);
  o.logits.resize(size_t(s.V));
  ref.matmulAbt(o.logits.data(), lnf.data(), h.wte.data(), 1, C, s.V, false);
  return o;
}

// One copy of the step on the GPU: weights (f32, or packed for f16-storage linears), its own KV
// caches and scratch, outputs poisoned.
class DeviceStep {
 public:
  DeviceStep(Ops& gpu, const HostStep& h) : gpu_(gpu), h_(h) {
    const StepShape& s = h.s;
    const int C = s.C;
    wte_ = up(h.wte);
    wpe_ = up(h.wpe);
    lnfw_ = up(h.lnfw);
    lnfb_ = up(h.lnfb);
    for (const HostLayer& L : h.layers) {
      Layer d;
      d.ln1w = up(L.ln1w);
      d.ln1b = up(L.ln1b);
      d.ln2w = up(L.ln2w);
      d.ln2b = up(L.ln2b);
      d.cache = up(L.cache);
      for (int i = 0; i < 4; ++i) {
        const HostLinear& l = L.lin[i];
        d.w[i] = up(l.w);
        d.b[i] = up(l.b);
        if (l.f16) {
          d.packed[i] = gpu.allocBytes(cuda::f16PackedBytes(l.K, l.N));
          if (!cuda::packF16(d.packed[i]->ptr, d.w[i].data(), l.K, l.N))
            throw Error("packF16 refused the test's weights");
        }
      }
      layers_.push_back(std::move(d));
    }
    x_ = up(test::poisoned(size_t(C)));
    ln_ = up(test::poisoned(size_t(C)));
    y_ = up(test::poisoned(size_t(C)));
    proj_ = up(test::poisoned(size_t(C)));
    h_buf_ = up(test::poisoned(size_t(4) * C));
    qkv_ = up(test::poisoned(size_t(3) * C));
    lnf_ = up(test::poisoned(size_t(C)));
    att_ = up(test::poisoned(size_t(s.NH) * s.maxT));
    logits_ = up(test::poisoned(size_t(s.V)));
    step_ = gpu.allocBytes(2 * sizeof(int32_t));
    gpu.setDecodeStep(static_cast<int32_t*>(step_->ptr), h.token, s.pos);
  }

  // The step as Gpt2 records it op by op (Gpt2::recordOpSteps), run directly.
  void runOpByOp() {
    const StepShape& s = h_.s;
    const int C = s.C;
    const int32_t* step = static_cast<const int32_t*>(step_->ptr);
    gpu_.embeddingStep(x_.data(), step, wte_.data(), wpe_.data(), C);
    for (int l = 0; l < s.L; ++l) {
      Layer& L = layers_[size_t(l)];
      gpu_.layernormForward(ln_.data(), nullptr, nullptr, x_.data(), L.ln1w.data(), L.ln1b.data(),
                            1, C);
      linear(L, 0, qkv_.data(), ln_.data());
      gpu_.attentionStep(y_.data(), att_.data(), L.cache.data(), qkv_.data(), C, s.NH, s.maxT,
                         step);
      linear(L, 1, proj_.data(), y_.data());
      gpu_.add(x_.data(), x_.data(), proj_.data(), C);
      gpu_.layernormForward(ln_.data(), nullptr, nullptr, x_.data(), L.ln2w.data(), L.ln2b.data(),
                            1, C);
      linear(L, 2, h_buf_.data(), ln_.data());
      gpu_.geluForward(h_buf_.data(), h_buf_.data(), int64_t(4) * C);
      linear(L, 3, proj_.data(), h_buf_.data());
      gpu_.add(x_.data(), x_.data(), proj_.data(), C);
    }
    gpu_.layernormForward(lnf_.data(), nullptr, nullptr, x_.data(), lnfw_.data(), lnfb_.data(), 1,
                          C);
    gpu_.matmulAbt(logits_.data(), lnf_.data(), wte_.data(), 1, C, s.V, false);
  }

  Ops::DecodeStepArgs args(int clusterBlocks, int form = 0) {
    const StepShape& s = h_.s;
    Ops::DecodeStepArgs a;
    a.C = s.C;
    a.NH = s.NH;
    a.V = s.V;
    a.maxT = s.maxT;
    for (Layer& L : layers_) {
      Ops::DecodeLayer d;
      d.ln1w = L.ln1w.data();
      d.ln1b = L.ln1b.data();
      d.ln2w = L.ln2w.data();
      d.ln2b = L.ln2b.data();
      Ops::DecodeLinear* lins[4] = {&d.attn, &d.proj, &d.fc, &d.fcProj};
      for (int i = 0; i < 4; ++i) {
        lins[i]->b = L.b[i].data();
        lins[i]->f16Storage = bool(L.packed[i]);
        lins[i]->w = L.packed[i] ? L.packed[i]->ptr : static_cast<const void*>(L.w[i].data());
      }
      d.cache = L.cache.data();
      a.layers.push_back(d);
    }
    a.wte = wte_.data();
    a.wpe = wpe_.data();
    a.lnfw = lnfw_.data();
    a.lnfb = lnfb_.data();
    a.step = static_cast<const int32_t*>(step_->ptr);
    a.x = x_.data();
    a.y = y_.data();
    a.h = h_buf_.data();
    a.att = att_.data();
    a.logits = logits_.data();
    a.clusterBlocks = clusterBlocks;
    a.form = form;
    return a;
  }
  int runFused(int clusterBlocks, int form = 0, int32_t* greedyTokens = nullptr) {
    Ops::DecodeStepArgs a = args(clusterBlocks, form);
    a.greedyTokens = greedyTokens;
    return gpu_.decodeStepFused(a);
  }
  // The step buffer: {token, pos}.
  std::vector<int32_t> stepIds() {
    std::vector<int32_t> v(2);
    gpu_.downloadIds(v.data(), static_cast<const int32_t*>(step_->ptr), 2);
    return v;
  }

  StepOut results() {
    StepOut o;
    o.logits = down(logits_);
    o.x = down(x_);
    o.y = down(y_);
    o.hidden = down(h_buf_);
    for (Layer& L : layers_) o.cache.push_back(down(L.cache));
    return o;
  }
  std::vector<float> attRows() { return down(att_); }

 private:
  struct Layer {
    Tensor ln1w, ln1b, ln2w, ln2b, cache, w[4], b[4];
    std::shared_ptr<Buffer> packed[4];
  };
  Tensor up(const std::vector<float>& v) {
    Tensor t = gpu_.alloc({int64_t(v.size())});
    gpu_.upload(t, v.data());
    return t;
  }
  std::vector<float> down(const Tensor& t) {
    std::vector<float> v(size_t(t.numel()));
    gpu_.download(v.data(), t);
    return v;
  }
  void linear(Layer& L, int i, float* out, const float* in) {
    const HostLinear& l = h_.layers[size_t(&L - layers_.data())].lin[i];
    if (L.packed[i])
      cuda::matmulF16(out, in, L.packed[i]->ptr, L.b[i].data(), 1, l.K, l.N);
    else
      gpu_.matmul(out, in, L.w[i].data(), L.b[i].data(), 1, l.K, l.N);
  }

  Ops& gpu_;
  const HostStep& h_;
  Tensor wte_, wpe_, lnfw_, lnfb_, x_, ln_, y_, proj_, h_buf_, qkv_, lnf_, att_, logits_;
  std::vector<Layer> layers_;
  std::shared_ptr<Buffer> step_;
};

// "" when a and b are bitwise equal; otherwise where and by how much they first differ.
std::string bitDifference(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return "sizes differ";
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0)
      return "first difference at " + std::to_string(i) + ": " + std::to_string(a[i]) + " vs " +
             std::to_string(b[i]) + " (max |diff| " +
             std::to_string(test::maxAbsDiff(a.data(), b.data(), a.size())) + ")";
  return "";
}

// n floats holding the int32 bit pattern kIdPoison: a token row no step has written.
constexpr int32_t kIdPoison = -7;
std::vector<float> poisonedIds(int n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (float& f : v) std::memcpy(&f, &kIdPoison, sizeof(f));
  return v;
}
// The int32 token row held in `tokens` (n entries).
std::vector<int32_t> tokenRow(Ops& gpu, Tensor& tokens, int n) {
  std::vector<int32_t> row(static_cast<size_t>(n));
  gpu.downloadIds(row.data(), reinterpret_cast<int32_t*>(tokens.data()), n);
  return row;
}

class CudaDecodeStep : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cudaDeviceInfo().available) GTEST_SKIP() << cudaDeviceInfo().reason;
    gpu = makeCudaOps();
  }
  std::unique_ptr<Ops> gpu;
  std::unique_ptr<Ops> ref = makeRefOps();
};

std::string shapeName(const StepShape& s) {
  return "C=" + std::to_string(s.C) + " NH=" + std::to_string(s.NH) + " L=" + std::to_string(s.L) +
         " V=" + std::to_string(s.V) + " maxT=" + std::to_string(s.maxT) +
         " pos=" + std::to_string(s.pos) + " " + s.weights;
}

// Bit for bit against the op-by-op step on the same GPU: logits, the residual, the last layer's
// attention output, MLP hidden and probabilities, every layer's cache (the new row written,
// earlier rows and the guard rows after it untouched), for each fused form and cluster size.
TEST_F(CudaDecodeStep, FusedEqualsOpByOpBitForBit) {
  uint64_t seed = 1;
  for (const StepShape& s : kShapes) {
    SCOPED_TRACE(shapeName(s));
    const HostStep h = makeStep(s, seed += 100);
    DeviceStep ops(*gpu, h);
    ops.runOpByOp();
    const StepOut want = ops.results();
    ASSERT_TRUE(test::allFinite(want.logits.data(), want.logits.size()));
    for (int form = 0; form <= gpu->decodeStepForms(); ++form)
      for (int blocks : {0, 1, 2, 8, 16}) {
        SCOPED_TRACE("form " + std::to_string(form) + " clusterBlocks " + std::to_string(blocks));
        DeviceStep fused(*gpu, h);
        const int launched = fused.runFused(blocks, form);
        ASSERT_GT(launched, 0) << "the fused step refused a supported shape";
        if (blocks > 0) {
          EXPECT_LE(launched, blocks);
        }
        const StepOut got = fused.results();
        EXPECT_EQ(bitDifference(got.logits, want.logits), "") << "logits";
        EXPECT_EQ(bitDifference(got.x, want.x), "") << "residual x";
        if (s.L > 0) {
          EXPECT_EQ(bitDifference(got.y, want.y), "") << "attention output y";
          EXPECT_EQ(bitDifference(got.hidden, want.hidden), "") << "MLP hidden h";
          // Probabilities of the last layer's heads, rows 0..pos (the rest is never written).
          const auto pa = fused.attRows(), pb = ops.attRows();
          for (int hd = 0; hd < s.NH; ++hd)
            for (int j = 0; j <= s.pos; ++j)
              ASSERT_EQ(pa[size_t(hd) * s.maxT + j], pb[size_t(hd) * s.maxT + j])
                  << "att head " << hd << " key " << j;
        }
        for (int l = 0; l < s.L; ++l) {
          EXPECT_EQ(bitDifference(got.cache[size_t(l)], want.cache[size_t(l)]), "")
              << "cache of layer " << l;
          const auto& c = got.cache[size_t(l)];
          for (size_t i = size_t(s.pos + 1) * 3 * s.C; i < c.size(); ++i)
            ASSERT_EQ(c[i], kGuardValue) << "layer " << l << ": write past row pos at " << i;
        }
      }
  }
}

// The fused greedy pick (DecodeStepArgs::greedyTokens): the step's logits unchanged, and the
// step buffer and token row as greedyAdvance leaves them after the op-by-op step (the first
// largest logit; no other token row entry written), for each form and cluster size.
TEST_F(CudaDecodeStep, FusedGreedyPickEqualsGreedyAdvance) {
  uint64_t seed = 3;
  for (const StepShape& s : kShapes) {
    SCOPED_TRACE(shapeName(s));
    const HostStep h = makeStep(s, seed += 100);
    const StepOut want = [&] {
      DeviceStep ops(*gpu, h);
      ops.runOpByOp();
      return ops.results();
    }();
    const int32_t wantToken =
        int32_t(std::max_element(want.logits.begin(), want.logits.end()) - want.logits.begin());
    const std::vector<float> poison = poisonedIds(s.maxT);
    Tensor tokens = gpu->alloc({int64_t(s.maxT)});
    for (int form = 0; form <= gpu->decodeStepForms(); ++form)
      for (int blocks : {0, 1, 16}) {
        SCOPED_TRACE("form " + std::to_string(form) + " clusterBlocks " + std::to_string(blocks));
        gpu->upload(tokens, poison.data());
        auto* ids = reinterpret_cast<int32_t*>(tokens.data());
        DeviceStep fused(*gpu, h);
        ASSERT_GT(fused.runFused(blocks, form, ids), 0);
        EXPECT_EQ(bitDifference(fused.results().logits, want.logits), "") << "logits";
        EXPECT_EQ(fused.stepIds(), (std::vector<int32_t>{wantToken, s.pos + 1}));
        std::vector<int32_t> row(size_t(s.maxT));
        gpu->downloadIds(row.data(), ids, s.maxT);
        for (int p = 0; p < s.maxT; ++p)
          ASSERT_EQ(row[size_t(p)], p == s.pos ? wantToken : kIdPoison) << "token row at " << p;
      }
  }
}

// Several greedy steps in one launch (DecodeStepArgs::greedySteps, fused form 4): the token
// row, the step buffer, the last step's logits, residual, attention output and MLP hidden, and
// every layer's cache (rows written, guards after them untouched) bit for bit as the same
// number of single greedy steps leave them. Shapes: the bundled model (each block keeps one
// (layer, head) pair's rows for the launch at 16 blocks; at 8 it re-stages them per layer), one
// head and one layer running to the context's end, 5 layers x 4 heads (more pairs than blocks:
// staged per layer), the bundled shape with f32 and with mixed linears (form 4 hands the qkv
// row over in shared memory from either GEMV), and a head size of 16 (no stage, so no form 4:
// refused, nothing written).
TEST_F(CudaDecodeStep, FusedGreedyRunEqualsSingleSteps) {
  struct RunShape {
    StepShape s;
    int steps;
    bool runs;  // form 4 applies: the launch at the device's largest cluster must run
  };
  const RunShape table[] = {
      {{256, 4, 4, 65, 256, 0, "f16"}, 7, true}, {{256, 4, 4, 65, 256, 190, "f16"}, 5, true},
      {{64, 1, 1, 1, 8, 2, "f16"}, 6, true},     {{128, 4, 5, 50, 32, 20, "f16"}, 4, true},
      {{128, 2, 3, 300, 64, 9, "f16"}, 3, true}, {{256, 4, 4, 65, 256, 40, "f32"}, 5, true},
      {{64, 2, 2, 7, 16, 3, "f32"}, 4, true},    {{256, 4, 4, 65, 256, 9, "mixed"}, 4, true},
      {{48, 3, 2, 17, 16, 3, "f16"}, 4, false},
  };
  uint64_t seed = 11;
  for (const RunShape& t : table) {
    const StepShape& s = t.s;
    SCOPED_TRACE(shapeName(s) + " steps=" + std::to_string(t.steps));
    const HostStep h = makeStep(s, seed += 100);
    const std::vector<float> poison = poisonedIds(s.maxT);
    auto tokenRow = [&](Tensor& tokens) { return ptllm::tokenRow(*gpu, tokens, s.maxT); };
    // The single steps: the op kernels' step and greedyAdvance, t.steps times.
    Tensor wantTokens = gpu->alloc({int64_t(s.maxT)});
    gpu->upload(wantTokens, poison.data());
    DeviceStep single(*gpu, h);
    for (int k = 0; k < t.steps; ++k)
      ASSERT_GT(single.runFused(0, 1, reinterpret_cast<int32_t*>(wantTokens.data())), 0);
    const StepOut want = single.results();
    const std::vector<int32_t> wantRow = tokenRow(wantTokens), wantIds = single.stepIds();
    ASSERT_EQ(wantIds[1], s.pos + t.steps);
    for (int blocks : {0, 16, 8, 2}) {
      SCOPED_TRACE("clusterBlocks " + std::to_string(blocks));
      Tensor tokens = gpu->alloc({int64_t(s.maxT)});
      gpu->upload(tokens, poison.data());
      DeviceStep run(*gpu, h);
      Ops::DecodeStepArgs a = run.args(blocks, 4);
      a.greedyTokens = reinterpret_cast<int32_t*>(tokens.data());
      a.greedySteps = t.steps;
      const int launched = gpu->decodeStepFused(a);
      if (launched == 0) {
        EXPECT_FALSE(t.runs && (blocks == 0 || blocks == 16)) << "refused a form 4 run";
        EXPECT_EQ(run.stepIds(), (std::vector<int32_t>{h.token, s.pos})) << "wrote when refused";
        EXPECT_FALSE(test::allFinite(run.results().logits.data(), 1)) << "wrote when refused";
        continue;
      }
      EXPECT_TRUE(t.runs) << "ran a launch form 4 cannot";
      const StepOut got = run.results();
      EXPECT_EQ(tokenRow(tokens), wantRow) << "token row";
      EXPECT_EQ(run.stepIds(), wantIds) << "step buffer";
      EXPECT_EQ(bitDifference(got.logits, want.logits), "") << "logits";
      EXPECT_EQ(bitDifference(got.x, want.x), "") << "residual x";
      EXPECT_EQ(bitDifference(got.y, want.y), "") << "attention output y";
      EXPECT_EQ(bitDifference(got.hidden, want.hidden), "") << "MLP hidden h";
      for (int l = 0; l < s.L; ++l) {
        EXPECT_EQ(bitDifference(got.cache[size_t(l)], want.cache[size_t(l)]), "")
            << "cache of layer " << l;
        const auto& c = got.cache[size_t(l)];
        for (size_t i = size_t(s.pos + t.steps) * 3 * s.C; i < c.size(); ++i)
          ASSERT_EQ(c[i], kGuardValue) << "layer " << l << ": write past the run at " << i;
      }
    }
  }
}

// A speculative greedy run (DecodeStepArgs::speculativeLanes): the token row, the step buffer,
// the logits and every layer's cache rows below the new position bit for bit as the same number
// of single greedy steps (op-by-op form 1) leave them. The history is built so that the drafts
// follow the true continuation for a stretch (a copy of the greedy picks, one of them altered,
// after the same four tokens that end the history), so drafts are kept (random weights' greedy
// text repeats so much that none may be dropped: CudaModel.SpeculativeGreedyRunsEqualGreedyRuns
// drops them on the bundled model's text); near the context's end the run stops where the
// lanes no longer fit.
// Shapes: the bundled one with f16-storage and with f32 linears, a small one, and one that
// starts 20 positions before the context's end.
TEST_F(CudaDecodeStep, SpeculativeRunEqualsGreedySteps) {
  struct SpecShape {
    StepShape s;
    int tokens;
  };
  const SpecShape table[] = {
      {{256, 4, 4, 65, 256, 40, "f16"}, 40},
      {{256, 4, 4, 65, 256, 40, "f32"}, 30},
      {{64, 2, 2, 7, 64, 30, "f16"}, 20},
      {{256, 4, 4, 65, 256, 236, "f16"}, 19},
  };
  uint64_t seed = 21;
  for (const SpecShape& t : table) {
    const StepShape& s = t.s;
    SCOPED_TRACE(shapeName(s) + " tokens=" + std::to_string(t.tokens));
    const HostStep h = makeStep(s, seed += 100);
    const std::vector<float> poison = poisonedIds(s.maxT);
    auto tokenRow = [&](Tensor& tokens) { return ptllm::tokenRow(*gpu, tokens, s.maxT); };
    // The greedy continuation, for the history's planted copy.
    const int runnable = std::min(t.tokens, s.maxT - s.pos);
    std::vector<int32_t> truth;
    {
      Tensor tokens = gpu->alloc({int64_t(s.maxT)});
      DeviceStep single(*gpu, h);
      for (int k = 0; k < runnable; ++k)
        ASSERT_GT(single.runFused(0, 1, reinterpret_cast<int32_t*>(tokens.data())), 0);
      const std::vector<int32_t> row = tokenRow(tokens);
      truth.assign(row.begin() + s.pos, row.begin() + s.pos + runnable);
    }
    // History: vocabulary-cycling filler; at 2..5 the four tokens that end it (the last is the
    // step's token at pos), then the continuation with its 8th token altered.
    std::vector<int32_t> hist(size_t(s.pos));
    for (int i = 0; i < s.pos; ++i) hist[size_t(i)] = (i * 7 + 3) % s.V;
    const int32_t tail[3] = {int32_t(1 % s.V), int32_t(4 % s.V), int32_t(2 % s.V)};
    for (int i = 0; i < 3; ++i) hist[size_t(s.pos - 3 + i)] = tail[i];
    const int plant = 2;
    for (int i = 0; i < 3; ++i) hist[size_t(plant + i)] = tail[i];
    hist[size_t(plant + 3)] = h.token;
    for (int i = 0; plant + 4 + i < s.pos - 3 && i < int(truth.size()); ++i)
      hist[size_t(plant + 4 + i)] =
          i == 7 ? int32_t((truth[size_t(i)] + 1) % s.V) : truth[size_t(i)];
    auto history = gpu->allocBytes(size_t(s.maxT) * sizeof(int32_t));
    gpu->uploadIds(static_cast<int32_t*>(history->ptr), hist.data(), s.pos);
    constexpr int kStats = Ops::DecodeStepArgs::kSpeculativeStats;
    auto stats = gpu->allocBytes(kStats * sizeof(int32_t));
    // 132 SMs (H100, H200): every lane count up to 6 runs as asked. A smaller GPU may run fewer
    // (or, below 2, none): the run must then say so and still be bit for bit.
    const bool hopperSized = cudaDeviceInfo().multiprocessors >= 132;
    for (int lanes : {2, 3, 4, 6, 8}) {
      SCOPED_TRACE("lanes " + std::to_string(lanes));
      Tensor tokens = gpu->alloc({int64_t(s.maxT)});
      gpu->upload(tokens, poison.data());
      DeviceStep run(*gpu, h);
      Ops::DecodeStepArgs a = run.args(0, 4);
      a.greedyTokens = reinterpret_cast<int32_t*>(tokens.data());
      a.greedySteps = t.tokens;
      a.speculativeLanes = lanes;
      a.history = static_cast<const int32_t*>(history->ptr);
      a.speculativeStats = static_cast<int32_t*>(stats->ptr);
      const int32_t zero[kStats] = {};
      int32_t after[kStats];
      gpu->uploadIds(a.speculativeStats, zero, kStats);
      if (gpu->decodeStepFused(a) == 0) {
        // Only where the device cannot hold 2 lanes at once (it runs as many as it holds).
        EXPECT_EQ(run.stepIds(), (std::vector<int32_t>{h.token, s.pos})) << "wrote when refused";
        EXPECT_FALSE(hopperSized) << "refused a speculative run of " << lanes << " lanes";
        continue;
      }
      gpu->downloadIds(after, a.speculativeStats, kStats);
      const int emitted = run.stepIds()[1] - s.pos, verifySteps = after[0];
      const int ran =
          emitted > 0 ? after[2] : lanes;  // the lanes it ran (stats of a run that went)
      EXPECT_EQ(after[1], emitted) << "stats: tokens";
      EXPECT_GE(ran, 2);
      EXPECT_LE(ran, lanes) << "stats: lanes";
      if (hopperSized && lanes <= 6) {
        EXPECT_EQ(ran, lanes) << "an H100 or H200 holds 6 lanes (7 on the H100s measured)";
      }
      const int room = s.maxT - ran - s.pos;  // the run starts a step only where the lanes fit
      if (room < 0) {
        EXPECT_EQ(emitted, 0);
        continue;
      }
      ASSERT_GE(emitted, 1);
      ASSERT_LE(emitted, t.tokens);
      if (s.pos + t.tokens + ran <= s.maxT) {
        EXPECT_EQ(emitted, t.tokens) << "stopped early with room left";
      }
      EXPECT_LT(verifySteps, emitted) << "no draft was kept";
      // The same number of single greedy steps.
      Tensor wantTokens = gpu->alloc({int64_t(s.maxT)});
      gpu->upload(wantTokens, poison.data());
      DeviceStep single(*gpu, h);
      for (int k = 0; k < emitted; ++k)
        ASSERT_GT(single.runFused(0, 1, reinterpret_cast<int32_t*>(wantTokens.data())), 0);
      const StepOut want = single.results(), got = run.results();
      EXPECT_EQ(tokenRow(tokens), tokenRow(wantTokens)) << "token row";
      EXPECT_EQ(run.stepIds(), single.stepIds()) << "step buffer";
      EXPECT_EQ(bitDifference(got.logits, want.logits), "") << "logits";
      const size_t rows = size_t(s.pos + emitted) * 3 * s.C;
      for (int l = 0; l < s.L; ++l) {
        const auto& g = got.cache[size_t(l)];
        const auto& w = want.cache[size_t(l)];
        EXPECT_EQ(bitDifference(std::vector<float>(g.begin(), g.begin() + long(rows)),
                                std::vector<float>(w.begin(), w.begin() + long(rows))),
                  "")
            << "cache rows below the new position, layer " << l;
        // Rejected lanes may have written rows up to pos + emitted + ran - 2; none after.
        for (size_t i = size_t(s.pos + emitted + ran - 1) * 3 * s.C; i < g.size(); ++i)
          ASSERT_EQ(g[i], kGuardValue) << "layer " << l << ": write past the lanes at " << i;
      }
    }
  }
}

// Against the strict CPU reference on the same (f16-rounded where stored so) weights. The GPU
// sums in other orders than the reference's sequential loops (lane-strided partial sums and
// butterfly reductions), a few f32 ulps per dot product that compound through the layers:
// |got - ref| <= 1e-4 * (1 + |ref|) on logits of order sqrt(C).
TEST_F(CudaDecodeStep, FusedMatchesTheCpuReference) {
  uint64_t seed = 5;
  for (const StepShape& s : kShapes) {
    SCOPED_TRACE(shapeName(s));
    const HostStep h = makeStep(s, seed += 100);
    const StepOut want = referenceStep(*ref, h);
    DeviceStep fused(*gpu, h);
    ASSERT_GT(fused.runFused(0), 0);
    const StepOut got = fused.results();
    ASSERT_TRUE(test::allFinite(got.logits.data(), got.logits.size()));
    EXPECT_LE(
        test::worstRatio(got.logits.data(), want.logits.data(), want.logits.size(), 1e-4, 1e-4),
        1.0)
        << "max |diff| "
        << test::maxAbsDiff(got.logits.data(), want.logits.data(), want.logits.size());
    EXPECT_LE(test::worstRatio(got.x.data(), want.x.data(), want.x.size(), 1e-4, 1e-4), 1.0)
        << "residual x";
    for (int l = 0; l < s.L; ++l) {
      const size_t row = size_t(s.pos) * 3 * s.C;
      const float* g = got.cache[size_t(l)].data() + row;
      const float* w = want.cache[size_t(l)].data() + row;
      EXPECT_LE(test::worstRatio(g, w, size_t(3) * s.C, 1e-4, 1e-4), 1.0)
          << "new cache row, layer " << l;
    }
  }
}

// Arguments outside the fused step's limits enqueue nothing (the model then records the op
// kernels): C past the shared-memory row, a head wider than 128, heads not dividing C, a
// context past the attention's 4096 scores, more layers than the parameter table holds, a form
// the backend does not have.
TEST_F(CudaDecodeStep, RefusesArgumentsOutsideItsLimits) {
  const HostStep h = makeStep({64, 2, 1, 5, 8, 1, "f32"}, 9);
  DeviceStep d(*gpu, h);
  const Ops::DecodeStepArgs ok = d.args(0);
  std::vector<Ops::DecodeStepArgs> refused(7, ok);
  refused[0].C = 4096;
  refused[1].C = 256;
  refused[1].NH = 1;
  refused[2].NH = 3;
  refused[3].maxT = 8192;
  refused[4].layers.resize(25, ok.layers[0]);
  refused[5].form = gpu->decodeStepForms() + 1;
  refused[6].form = -1;
  for (size_t i = 0; i < refused.size(); ++i) EXPECT_EQ(gpu->decodeStepFused(refused[i]), 0) << i;
  EXPECT_FALSE(test::allFinite(d.results().logits.data(), 1)) << "logits were written";
  EXPECT_GT(gpu->decodeStepFused(ok), 0);
  EXPECT_TRUE(test::allFinite(d.results().logits.data(), 5));
}

// The model: greedy decode with fused step graphs equals the op kernels recorded per step and
// the op kernels run one by one, bit for bit, on f32 and on f16-storage, and the fused step is
// what ran; the automatic choice (whichever form timed faster) is a recorded step and equal too.
TEST_F(CudaDecodeStep, ModelDecodeWithFusedStepsEqualsOpByOp) {
  ModelConfig small;
  small.nLayer = 2;
  small.nHead = 3;
  small.nEmbd = 48;
  small.blockSize = 16;
  small.vocabSize = 17;
  ModelConfig bundled;  // the bundled model's shape, random weights
  bundled.nLayer = 4;
  bundled.nHead = 4;
  bundled.nEmbd = 256;
  bundled.blockSize = 256;
  bundled.vocabSize = 65;
  for (const ModelConfig& cfg : {small, bundled}) {
    for (const char* paths : {"f32", "f16-storage"}) {
      SCOPED_TRACE(std::string(paths) + " C=" + std::to_string(cfg.nEmbd));
      PathSet set(*gpu, PathSelection::parse(paths));
      Gpt2 m(*gpu, cfg);
      m.initRandom(3);
      m.setPaths(&set);
      const std::vector<int32_t> prompt = {1, 2, 3};
      const int steps = cfg.blockSize - int(prompt.size());
      enum class Mode { OpByOp, OpGraph, Fused, Auto };
      auto run = [&](Mode mode, int form = 0) {
        m.setStepGraphs(mode != Mode::OpByOp);
        m.setFusedSteps(mode == Mode::Fused  ? Gpt2::FusedSteps::On
                        : mode == Mode::Auto ? Gpt2::FusedSteps::Auto
                                             : Gpt2::FusedSteps::Off,
                        0, form);
        return test::greedyStepLogits(m, prompt, steps, [&] {
          EXPECT_EQ(m.usedStepGraph(), mode != Mode::OpByOp);
          if (mode != Mode::Auto) {
            EXPECT_EQ(m.usedFusedStep() > 0, mode == Mode::Fused);
          }
        });
      };
      const auto opByOp = run(Mode::OpByOp), opGraph = run(Mode::OpGraph);
      const auto chosen = run(Mode::Auto);
      ASSERT_EQ(opByOp.size(), chosen.size());
      for (size_t i = 0; i < opByOp.size(); ++i) {
        ASSERT_EQ(bitDifference(opGraph[i], opByOp[i]), "") << "op graph, step " << i;
        ASSERT_EQ(bitDifference(chosen[i], opByOp[i]), "") << "automatic choice, step " << i;
      }
      for (int form = 1; form <= gpu->decodeStepForms(); ++form) {
        SCOPED_TRACE("fused form " + std::to_string(form));
        const auto fused = run(Mode::Fused, form);
        EXPECT_EQ(m.usedFusedForm(), form);
        ASSERT_EQ(opByOp.size(), fused.size());
        for (size_t i = 0; i < opByOp.size(); ++i)
          ASSERT_EQ(bitDifference(fused[i], opByOp[i]), "") << "fused, step " << i;
      }
      if (std::string(paths) != "f32") {
        EXPECT_EQ(m.lastLinearPath(), paths);
      }
    }
  }
}

}  // namespace
}  // namespace ptllm
