#include "model/gpt2.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>

#include "core/error.h"
#include "core/rng.h"
#include "gate/paths.h"

namespace ptllm {

// A forward linear layer: w[K,N] (Conv1D layout) + b[N], and the packed copy of w for the
// fast path in use (dropped whenever the f32 weights change).
struct Gpt2::Linear {
  const ParamInfo* w = nullptr;
  const ParamInfo* b = nullptr;
  int K = 0, N = 0;
  const PathEntry* packedFor = nullptr;
  std::shared_ptr<Buffer> packed;
  bool ineligible = false;  // prepare() refused this matrix (e.g. f16 overflow)
};

struct Gpt2::Layer {
  const ParamInfo *ln1w, *ln1b, *ln2w, *ln2b;
  Linear attn, proj, fc, fcProj;
};

// Activations of one forward (training: B*T rows; inference: up to blockSize rows).
struct Gpt2::Acts {
  int B = 0, T = 0;
  Tensor encoded;  // [BT, C]
  std::vector<Tensor> ln1, ln1Mean, ln1Rstd, qkv, atty, att, attProj, res2, ln2, ln2Mean, ln2Rstd,
      fch, fchGelu, fcProj, res3;
  Tensor lnf, lnfMean, lnfRstd, logits, losses;
  // backward scratch
  Tensor dres, dln, dqkv, datty, dfch;
  std::vector<int32_t> inputs, targets;
};

Gpt2::Gpt2(Ops& ops, const ModelConfig& cfg) : ops_(ops), cfg_(cfg) {
  cfg_.validate("model config");
  buildParams();
  paramBuf_ = ops_.alloc({numParams_});
  gradBuf_ = ops_.alloc({numParams_});
}

Gpt2::~Gpt2() = default;

std::vector<ParamInfo> gpt2ParamLayout(const ModelConfig& cfg) {
  const int64_t C = cfg.nEmbd, V = cfg.vocabSize, T = cfg.blockSize;
  std::vector<ParamInfo> params;
  int64_t offset = 0;
  auto add = [&](const std::string& name, Shape shape, bool decay) {
    params.push_back({name, std::move(shape), offset, decay});
    offset += params.back().numel();
  };
  add("wte.weight", {V, C}, true);
  add("wpe.weight", {T, C}, true);
  for (int l = 0; l < cfg.nLayer; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    add(p + "ln_1.weight", {C}, false);
    add(p + "ln_1.bias", {C}, false);
    add(p + "attn.c_attn.weight", {C, 3 * C}, true);
    add(p + "attn.c_attn.bias", {3 * C}, false);
    add(p + "attn.c_proj.weight", {C, C}, true);
    add(p + "attn.c_proj.bias", {C}, false);
    add(p + "ln_2.weight", {C}, false);
    add(p + "ln_2.bias", {C}, false);
    add(p + "mlp.c_fc.weight", {C, 4 * C}, true);
    add(p + "mlp.c_fc.bias", {4 * C}, false);
    add(p + "mlp.c_proj.weight", {4 * C, C}, true);
    add(p + "mlp.c_proj.bias", {C}, false);
  }
  add("ln_f.weight", {C}, false);
  add("ln_f.bias", {C}, false);
  PTLLM_ASSERT(offset == cfg.parameterCount());
  return params;
}

void Gpt2::buildParams() {
  params_ = gpt2ParamLayout(cfg_);
  numParams_ = cfg_.parameterCount();
  for (size_t i = 0; i < params_.size(); ++i) paramIndex_[params_[i].name] = i;

  auto P = [&](const std::string& n) { return &params_[paramIndex_.at(n)]; };
  wte_ = P("wte.weight");
  wpe_ = P("wpe.weight");
  lnfW_ = P("ln_f.weight");
  lnfB_ = P("ln_f.bias");
  layers_.resize(size_t(cfg_.nLayer));
  for (int l = 0; l < cfg_.nLayer; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    Layer& L = layers_[size_t(l)];
    L.ln1w = P(p + "ln_1.weight");
    L.ln1b = P(p + "ln_1.bias");
    L.ln2w = P(p + "ln_2.weight");
    L.ln2b = P(p + "ln_2.bias");
    auto lin = [&](Linear& x, const std::string& n) {
      x.w = P(p + n + ".weight");
      x.b = P(p + n + ".bias");
      x.K = int(x.w->shape[0]);
      x.N = int(x.w->shape[1]);
    };
    lin(L.attn, "attn.c_attn");
    lin(L.proj, "attn.c_proj");
    lin(L.fc, "mlp.c_fc");
    lin(L.fcProj, "mlp.c_proj");
  }
}

const ParamInfo* Gpt2::findParam(const std::string& name) const {
  auto it = paramIndex_.find(name);
  return it == paramIndex_.end() ? nullptr : &params_[it->second];
}

void Gpt2::initRandom(uint64_t seed) {
  Rng rng(seed);
  std::vector<float> host(size_t(numParams_), 0.0f);
  const float residStd = 0.02f / std::sqrt(2.0f * cfg_.nLayer);
  for (const auto& p : params_) {
    float* d = host.data() + p.offset;
    const bool isLnWeight = p.name.find("ln_") != std::string::npos && p.name.ends_with(".weight");
    if (isLnWeight) {
      for (int64_t i = 0; i < p.numel(); ++i) d[i] = 1.0f;
    } else if (p.decay) {
      const float sd = p.name.ends_with("c_proj.weight") ? residStd : 0.02f;
      for (int64_t i = 0; i < p.numel(); ++i) d[i] = sd * rng.normal();
    }
  }
  ops_.upload(paramBuf_, host.data());
  invalidatePackedWeights();
}

void Gpt2::invalidatePackedWeights() {
  stepGraphs_.clear();  // a recording holds the packed buffers and the path it was made for
  for (auto& L : layers_)
    for (Linear* l : {&L.attn, &L.proj, &L.fc, &L.fcProj}) {
      l->packedFor = nullptr;  // stale; the buffer is kept and refilled by the next pack
      l->ineligible = false;
    }
}

std::vector<Buffer*> Gpt2::packedBuffers() {
  std::vector<Buffer*> out;
  for (auto& L : layers_)
    for (Linear* l : {&L.attn, &L.proj, &L.fc, &L.fcProj})
      if (l->packedFor && l->packed) out.push_back(l->packed.get());
  return out;
}

const PathEntry* Gpt2::fastPath(bool training) {
  if (!paths_ || forceF32_ || !(training ? pathInTraining_ : pathInInference_)) return nullptr;
  return paths_->forwardPath();
}

void Gpt2::prepareForInference() {
  const PathEntry* path = fastPath(false);
  if (!path || !path->prepare) return;
  for (auto& L : layers_)
    for (Linear* l : {&L.attn, &L.proj, &L.fc, &L.fcProj})
      if (l->packedFor != path && !l->ineligible) pack(*l, path);
}

void Gpt2::pack(Linear& l, const PathEntry* path) {
  // Re-packing after every train step: reuse the buffer (a fresh one costs page faults).
  const size_t bytes = path->packedBytes(l.K, l.N);
  if (!l.packed || l.packed->bytes != bytes) l.packed = ops_.allocBytes(bytes);
  if (path->prepare(l.packed->ptr, param(*l.w), l.K, l.N)) {
    l.packedFor = path;
  } else {
    l.packed.reset();
    l.ineligible = true;
    std::fprintf(stderr, "[ops] %s: %s is not representable on this path, it stays on f32\n",
                 path->name.c_str(), l.w->name.c_str());
  }
}

void Gpt2::linear(Linear& l, float* out, const float* in, int M, const PathEntry* path) {
  if (path && !l.ineligible) {
    if (!path->prepare) {
      path->dispatch(out, in, param(*l.w), param(*l.b), M, l.K, l.N);
      lastLinearPath_ = path->name;
      return;
    }
    if (l.packedFor != path) pack(l, path);  // lazily, after invalidation
    if (l.packedFor == path) {
      path->dispatch(out, in, l.packed->ptr, param(*l.b), M, l.K, l.N);
      lastLinearPath_ = path->name;
      return;
    }
  }
  ops_.matmul(out, in, param(*l.w), param(*l.b), M, l.K, l.N);
  lastLinearPath_ = "f32";
}

// dIn[M,K] = dOut[M,N] @ w^T ; dw[K,N] += in^T @ dOut ; db[N] += sum dOut. Always f32.
void Gpt2::linearBackward(Linear& l, float* dIn, const float* dOut, const float* in, int M) {
  ops_.matmulAtbBias(grad(*l.w), grad(*l.b), in, dOut, l.K, M, l.N, true);
  ops_.matmulAbt(dIn, dOut, param(*l.w), M, l.N, l.K, false);
}

void Gpt2::ensureActs(int B, int T) {
  if (acts_ && acts_->B == B && acts_->T == T) return;
  acts_ = std::make_unique<Acts>();
  Acts& a = *acts_;
  a.B = B;
  a.T = T;
  const int64_t BT = int64_t(B) * T, C = cfg_.nEmbd, NH = cfg_.nHead, V = cfg_.vocabSize;
  a.encoded = ops_.alloc({BT, C});
  for (int l = 0; l < cfg_.nLayer; ++l) {
    a.ln1.push_back(ops_.alloc({BT, C}));
    a.ln1Mean.push_back(ops_.alloc({BT}));
    a.ln1Rstd.push_back(ops_.alloc({BT}));
    a.qkv.push_back(ops_.alloc({BT, 3 * C}));
    a.atty.push_back(ops_.alloc({BT, C}));
    a.att.push_back(ops_.alloc({B, NH, T, T}));
    a.attProj.push_back(ops_.alloc({BT, C}));
    a.res2.push_back(ops_.alloc({BT, C}));
    a.ln2.push_back(ops_.alloc({BT, C}));
    a.ln2Mean.push_back(ops_.alloc({BT}));
    a.ln2Rstd.push_back(ops_.alloc({BT}));
    a.fch.push_back(ops_.alloc({BT, 4 * C}));
    a.fchGelu.push_back(ops_.alloc({BT, 4 * C}));
    a.fcProj.push_back(ops_.alloc({BT, C}));
    a.res3.push_back(ops_.alloc({BT, C}));
  }
  a.lnf = ops_.alloc({BT, C});
  a.lnfMean = ops_.alloc({BT});
  a.lnfRstd = ops_.alloc({BT});
  a.logits = ops_.alloc({BT, V});
  a.losses = ops_.alloc({BT});
}

void Gpt2::checkTokens(const int32_t* ids, int64_t n) const {
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= cfg_.vocabSize)
      fail("token id {} outside the vocabulary of {}", ids[i], cfg_.vocabSize);
}

