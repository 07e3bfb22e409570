// The model-level gates and the drift sentinel, and the fault matrix's model-side rows: a path
// that diverges only after 50 tokens (end-to-end gate), one that drifts only late in a long
// generation (drift sentinel), one that keeps stale weights after a train step (loss gate
// re-run after the update) — and the real f16-storage path passing all of them.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>

#include "core/file_io.h"
#include "gate/paths.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/ops.h"
#include "model/checkpoint.h"
#include "model/model_gate.h"
#include "model/sampler.h"
#include "model/trainer.h"
#include "test_util.h"

namespace ptllm {
namespace {

const std::string kModel = std::string(PTLLM_SOURCE_DIR) + "/models/shakespeare.safetensors";

// Counts M==1 dispatches (decode steps) once armed; corrupts every output after `after` of them.
std::atomic<bool> gArmed{false};
std::atomic<int> gDecodeCalls{0};
std::atomic<int> gCorruptAfter{0};
void lateCorrupting(float* out, const float* in, const void* w, const float* bias, int M, int K,
                    int N) {
  cpu::matmulF16(out, in, w, bias, M, K, N);
  if (!gArmed || M != 1) return;
  if (gDecodeCalls.fetch_add(1) >= gCorruptAfter)
    for (int n = 0; n < N; ++n) out[n] += 0.5f;
}

PathEntry variant(const std::string& name, MatmulFn fn, PrepareFn prep = nullptr) {
  PathEntry e = *findPath("f16-storage");
  e.name = name;
  e.dispatch = fn;
  if (prep) e.prepare = prep;
  return e;
}

struct Loaded {
  std::unique_ptr<Ops> ops = makeCpuOps();
  std::unique_ptr<PathSet> paths;
  LoadedModel lm;
};
Loaded load(std::vector<PathEntry> entries) {
  Loaded l;
  l.paths =
      std::make_unique<PathSet>(*l.ops, PathSelection{}, detectCapabilities(), std::move(entries));
  l.lm = loadCheckpoint(*l.ops, kModel);
  l.lm.model->setPaths(l.paths.get());
  l.paths->results();  // matmul gates settled before the fault is armed
  return l;
}

class ModelGates : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fileExists(kModel)) GTEST_SKIP() << "no bundled model";
    gArmed = false;
    gDecodeCalls = 0;
  }
  void TearDown() override { gArmed = false; }
};

TEST_F(ModelGates, RealF16PathPassesEveryModelGate) {
  Loaded l = load({*findPath("f16-storage")});
  ModelGate gate(*l.lm.model, &*l.lm.tokenizer);
  const ModelGateReport& r = gate.apply();
  EXPECT_EQ(r.path, "f16-storage");
  EXPECT_TRUE(r.workloadPass);
  EXPECT_EQ(r.workload.shapes.size(), 4u);  // c_attn, attn.c_proj, c_fc, mlp.c_proj of layer 0
  EXPECT_TRUE(r.e2ePass) << r.e2eFirstDiff;
  EXPECT_EQ(r.e2eTokens, 100);
  EXPECT_TRUE(r.lossPass) << r.lossRel;
  EXPECT_LT(r.lossRel, 1e-3);
  EXPECT_TRUE(l.lm.model->pathAllowedInTraining());
  EXPECT_TRUE(l.lm.model->pathAllowedInInference());
  // A long generation: the sentinel checks at 256 and 512 and finds no drift.
  Generator gen(*l.lm.model);
  SampleOptions o;
  o.tokens = 600;
  o.temperature = 0.8f;
  gen.generate(l.lm.tokenizer->encode("ROMEO:", "p"), o);
  EXPECT_EQ(gen.sentinel().checks, 2);
  EXPECT_FALSE(gen.sentinel().demoted) << gen.sentinel().line;
  EXPECT_EQ(l.lm.model->lastLinearPath(), "f16-storage");
}

TEST_F(ModelGates, PathDivergingAfter50TokensFailsTheEndToEndGate) {
  Loaded l = load({variant("late-50", lateCorrupting)});
  ASSERT_TRUE(l.paths->isActive("late-50"));  // the matmul gates alone would let it through
  gCorruptAfter = 50 * 4 * l.lm.model->config().nLayer;  // 4 linears per layer per token
  gArmed = true;
  const ModelGateReport r = runModelGates(*l.lm.model, &*l.lm.tokenizer);
  EXPECT_FALSE(r.e2ePass);
  EXPECT_GE(r.e2eFirstDiff, 49);
  EXPECT_LE(r.e2eFirstDiff, 60);
  EXPECT_FALSE(r.inferenceOk());
  EXPECT_TRUE(r.workloadPass);  // prefill-sized calls: the workload gate cannot see it either
  const auto lines = r.lines();
  EXPECT_TRUE(std::any_of(lines.begin(), lines.end(), [](const std::string& l) {
    return l.find("end-to-end gate: greedy text diverges from f32 at token") != std::string::npos;
  }));
}

