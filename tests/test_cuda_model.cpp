// The bundled model on the GPU: greedy text on the GPU's canonical f32 path equals the CPU's for
// 200 characters, and each GPU fast path that passed its gate produces the GPU f32 path's text;
// the decode loop keeps its state on the device (weights, activations, KV cache). Skips without
// a usable GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/file_io.h"
#include "gate/paths.h"
#include "kernels/cuda/cuda_device.h"
#include "kernels/ops.h"
#include "model/checkpoint.h"
#include "model/sampler.h"
#include "test_util.h"

namespace ptllm {
namespace {

const std::string kModel = std::string(PTLLM_SOURCE_DIR) + "/models/shakespeare.safetensors";

struct Generated {
  std::string text;
  std::string pathUsed;
};

// The bundled model on `ops` with its paths selected, and the tests' prompt.
struct BundledOn {
  BundledOn(Ops& ops, const char* paths)
      : set(ops, PathSelection::parse(paths)),
        lm(loadCheckpoint(ops, kModel)),
        prompt(lm.tokenizer->encode("ROMEO:", "prompt")) {
    lm.model->setPaths(&set);
  }
  PathSet set;
  LoadedModel lm;
  std::vector<int32_t> prompt;
};

Generated greedy(Ops& ops, const std::string& paths, int tokens) {
  BundledOn loaded(ops, paths.c_str());
  LoadedModel& lm = loaded.lm;
  lm.model->prepareForInference();
  EXPECT_EQ(lm.model->paramData().device(), ops.device());  // weights live on the backend
  Generator gen(*lm.model);
  SampleOptions o;
  o.tokens = tokens;
  o.temperature = 0;
  const auto out = gen.generate(loaded.prompt, o);
  return {lm.tokenizer->decode(out), lm.model->lastLinearPath()};
}

std::string firstDifference(const std::string& a, const std::string& b) {
  const auto mis = std::mismatch(a.begin(), a.end(), b.begin(), b.end());
  return "texts differ at byte " + std::to_string(mis.first - a.begin()) + "\n--- a:\n" + a +
         "\n--- b:\n" + b;
}

class CudaModel : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cudaDeviceInfo().available) GTEST_SKIP() << cudaDeviceInfo().reason;
    if (!fileExists(kModel)) GTEST_SKIP() << "no bundled model at " << kModel;
    gpu = makeCudaOps();
  }
  std::unique_ptr<Ops> gpu;
};

TEST_F(CudaModel, GreedyGpuF32EqualsCpuF32For200Characters) {
  auto cpu = makeCpuOps();
  const Generated c = greedy(*cpu, "f32", 200);
  const Generated g = greedy(*gpu, "f32", 200);
  ASSERT_EQ(g.pathUsed, "f32");
  ASSERT_EQ(c.text.size(), 200u);
  EXPECT_EQ(c.text, g.text) << firstDifference(c.text, g.text);
}

TEST_F(CudaModel, EveryPassingGpuPathGivesTheGpuF32Text) {
  const Generated f32 = greedy(*gpu, "f32", 200);
  PathSet probe(*gpu, PathSelection{});
  int compared = 0;
  for (const GateResult& r : probe.results()) {
    if (!r.active()) continue;
    const Generated fast = greedy(*gpu, r.path, 200);
    ASSERT_EQ(fast.pathUsed, r.path) << "the path was not used: the comparison would be f32/f32";
    EXPECT_EQ(f32.text, fast.text) << r.path << ": " << firstDifference(f32.text, fast.text);
    ++compared;
  }
  EXPECT_GE(compared, 1) << "no GPU path passed its gate";
  EXPECT_TRUE(probe.isActive("f16-storage"));
}