float Gpt2::forward(const int32_t* inputs, const int32_t* targets, int B, int T) {
  if (T < 1 || T > cfg_.blockSize) fail("sequence length {} is outside 1..{}", T, cfg_.blockSize);
  checkTokens(inputs, int64_t(B) * T);
  ensureActs(B, T);
  Acts& a = *acts_;
  const int M = B * T, C = cfg_.nEmbd, NH = cfg_.nHead, V = cfg_.vocabSize;
  a.inputs.assign(inputs, inputs + M);
  a.targets.clear();

  const PathEntry* path = fastPath(true);
  ops_.embeddingForward(a.encoded.data(), inputs, param(*wte_), param(*wpe_), B, T, C, 0);
  const float* x = a.encoded.data();
  for (int l = 0; l < cfg_.nLayer; ++l) {
    Layer& L = layers_[size_t(l)];
    ops_.layernormForward(a.ln1[l].data(), a.ln1Mean[l].data(), a.ln1Rstd[l].data(), x,
                          param(*L.ln1w), param(*L.ln1b), M, C);
    linear(L.attn, a.qkv[l].data(), a.ln1[l].data(), M, path);
    ops_.attentionForward(a.atty[l].data(), a.att[l].data(), a.qkv[l].data(), B, T, T, C, NH);
    linear(L.proj, a.attProj[l].data(), a.atty[l].data(), M, path);
    ops_.add(a.res2[l].data(), x, a.attProj[l].data(), int64_t(M) * C);
    ops_.layernormForward(a.ln2[l].data(), a.ln2Mean[l].data(), a.ln2Rstd[l].data(),
                          a.res2[l].data(), param(*L.ln2w), param(*L.ln2b), M, C);
    linear(L.fc, a.fch[l].data(), a.ln2[l].data(), M, path);
    ops_.geluForward(a.fchGelu[l].data(), a.fch[l].data(), int64_t(M) * 4 * C);
    linear(L.fcProj, a.fcProj[l].data(), a.fchGelu[l].data(), M, path);
    ops_.add(a.res3[l].data(), a.res2[l].data(), a.fcProj[l].data(), int64_t(M) * C);
    x = a.res3[l].data();
  }
  ops_.layernormForward(a.lnf.data(), a.lnfMean.data(), a.lnfRstd.data(), x, param(*lnfW_),
                        param(*lnfB_), M, C);
  // Tied head: logits = lnf @ wte^T, always f32.
  ops_.matmulAbt(a.logits.data(), a.lnf.data(), param(*wte_), M, C, V, false);
  if (!targets) return 0.0f;

  int counted = 0;
  for (int i = 0; i < M; ++i) {
    if (targets[i] >= V) fail("target id {} outside the vocabulary of {}", targets[i], V);
    counted += targets[i] >= 0;
  }
  a.targets.assign(targets, targets + M);
  // Keeps the logits; backward() recomputes the softmax gradient into them.
  ops_.crossEntropy(a.losses.data(), nullptr, a.logits.data(), targets, M, V, 0.0f);
  std::vector<float> losses(static_cast<size_t>(M));
  ops_.download(losses.data(), a.losses);
  double sum = 0;
  for (float v : losses) sum += v;
  return counted ? float(sum / counted) : 0.0f;
}