TEST_F(ModelGates, LateDriftIsCaughtByTheSentinelAndDemotesToF32) {
  Loaded l = load({variant("late-300", lateCorrupting)});
  gCorruptAfter = 300 * 4 * l.lm.model->config().nLayer;  // past the end-to-end gate's 100
  gArmed = true;
  Gpt2& m = *l.lm.model;
  const ModelGateReport r = runModelGates(m, &*l.lm.tokenizer);
  EXPECT_TRUE(r.e2ePass) << "the end-to-end gate cannot see this one";
  gDecodeCalls = 0;
  Generator gen(m);
  SampleOptions o;
  o.tokens = 600;
  o.temperature = 0;
  gen.generate(l.lm.tokenizer->encode("ROMEO:", "p"), o);
  ASSERT_TRUE(gen.sentinel().demoted);
  EXPECT_EQ(gen.sentinel().demotedAt, 512);  // first check after the fault starts (~token 300)
  EXPECT_NE(gen.sentinel().line.find("drift sentinel"), std::string::npos);
  EXPECT_FALSE(m.pathAllowedInInference());
  EXPECT_EQ(m.lastLinearPath(), "f32");
  // With the sentinel off the fault goes unnoticed: it is the sentinel that caught it.
  m.setPathUse(true, true);
  gDecodeCalls = 0;
  o.sentinelEvery = 0;
  gen.generate(l.lm.tokenizer->encode("ROMEO:", "p"), o);
  EXPECT_FALSE(gen.sentinel().demoted);
}

// Keeps the first weights it was given for each f32 weight: after an update it computes with
// stale values though the model re-packed.
std::map<const void*, std::vector<float>> gStale;   // packed dst -> first-seen weights
std::map<const float*, std::vector<float>> gFirst;  // f32 weight -> first-seen weights
bool stalePrepare(void* dst, const float* w, int K, int N) {
  if (!cpu::packF16(dst, w, K, N)) return false;
  if (gArmed) {
    auto it = gFirst.find(w);
    if (it == gFirst.end()) it = gFirst.emplace(w, std::vector<float>(w, w + int64_t(K) * N)).first;
    gStale[dst] = it->second;
  }
  return true;
}
void staleDispatch(float* out, const float* in, const void* w, const float* bias, int M, int K,
                   int N) {
  auto it = gStale.find(w);
  if (it == gStale.end()) return cpu::matmulF16(out, in, w, bias, M, K, N);
  cpu::matmul(out, in, it->second.data(), bias, M, K, N);
}

// A 2-layer model on generated text, 3 steps, no periodic evaluation.
TrainOptions tinyRun(const test::TempDir& dir) {
  test::writeText(dir.file("d.txt"), test::sampleText(20000));
  TrainOptions o;
  o.dataPath = dir.file("d.txt");
  o.outPath = dir.file("m.safetensors");
  o.model.nLayer = 2;
  o.model.nHead = 2;
  o.model.nEmbd = 32;
  o.model.blockSize = 32;
  o.batchSize = 4;
  o.steps = 3;
  o.warmup = 0;
  o.evalEvery = 0;
  return o;
}

TEST(ModelGatesTraining, StaleWeightsAfterATrainStepAreCaughtByTheLossGate) {
  test::TempDir dir;
  auto ops = makeCpuOps();
  PathSet paths(*ops, PathSelection{}, detectCapabilities(),
                {variant("stale", staleDispatch, stalePrepare)});
  paths.results();
  TrainOptions o = tinyRun(dir);
  o.lr = 1e-2f;
  Trainer t(*ops, o);
  t.model().setPaths(&paths);
  gStale.clear();
  gFirst.clear();
  gArmed = true;
  EXPECT_TRUE(t.model().pathAllowedInTraining());
  t.step();  // packs (and the fault remembers) the initial weights, then updates them
  t.step();  // the loss gate re-runs on the updated weights and sees the stale path
  gArmed = false;
  EXPECT_FALSE(t.model().pathAllowedInTraining());
  gStale.clear();
  gFirst.clear();
}