// The recorded decode step (one graph launch per token: the fused step, decode_step.cu) computes
// exactly what the op-by-op step does, so every step's logits are bit-identical, on f32 and on
// the active fast path.
TEST_F(CudaModel, StepGraphDecodeEqualsOpByOpDecode) {
  for (const char* paths : {"f32", "auto"}) {
    SCOPED_TRACE(paths);
    BundledOn loaded(*gpu, paths);
    Gpt2& m = *loaded.lm.model;
    const std::vector<int32_t>& prompt = loaded.prompt;
    const int steps = std::min(120, m.config().blockSize - int(prompt.size()));
    auto run = [&](bool graphs) {
      m.setStepGraphs(graphs);
      m.setFusedSteps(Gpt2::FusedSteps::On);
      return test::greedyStepLogits(m, prompt, steps, [&] {
        EXPECT_EQ(m.usedStepGraph(), graphs);
        EXPECT_EQ(m.usedFusedStep() > 0, graphs);  // f32 and f16-storage both run fused
      });
    };
    const auto opByOp = run(false), replayed = run(true);
    ASSERT_EQ(opByOp.size(), replayed.size());
    for (size_t i = 0; i < opByOp.size(); ++i) ASSERT_EQ(opByOp[i], replayed[i]) << "step " << i;
  }
}

// Greedy runs decoded on the device (Gpt2::decodeGreedy, the device picking each next token)
// give the host loop's tokens: whole generations across the context's slide and sentinel
// checks, and one run step by step — every pick the argmax of the host loop's logits, the last
// logits bit-identical.
TEST_F(CudaModel, DeviceGreedyRunsEqualTheHostLoop) {
  for (const char* paths : {"f32", "auto"}) {
    SCOPED_TRACE(paths);
    BundledOn loaded(*gpu, paths);
    Gpt2& m = *loaded.lm.model;
    const std::vector<int32_t>& prompt = loaded.prompt;
    auto generate = [&](bool onDevice) {
      Generator gen(m);
      SampleOptions o;
      o.tokens = 300;  // past the 256-token context: one slide
      o.temperature = 0;
      o.sentinelEvery = 50;
      o.deviceGreedy = onDevice;
      std::vector<int32_t> streamed;
      const auto out = gen.generate(prompt, o, [&](int32_t t) { streamed.push_back(t); });
      EXPECT_EQ(streamed, out);
      EXPECT_EQ(gen.slides(), 1);
      return std::make_pair(out, gen.context());
    };
    const auto host = generate(false), device = generate(true);
    EXPECT_EQ(host.first, device.first);
    EXPECT_EQ(host.second, device.second);

    // Two full recorded runs (Gpt2::kGreedyRunSteps steps each) and a tail replayed per token.
    const int V = m.config().vocabSize, n = 2 * Gpt2::kGreedyRunSteps + 6;
    std::vector<float> logits(static_cast<size_t>(V)), last(logits.size());
    m.resetCache();
    m.forwardCached(prompt.data(), int(prompt.size()), logits.data());
    const int32_t first = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    std::vector<int32_t> picks;
    ASSERT_TRUE(m.canDecodeGreedy());
    ASSERT_TRUE(m.decodeGreedy(
        first, n, [&](int32_t t) { picks.push_back(t); }, last.data()));
    ASSERT_EQ(picks.size(), size_t(n));
    EXPECT_EQ(m.cachedTokens(), int(prompt.size()) + n);
    m.resetCache();
    m.forwardCached(prompt.data(), int(prompt.size()), logits.data());
    int32_t fed = first;
    for (int k = 0; k < n; ++k) {
      m.forwardCached(&fed, 1, logits.data());
      fed = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
      ASSERT_EQ(picks[size_t(k)], fed) << "pick " << k;
    }
    EXPECT_EQ(std::memcmp(logits.data(), last.data(), logits.size() * sizeof(float)), 0);

    // The same run decoded again from the prompt, as the model is now set: the same picks and
    // the same last logits bit for bit.
    auto sameRunAgain = [&] {
      m.resetCache();
      m.forwardCached(prompt.data(), int(prompt.size()), logits.data());
      std::vector<int32_t> got;
      std::vector<float> lastGot(logits.size());
      ASSERT_TRUE(m.decodeGreedy(
          first, n, [&](int32_t t) { got.push_back(t); }, lastGot.data()));
      EXPECT_EQ(got, picks);
      EXPECT_EQ(std::memcmp(lastGot.data(), last.data(), last.size() * sizeof(float)), 0);
    };
    // Without the recorded runs (the step replayed and the pick queued per token).
    m.setGreedyRunGraphs(false);
    sameRunAgain();
    m.setGreedyRunGraphs(true);

    // Fused form 4 forced (on either path its qkv hands the query over in shared memory):
    // each full run is one launch of all its steps, and so is the tail; with that off, one
    // launch per step.
    for (bool persistent : {true, false}) {
      SCOPED_TRACE(persistent ? "one launch per run" : "one launch per step");
      m.setFusedSteps(Gpt2::FusedSteps::On, 0, 4);
      m.setPersistentGreedyRuns(persistent);
      sameRunAgain();
      EXPECT_EQ(m.usedFusedForm(), 4);
      EXPECT_EQ(m.usedPersistentGreedyRun(), persistent);
    }
    m.setPersistentGreedyRuns(true);
    m.setFusedSteps(Gpt2::FusedSteps::Auto);
  }
}