std::vector<float> Gpt2::logitsHost() const {
  PTLLM_ASSERT(acts_, "no forward has run");
  std::vector<float> out(size_t(acts_->logits.numel()));
  ops_.download(out.data(), acts_->logits);
  return out;
}

std::vector<Gpt2::LinearSample> Gpt2::linearSamples(int maxRows) {
  PTLLM_ASSERT(acts_ && cfg_.nLayer > 0, "no forward has run");
  const Acts& a = *acts_;
  const int M = std::min(maxRows, a.B * a.T);
  Layer& L = layers_[0];
  const std::pair<Linear*, const Tensor*> inputs[] = {
      {&L.attn, &a.ln1[0]}, {&L.proj, &a.atty[0]}, {&L.fc, &a.ln2[0]}, {&L.fcProj, &a.fchGelu[0]}};
  std::vector<float> params(static_cast<size_t>(numParams_));
  ops_.download(params.data(), paramBuf_);
  std::vector<LinearSample> out;
  for (auto [l, t] : inputs) {
    LinearSample s{l->w->name, M, l->K, l->N, {}, {}, {}};
    std::vector<float> all(static_cast<size_t>(t->numel()));
    ops_.download(all.data(), *t);
    s.in.assign(all.begin(), all.begin() + int64_t(M) * l->K);
    const auto at = [&](const ParamInfo* q) { return params.begin() + q->offset; };
    s.w.assign(at(l->w), at(l->w) + l->w->numel());
    s.bias.assign(at(l->b), at(l->b) + l->b->numel());
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<std::vector<float>> Gpt2::blockOutputsHost() const {
  PTLLM_ASSERT(acts_, "no forward has run");
  std::vector<std::vector<float>> out;
  for (const Tensor& t : acts_->res3) {
    out.emplace_back(size_t(t.numel()));
    ops_.download(out.back().data(), t);
  }
  return out;
}

void Gpt2::zeroGrad() {
  ops_.fill(gradBuf_.data(), 0.0f, numParams_);
}

void Gpt2::backward() {
  PTLLM_ASSERT(acts_ && !acts_->targets.empty(), "backward() needs a forward with targets");
  Acts& a = *acts_;
  const int B = a.B, T = a.T, M = B * T, C = cfg_.nEmbd, NH = cfg_.nHead, V = cfg_.vocabSize;
  if (a.dres.empty()) {
    a.dres = ops_.alloc({M, C});
    a.dln = ops_.alloc({M, C});
    a.dqkv = ops_.alloc({M, 3 * C});
    a.datty = ops_.alloc({M, C});
    a.dfch = ops_.alloc({M, 4 * C});
  }
  int counted = 0;
  for (int32_t t : a.targets) counted += t >= 0;
  const float dscale = counted ? 1.0f / float(counted) : 0.0f;
  // dlogits overwrite the logits in place.
  ops_.crossEntropy(a.losses.data(), a.logits.data(), a.logits.data(), a.targets.data(), M, V,
                    dscale);
  float* dlogits = a.logits.data();
  // Tied head backward: dlnf = dlogits @ wte ; dwte += dlogits^T @ lnf.
  ops_.matmul(a.dln.data(), dlogits, param(*wte_), nullptr, M, V, C);
  ops_.matmulAtb(grad(*wte_), dlogits, a.lnf.data(), V, M, C, true);
  ops_.fill(a.dres.data(), 0.0f, int64_t(M) * C);
  const float* xLast = cfg_.nLayer ? a.res3.back().data() : a.encoded.data();
  ops_.layernormBackward(a.dres.data(), grad(*lnfW_), grad(*lnfB_), a.dln.data(), xLast,
                         param(*lnfW_), a.lnfMean.data(), a.lnfRstd.data(), M, C);
  for (int l = cfg_.nLayer - 1; l >= 0; --l) {
    Layer& L = layers_[size_t(l)];
    const float* x = l == 0 ? a.encoded.data() : a.res3[l - 1].data();
    // res3 = res2 + fcProj(gelu(fc(ln2(res2)))): dres flows to res2 unchanged.
    linearBackward(L.fcProj, a.dfch.data(), a.dres.data(), a.fchGelu[l].data(), M);
    ops_.geluBackward(a.dfch.data(), a.fch[l].data(), a.dfch.data(), int64_t(M) * 4 * C);
    linearBackward(L.fc, a.dln.data(), a.dfch.data(), a.ln2[l].data(), M);
    ops_.layernormBackward(a.dres.data(), grad(*L.ln2w), grad(*L.ln2b), a.dln.data(),
                           a.res2[l].data(), param(*L.ln2w), a.ln2Mean[l].data(),
                           a.ln2Rstd[l].data(), M, C);
    // res2 = x + proj(attn(attn_in(ln1(x)))).
    linearBackward(L.proj, a.datty.data(), a.dres.data(), a.atty[l].data(), M);
    ops_.attentionBackward(a.dqkv.data(), a.datty.data(), a.qkv[l].data(), a.att[l].data(), B, T, C,
                           NH);
    linearBackward(L.attn, a.dln.data(), a.dqkv.data(), a.ln1[l].data(), M);
    ops_.layernormBackward(a.dres.data(), grad(*L.ln1w), grad(*L.ln1b), a.dln.data(), x,
                           param(*L.ln1w), a.ln1Mean[l].data(), a.ln1Rstd[l].data(), M, C);
  }
  ops_.embeddingBackward(grad(*wte_), grad(*wpe_), a.dres.data(), a.inputs.data(), B, T, C);
}

float Gpt2::clipGradNorm(float maxNorm) {
  const float norm = float(std::sqrt(ops_.sumSquares(gradBuf_.data(), numParams_)));
  if (std::isfinite(norm) && norm > maxNorm)
    ops_.scale(gradBuf_.data(), maxNorm / norm, numParams_);
  return norm;
}

Tensor& Gpt2::adamM() {
  if (mBuf_.empty()) mBuf_ = ops_.alloc({numParams_});
  return mBuf_;
}
Tensor& Gpt2::adamV() {
  if (vBuf_.empty()) vBuf_ = ops_.alloc({numParams_});
  return vBuf_;
}

void Gpt2::adamwStep(float lr, float beta1, float beta2, float eps, float weightDecay) {
  adamM();
  adamV();
  ++adamStep_;
  for (const auto& p : params_)
    ops_.adamw(param(p), grad(p), mBuf_.data() + p.offset, vBuf_.data() + p.offset, p.numel(), lr,
               beta1, beta2, eps, p.decay ? weightDecay : 0.0f, adamStep_);
  invalidatePackedWeights();
}

// ---- inference ----

void Gpt2::ensureCache() {
  if (!kvCache_.empty()) return;
  const int64_t C = cfg_.nEmbd, T = cfg_.blockSize, NH = cfg_.nHead, V = cfg_.vocabSize;
  for (int l = 0; l < cfg_.nLayer; ++l) kvCache_.push_back(ops_.alloc({T, 3 * C}));
  inferActs_ = std::make_unique<Acts>();
  Acts& a = *inferActs_;
  a.encoded = ops_.alloc({T, C});
  a.ln1.push_back(ops_.alloc({T, C}));
  a.atty.push_back(ops_.alloc({T, C}));
  a.att.push_back(ops_.alloc({NH, T, T}));
  a.attProj.push_back(ops_.alloc({T, C}));
  a.res2.push_back(ops_.alloc({T, C}));
  a.fch.push_back(ops_.alloc({T, 4 * C}));
  a.res3.push_back(ops_.alloc({T, C}));
  a.lnf = ops_.alloc({1, C});
  a.logits = ops_.alloc({1, V});
}

void Gpt2::resetCache() {
  cachePos_ = 0;
}

void Gpt2::forwardCached(const int32_t* tokens, int n, float* logitsOut) {
  if (n < 1 || cachePos_ + n > cfg_.blockSize)
    fail("cannot run {} tokens after {} cached: the context holds {}", n, cachePos_,
         cfg_.blockSize);
  checkTokens(tokens, n);
  ensureCache();
  usedStepGraph_ = false;
  usedFusedStep_ = usedFusedForm_ = 0;
  if (n == 1 && stepGraphsOn_ && !stepGraphsBroken_ && ops_.supportsStepGraphs() &&
      decodeWithStepGraph(tokens[0], logitsOut))
    return;
  Acts& a = *inferActs_;
  const int C = cfg_.nEmbd, NH = cfg_.nHead, V = cfg_.vocabSize, p0 = cachePos_, Tk = p0 + n;
  float* x = a.encoded.data();
  float* ln = a.ln1[0].data();
  float* y = a.atty[0].data();
  float* proj = a.attProj[0].data();
  float* h = a.fch[0].data();
  const PathEntry* path = fastPath(false);
  ops_.embeddingForward(x, tokens, param(*wte_), param(*wpe_), 1, n, C, p0);
  for (int l = 0; l < cfg_.nLayer; ++l) {
    Layer& L = layers_[size_t(l)];
    float* qkv = kvCache_[size_t(l)].data();  // rows [0, Tk) valid after the linear below
    ops_.layernormForward(ln, nullptr, nullptr, x, param(*L.ln1w), param(*L.ln1b), n, C);
    linear(L.attn, qkv + int64_t(p0) * 3 * C, ln, n, path);
    ops_.attentionForward(y, a.att[0].data(), qkv, 1, n, Tk, C, NH);
    linear(L.proj, proj, y, n, path);
    ops_.add(x, x, proj, int64_t(n) * C);
    ops_.layernormForward(ln, nullptr, nullptr, x, param(*L.ln2w), param(*L.ln2b), n, C);
    linear(L.fc, h, ln, n, path);
    ops_.geluForward(h, h, int64_t(n) * 4 * C);
    linear(L.fcProj, proj, h, n, path);
    ops_.add(x, x, proj, int64_t(n) * C);
  }
  const float* last = x + int64_t(n - 1) * C;
  ops_.layernormForward(a.lnf.data(), nullptr, nullptr, last, param(*lnfW_), param(*lnfB_), 1, C);
  ops_.matmulAbt(a.logits.data(), a.lnf.data(), param(*wte_), 1, C, V, false);
  ops_.download(logitsOut, a.logits);
  cachePos_ = Tk;
}

// The recorded step of `path`, recorded on first use (token: the step Auto's timing runs);
// nullptr once recording has failed (then op by op from now on).
Gpt2::StepRecording* Gpt2::stepRecording(const PathEntry* path, int32_t token) {
  auto it = stepGraphs_.find(path);
  if (it != stepGraphs_.end()) return &it->second;
  // The fused step where it may run; if recording it fails, the op-by-op kernels (recorded);
  // if that fails too, op by op from now on. Each fallback says so once.
  // Auto: the form timed fastest for this path, once; recordings are remade after every
  // weight update, the choice is kept (it depends on the device and the path, not the values).
  const auto chosen = stepForm_.find(path);
  const bool timed = fusedSteps_ == FusedSteps::Auto && chosen != stepForm_.end();
  const bool fused = fusedSteps_ != FusedSteps::Off && !fusedStepsBroken_ &&
                     (!path || path->fusedDecode) && (!timed || chosen->second > 0);
  const int form = timed ? chosen->second : fusedSteps_ == FusedSteps::Auto ? 1 : fusedForm_;
  try {
    StepRecording rec;
    try {
      rec = recordDecodeStep(path, fused, form);
    } catch (const std::exception& ex) {
      if (!fused) throw;
      fusedStepsBroken_ = true;
      std::fprintf(stderr, "[ops] fused decode step unavailable (%s): recording the op kernels\n",
                   ex.what());
      rec = recordDecodeStep(path, false, 0);
    }
    if (rec.fusedBlocks > 0 && fusedSteps_ == FusedSteps::Auto && !timed) {
      // Which form is fastest depends on the device and the path's weight format (H200, run 9:
      // f32 86.2 us on fused form 1, 90.3 on form 2; f16-storage 87.4 on form 2, 96.2 on the
      // op kernels): each is recorded and timed once and the fastest kept. All compute every
      // element alike, so the choice is speed only.
      double best = stepMicros(rec, token);
      int bestForm = form;
      for (int f = 0; f <= ops_.decodeStepForms(); ++f) {  // f = 0: the op kernels
        if (f == form) continue;
        try {
          StepRecording other = recordDecodeStep(path, f > 0, f);
          if (f > 0 && other.fusedBlocks == 0) continue;  // this form refused the shapes
          const double us = stepMicros(other, token);
          if (us < best) {
            best = us;
            bestForm = f;
            rec = std::move(other);
          }
        } catch (const std::exception&) {
          // the recordings so far stand
        }
      }
      stepForm_[path] = bestForm;
    }
    return &(stepGraphs_[path] = std::move(rec));
  } catch (const std::exception& ex) {
    stepGraphsBroken_ = true;
    std::fprintf(stderr, "[ops] decode step graph unavailable (%s): running op by op\n", ex.what());
    return nullptr;
  }
}

bool Gpt2::decodeWithStepGraph(int32_t token, float* logitsOut) {
  const PathEntry* path = fastPath(false);
  StepRecording* rec = stepRecording(path, token);
  if (!rec) return false;
  ops_.setDecodeStep(static_cast<int32_t*>(stepIds_->ptr), token, cachePos_);
  rec->graph->replay();
  ops_.download(logitsOut, inferActs_->logits);
  stepsReplayed(*rec, path, 1);
  return true;
}

// After `n` replays of `rec` (the cache holds their tokens): what usedStepGraph(),
// usedFusedStep(), usedFusedForm() and lastLinearPath() report.
void Gpt2::stepsReplayed(const StepRecording& rec, const PathEntry* path, int n) {
  cachePos_ += n;
  usedStepGraph_ = true;
  usedFusedStep_ = rec.fusedBlocks;
  usedFusedForm_ = rec.form;
  lastLinearPath_ = path ? path->name : "f32";
}

bool Gpt2::canDecodeGreedy() const {
  return stepGraphsOn_ && !stepGraphsBroken_ && ops_.supportsStepGraphs();
}

bool Gpt2::decodeGreedy(int32_t first, int n, const std::function<void(int32_t)>& onToken,
                        float* logitsOut, const int32_t* cachedIds) {
  if (n < 1 || cachePos_ + n > cfg_.blockSize)
    fail("cannot decode {} tokens after {} cached: the context holds {}", n, cachePos_,
         cfg_.blockSize);
  checkTokens(&first, 1);
  if (!canDecodeGreedy()) return false;
  ensureCache();
  usedStepGraph_ = usedPersistentRun_ = false;
  usedFusedStep_ = usedFusedForm_ = 0;
  lastSpecTokens_ = lastSpecSteps_ = lastSpecLanes_ = 0;
  const PathEntry* path = fastPath(false);
  StepRecording* rec = stepRecording(path, first);
  if (!rec) return false;
  if (!greedyIds_) greedyIds_ = ops_.allocBytes(size_t(cfg_.blockSize) * sizeof(int32_t));
  int32_t* ids = static_cast<int32_t*>(greedyIds_->ptr);  // ids[p]: the pick after position p
  int32_t* step = static_cast<int32_t*>(stepIds_->ptr);
  const float* logits = inferActs_->logits.data();
  const int p0 = cachePos_;
  ops_.setDecodeStep(step, first, p0);
  if (greedyRunGraphs_ && !greedyRunsBroken_ && n >= kGreedyRunSteps && !rec->greedyRun)
    recordGreedyRun(*rec, path, ids);
  // Steps are queued a chunk ahead of the read-back: reading chunk c waits for chunk c + 1,
  // queued before it, so the device idles only for one read-back and launch per chunk.
  constexpr int kChunk = kGreedyRunSteps;
  std::vector<int32_t> picked(static_cast<size_t>(n));
  int queued = 0, read = 0;
  if (cachedIds && speculativeLanes_ > 1 && n >= 2 && fusedSteps_ != FusedSteps::Off)
    queued = runSpeculative(path, cachedIds, ids, n);
  auto readTo = [&](int end) {
    ops_.downloadIds(picked.data() + read, ids + p0 + read, end - read);
    for (; read < end; ++read)
      if (onToken) onToken(picked[size_t(read)]);
  };
  while (queued < n) {
    const int before = queued;
    if (greedyRunGraphs_ && rec->greedyRun && n - queued >= kChunk) {
      rec->greedyRun->replay();
      queued += kChunk;
      usedPersistentRun_ = rec->persistentRun;
    } else {
      if (greedyRunGraphs_ && persistentGreedyRuns_ && rec->persistentRun && n - queued >= 2) {
        // The rest of the run as one launch too (not recorded: its length varies).
        if (queueGreedyRun(path, rec->form, ids, n - queued) > 0) {
          queued = n;
          usedPersistentRun_ = true;
        }
      }
      for (const int end = std::min(n, queued + kChunk); queued < end; ++queued) {
        rec->graph->replay();
        ops_.greedyAdvance(step, ids, logits, cfg_.vocabSize);
      }
    }
    if (before > read) readTo(before);
  }
  readTo(n);
  ops_.download(logitsOut, inferActs_->logits);
  stepsReplayed(*rec, path, n);
  return true;
}

// The fused step's arguments: the same buffers the op-by-op step uses, each linear's weight as
// linear() would pick it (the path's pack, or f32 where the matrix is ineligible).
Ops::DecodeStepArgs Gpt2::fusedStepArgs(const PathEntry* path, int form) {
  Acts& a = *inferActs_;
  Ops::DecodeStepArgs args;
  args.C = cfg_.nEmbd;
  args.NH = cfg_.nHead;
  args.V = cfg_.vocabSize;
  args.maxT = cfg_.blockSize;
  auto lin = [&](Linear& l) {
    Ops::DecodeLinear d;
    d.b = param(*l.b);
    const bool packed = path && path->prepare && !l.ineligible && l.packedFor == path;
    d.w = packed ? l.packed->ptr : static_cast<const void*>(param(*l.w));
    d.f16Storage = packed;
    return d;
  };
  for (int l = 0; l < cfg_.nLayer; ++l) {
    Layer& L = layers_[size_t(l)];
    Ops::DecodeLayer d;
    d.ln1w = param(*L.ln1w);
    d.ln1b = param(*L.ln1b);
    d.ln2w = param(*L.ln2w);
    d.ln2b = param(*L.ln2b);
    d.attn = lin(L.attn);
    d.proj = lin(L.proj);
    d.fc = lin(L.fc);
    d.fcProj = lin(L.fcProj);
    d.cache = kvCache_[size_t(l)].data();
    args.layers.push_back(d);
  }
  args.wte = param(*wte_);
  args.wpe = param(*wpe_);
  args.lnfw = param(*lnfW_);
  args.lnfb = param(*lnfB_);
  args.step = static_cast<const int32_t*>(stepIds_->ptr);
  args.x = a.encoded.data();
  args.y = a.atty[0].data();
  args.h = a.fch[0].data();
  args.att = a.att[0].data();
  args.logits = a.logits.data();
  args.clusterBlocks = fusedClusterBlocks_;
  args.form = form;
  return args;
}

namespace {
// The graph of what queue() launches on `ops` (recorded, not run). If queue throws, capture
// mode is left, the partial recording dropped, and the exception passed on.
template <class F>
std::unique_ptr<Ops::StepGraph> recordGraph(Ops& ops, F&& queue) {
  ops.beginStepCapture();
  try {
    queue();
  } catch (...) {
    try {
      ops.endStepCapture();
    } catch (...) {
    }
    throw;
  }
  return ops.endStepCapture();
}
}  // namespace

// The one-token forward of forwardCached with the position read from the device: recorded, not
// run — one fused launch when `fused` and the backend takes these shapes, else the op kernels.
// Weights are packed first (packing synchronises, which a recording cannot).
Gpt2::StepRecording Gpt2::recordDecodeStep(const PathEntry* path, bool fused, int form) {
  if (path && path->prepare)
    for (auto& L : layers_)
      for (Linear* l : {&L.attn, &L.proj, &L.fc, &L.fcProj})
        if (l->packedFor != path && !l->ineligible) pack(*l, path);
  if (!stepIds_) stepIds_ = ops_.allocBytes(2 * sizeof(int32_t));
  if (stepQkv_.empty()) stepQkv_ = ops_.alloc({3 * cfg_.nEmbd});
  StepRecording rec;
  rec.graph = recordGraph(ops_, [&] { rec.fusedBlocks = queueStep(path, fused, form); });
  rec.form = rec.fusedBlocks > 0 ? form : 0;
  return rec;
}

// Inside a capture: one step, as a fused launch (returns its blocks) where `fused` and the
// backend takes the shapes, else the op kernels (returns 0). greedyIds: a fused launch also
// makes the greedy pick (DecodeStepArgs::greedyTokens); the op kernels leave it to the caller.
int Gpt2::queueStep(const PathEntry* path, bool fused, int form, int32_t* greedyIds) {
  int fusedBlocks = 0;
  if (fused) {
    Ops::DecodeStepArgs args = fusedStepArgs(path, form);
    args.greedyTokens = greedyIds;
    fusedBlocks = ops_.decodeStepFused(args);
  }
  if (!fusedBlocks) recordOpSteps(path);
  return fusedBlocks;
}

// `steps` greedy steps as one fused launch in `form` (DecodeStepArgs::greedySteps): its blocks,
// or 0 with nothing enqueued where the backend cannot.
int Gpt2::queueGreedyRun(const PathEntry* path, int form, int32_t* greedyIds, int steps) {
  Ops::DecodeStepArgs args = fusedStepArgs(path, form);
  args.greedyTokens = greedyIds;
  args.greedySteps = steps;
  return ops_.decodeStepFused(args);
}

// A speculative greedy run of up to n tokens from the step buffer's position (fused form 4,
// speculativeLanes_ lanes; Ops::DecodeStepArgs::speculativeLanes), waited for: the tokens it
// emitted (0: it did not run), their picks in greedyIds as a greedy run leaves them.
int Gpt2::runSpeculative(const PathEntry* path, const int32_t* cachedIds, int32_t* greedyIds,
                         int n) {
  const int p0 = cachePos_;
  if (!specHistory_) {
    specHistory_ = ops_.allocBytes(size_t(cfg_.blockSize) * sizeof(int32_t));
    specStats_ = ops_.allocBytes(Ops::DecodeStepArgs::kSpeculativeStats * sizeof(int32_t));
  }
  auto* stats = static_cast<int32_t*>(specStats_->ptr);
  constexpr int kStats = Ops::DecodeStepArgs::kSpeculativeStats;
  const int32_t zero[kStats] = {};
  int32_t after[kStats], step[2];
  ops_.uploadIds(stats, zero, kStats);  // the run adds its counts to these (queued, no wait)
  checkTokens(cachedIds, p0);
  ops_.uploadIds(static_cast<int32_t*>(specHistory_->ptr), cachedIds, p0);
  Ops::DecodeStepArgs args = fusedStepArgs(path, 4);
  args.greedyTokens = greedyIds;
  args.greedySteps = n;
  args.speculativeLanes = speculativeLanes_;
  args.history = static_cast<const int32_t*>(specHistory_->ptr);
  args.speculativeStats = stats;
  if (ops_.decodeStepFused(args) == 0) return 0;
  ops_.downloadIds(step, static_cast<const int32_t*>(stepIds_->ptr), 2);  // waits for the run
  ops_.downloadIds(after, stats, kStats);
  lastSpecSteps_ = after[0];
  lastSpecTokens_ = after[1];
  lastSpecLanes_ = after[2];
  if (step[1] - p0 != lastSpecTokens_ || lastSpecTokens_ < 0 || lastSpecTokens_ > n)
    fail("speculative run: moved {} positions but counted {} tokens", step[1] - p0,
         lastSpecTokens_);
  return lastSpecTokens_;
}

// rec.greedyRun: kGreedyRunSteps times rec's step (the same launch: fused in rec's form, or the
// op kernels) followed by the pick, in one graph; a fused step makes the pick at its end (one
// launch per token: H200 run 25). Where the fused step runs all kGreedyRunSteps steps in one
// launch (DecodeStepArgs::greedySteps; persistentGreedyRuns_), the graph is that launch. If
// recording fails, greedy runs replay the step per token from then on (said once).
void Gpt2::recordGreedyRun(StepRecording& rec, const PathEntry* path, int32_t* ids) {
  int32_t* step = static_cast<int32_t*>(stepIds_->ptr);
  const float* logits = inferActs_->logits.data();
  try {
    rec.persistentRun = false;
    rec.greedyRun = recordGraph(ops_, [&] {
      if (persistentGreedyRuns_ && rec.fusedBlocks > 0) {
        rec.persistentRun = queueGreedyRun(path, rec.form, ids, kGreedyRunSteps) > 0;
        if (rec.persistentRun) return;
      }
      for (int i = 0; i < kGreedyRunSteps; ++i) {
        if (queueStep(path, rec.fusedBlocks > 0, rec.form, ids) != rec.fusedBlocks)
          fail("the fused step changed its launch between recordings");
        if (!rec.fusedBlocks) ops_.greedyAdvance(step, ids, logits, cfg_.vocabSize);
      }
    });
  } catch (const std::exception& ex) {
    greedyRunsBroken_ = true;
    rec.persistentRun = false;
    std::fprintf(stderr, "[ops] greedy run graph unavailable (%s): replaying the step per token\n",
                 ex.what());
  }
}

// Microseconds one replay of `rec` takes at the current position: the best of three runs of
// eight back-to-back replays. Replaying a step is idempotent (it rewrites the same cache row and
// outputs from the same inputs), so timing it changes nothing the next replay sees.
double Gpt2::stepMicros(StepRecording& rec, int32_t token) {
  std::vector<float> sink(size_t(cfg_.vocabSize));
  ops_.setDecodeStep(static_cast<int32_t*>(stepIds_->ptr), token, cachePos_);
  rec.graph->replay();  // warm-up
  ops_.download(sink.data(), inferActs_->logits);
  double best = 1e30;
  for (int run = 0; run < 3; ++run) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 8; ++i) rec.graph->replay();
    ops_.download(sink.data(), inferActs_->logits);  // waits for the replays
    const double us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, us / 8);
  }
  return best;
}