TEST(ModelGatesTraining, RealPathKeepsServingTheTrainingForward) {
  test::TempDir dir;
  auto ops = makeCpuOps();
  PathSet paths(*ops, PathSelection{}, detectCapabilities(), {*findPath("f16-storage")});
  TrainOptions o = tinyRun(dir);
  Trainer t(*ops, o);
  t.model().setPaths(&paths);
  for (int i = 0; i < 3; ++i) t.step();
  EXPECT_TRUE(t.model().pathAllowedInTraining());
  EXPECT_EQ(t.model().lastLinearPath(), "f16-storage");
}

}  // namespace
}  // namespace ptllm

namespace ptllm {
namespace {

ModelConfig scopeConfig() {
  ModelConfig c;
  c.nLayer = 2;
  c.nHead = 2;
  c.nEmbd = 32;
  c.blockSize = 16;
  c.vocabSize = 11;
  return c;
}

// The spec's activation scope, proved: backward, AdamW and the tied head never read the packed
// copies, and after an update the forward runs on freshly packed weights.
TEST(ActivationScope, BackwardAndHeadNeverReadThePackedWeights) {
  auto ops = makeCpuOps();
  PathSet paths(*ops, PathSelection{}, detectCapabilities(), {*findPath("f16-storage")});
  const ModelConfig c = scopeConfig();
  Gpt2 fast(*ops, c), ref(*ops, c);
  fast.initRandom(3);
  ref.initRandom(3);
  fast.setPaths(&paths);
  std::vector<int32_t> x(2 * 16), y(2 * 16);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = int32_t((i * 7 + 1) % 11);
    y[i] = int32_t((i * 5 + 2) % 11);
  }
  fast.forward(x.data(), y.data(), 2, 16);
  ASSERT_EQ(fast.lastLinearPath(), "f16-storage");
  const auto packed = fast.packedBuffers();
  ASSERT_EQ(packed.size(), 8u);                                  // 4 linears x 2 layers
  for (Buffer* b : packed) std::memset(b->ptr, 0xFF, b->bytes);  // every f16 becomes NaN
  fast.zeroGrad();
  fast.backward();  // must read only f32 weights and saved activations
  std::vector<float> g(size_t(fast.numParams()));
  ops->download(g.data(), fast.gradData());
  EXPECT_TRUE(test::allFinite(g.data(), g.size()));
  // Same gradients as a model that never had a fast path, within the forward's f16 error.
  ref.forward(x.data(), y.data(), 2, 16);
  ref.zeroGrad();
  ref.backward();
  std::vector<float> gr(g.size());
  ops->download(gr.data(), ref.gradData());
  EXPECT_LE(test::worstRatio(g.data(), gr.data(), g.size(), 1e-4, 2e-2), 1.0);
  fast.adamwStep(1e-2f, 0.9f, 0.99f, 1e-8f, 0.1f);  // AdamW updates f32 and drops the copies
  EXPECT_TRUE(fast.packedBuffers().empty());
}

TEST(ActivationScope, ForwardAfterAnUpdateUsesFreshlyPackedWeights) {
  auto ops = makeCpuOps();
  PathSet paths(*ops, PathSelection{}, detectCapabilities(), {*findPath("f16-storage")});
  const ModelConfig c = scopeConfig();
  Gpt2 m(*ops, c);
  m.initRandom(5);
  m.setPaths(&paths);
  std::vector<int32_t> x(16), y(16);
  for (int i = 0; i < 16; ++i) {
    x[i] = (i * 3 + 1) % 11;
    y[i] = (i * 7 + 2) % 11;
  }
  const float before = m.forward(x.data(), y.data(), 1, 16);
  m.zeroGrad();
  m.backward();
  m.adamwStep(5e-2f, 0.9f, 0.99f, 1e-8f, 0.0f);
  const float fastAfter = m.forward(x.data(), y.data(), 1, 16);
  EXPECT_EQ(m.lastLinearPath(), "f16-storage");
  m.setForceF32(true);
  const float f32After = m.forward(x.data(), y.data(), 1, 16);
  m.setForceF32(false);
  // The update moved the loss far more than f16 storage can explain; the fast forward follows
  // the updated weights to within the loss gate's 0.1%.
  EXPECT_GT(std::fabs(before - f32After), 100 * std::fabs(fastAfter - f32After));
  EXPECT_LT(std::fabs(fastAfter - f32After), 1e-3 * std::fabs(f32After));
}

}  // namespace
}  // namespace ptllm