// Speculative greedy runs (Gpt2::setSpeculativeLanes) change how many steps run one after
// another, not one output bit: whole generations (across the slide and sentinel checks) give
// the same tokens with 2, 4, 6 and 8 lanes as without, and one run from the prompt gives the same
// picks and last logits — with drafts both kept and dropped on the bundled model's text (fewer
// verify steps than tokens, more than tokens / lanes), all of it emitted speculatively (the
// run has room for the lanes).
TEST_F(CudaModel, SpeculativeGreedyRunsEqualGreedyRuns) {
  for (const char* paths : {"f32", "auto"}) {
    SCOPED_TRACE(paths);
    BundledOn loaded(*gpu, paths);
    Gpt2& m = *loaded.lm.model;
    const std::vector<int32_t>& prompt = loaded.prompt;
    int specTokens = 0, specSteps = 0, specLanes = 0;  // the last generation's (Generator)
    auto generate = [&](int lanes) {
      m.setSpeculativeLanes(lanes);
      Generator gen(m);
      SampleOptions o;
      o.tokens = 300;
      o.temperature = 0;
      o.sentinelEvery = 50;
      std::vector<int32_t> out = gen.generate(prompt, o);
      specTokens = gen.speculativeTokens();
      specSteps = gen.speculativeSteps();
      specLanes = gen.speculativeLanes();
      return out;
    };
    const std::vector<int32_t> plain = generate(0);
    EXPECT_EQ(specSteps, 0);
    EXPECT_EQ(specLanes, 0);
    for (int lanes : {2, 4, 6, 8}) EXPECT_EQ(generate(lanes), plain) << lanes << " lanes";
    generate(4);  // 4 lanes fit (as the run below needs; an H100 holds 6)
    EXPECT_GT(specSteps, 0);
    EXPECT_LT(specSteps, specTokens) << "no draft was kept";
    EXPECT_LE(specTokens, 300);
    EXPECT_EQ(specLanes, 4);

    const int V = m.config().vocabSize, n = 120;
    auto run = [&](int lanes, std::vector<int32_t>& picks, std::vector<float>& last) {
      m.setSpeculativeLanes(lanes);
      std::vector<float> logits(static_cast<size_t>(V));
      m.resetCache();
      m.forwardCached(prompt.data(), int(prompt.size()), logits.data());
      const int32_t first =
          int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
      std::vector<int32_t> cached = prompt;
      last.assign(size_t(V), 0.f);
      ASSERT_TRUE(m.decodeGreedy(
          first, n, [&](int32_t t) { picks.push_back(t); }, last.data(), cached.data()));
      EXPECT_EQ(m.cachedTokens(), int(prompt.size()) + n);
    };
    std::vector<int32_t> want, got;
    std::vector<float> wantLast, gotLast;
    run(0, want, wantLast);
    EXPECT_EQ(m.lastSpeculativeSteps(), 0);
    run(4, got, gotLast);
    EXPECT_EQ(got, want);
    EXPECT_EQ(std::memcmp(gotLast.data(), wantLast.data(), wantLast.size() * sizeof(float)), 0);
    EXPECT_EQ(m.lastSpeculativeTokens(), n);
    EXPECT_EQ(m.lastSpeculativeLanes(), 4);
    EXPECT_LT(m.lastSpeculativeSteps(), n) << "no draft was kept";
    EXPECT_GT(m.lastSpeculativeSteps() * 4, n) << "no draft was dropped";
    m.setSpeculativeLanes(0);
  }
}

}  // namespace
}  // namespace ptllm