double Gpt2::recordedStepMicros() {
  auto it = stepGraphs_.find(fastPath(false));
  if (it == stepGraphs_.end() || cachePos_ >= cfg_.blockSize) return 0;
  return stepMicros(it->second, 0);
}

// The op-by-op one-token step (inside a capture).
void Gpt2::recordOpSteps(const PathEntry* path) {
  const int C = cfg_.nEmbd, NH = cfg_.nHead, V = cfg_.vocabSize, T = cfg_.blockSize;
  Acts& a = *inferActs_;
  float *x = a.encoded.data(), *ln = a.ln1[0].data(), *y = a.atty[0].data();
  float *proj = a.attProj[0].data(), *h = a.fch[0].data(), *qkv = stepQkv_.data();
  const int32_t* step = static_cast<const int32_t*>(stepIds_->ptr);
  ops_.embeddingStep(x, step, param(*wte_), param(*wpe_), C);
  for (int l = 0; l < cfg_.nLayer; ++l) {
    Layer& L = layers_[size_t(l)];
    ops_.layernormForward(ln, nullptr, nullptr, x, param(*L.ln1w), param(*L.ln1b), 1, C);
    linear(L.attn, qkv, ln, 1, path);
    ops_.attentionStep(y, a.att[0].data(), kvCache_[size_t(l)].data(), qkv, C, NH, T, step);
    linear(L.proj, proj, y, 1, path);
    ops_.add(x, x, proj, C);
    ops_.layernormForward(ln, nullptr, nullptr, x, param(*L.ln2w), param(*L.ln2b), 1, C);
    linear(L.fc, h, ln, 1, path);
    ops_.geluForward(h, h, int64_t(4) * C);
    linear(L.fcProj, proj, h, 1, path);
    ops_.add(x, x, proj, C);
  }
  ops_.layernormForward(a.lnf.data(), nullptr, nullptr, x, param(*lnfW_), param(*lnfB_), 1, C);
  ops_.matmulAbt(a.logits.data(), a.lnf.data(), param(*wte_), 1, C, V, false);
}

}  // namespace ptllm
