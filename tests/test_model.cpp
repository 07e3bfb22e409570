// The GPT-2 model as a whole: gradients against finite differences, overfitting a string,
// the KV cache against full recompute, deterministic sampling, CPU backend against reference.
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "core/rng.h"
#include "kernels/ops.h"
#include "model/gpt2.h"
#include "model/sampler.h"
#include "model/tokenizer.h"
#include "test_util.h"

namespace ptllm {
namespace {

ModelConfig tinyConfig() {
  ModelConfig c;
  c.nLayer = 2;
  c.nHead = 2;
  c.nEmbd = 8;
  c.blockSize = 6;
  c.vocabSize = 7;
  return c;
}

std::vector<float> hostParams(Gpt2& m) {
  std::vector<float> p(size_t(m.numParams()));
  m.ops().download(p.data(), m.paramData());
  return p;
}

TEST(Gpt2, WholeModelGradientMatchesFiniteDifferences) {
  auto ops = makeRefOps();
  Gpt2 m(*ops, tinyConfig());
  m.initRandom(3);
  // Larger weights than GPT-2's init so every parameter matters measurably.
  auto p = hostParams(m);
  Rng rng(11);
  for (auto& x : p) x += 0.3f * rng.normal();
  ops->upload(m.paramData(), p.data());
  const int B = 2, T = 5;
  std::vector<int32_t> x = {1, 2, 3, 4, 5, 6, 0, 1, 2, 3}, y = {2, 3, 4, 5, 6, 0, 1, 2, 3, 4};
  m.forward(x.data(), y.data(), B, T);
  m.zeroGrad();
  m.backward();
  std::vector<float> g(p.size());
  ops->download(g.data(), m.gradData());
  // Check a spread of parameters from every tensor.
  const double h = 1e-3;
  int checked = 0;
  for (const auto& info : m.paramInfos()) {
    for (int64_t k = 0; k < info.numel(); k += std::max<int64_t>(1, info.numel() / 5)) {
      const size_t j = size_t(info.offset + k);
      const float p0 = p[j];
      p[j] = p0 + float(h);
      ops->upload(m.paramData(), p.data());
      const double lp = m.forward(x.data(), y.data(), B, T);
      p[j] = p0 - float(h);
      ops->upload(m.paramData(), p.data());
      const double lm = m.forward(x.data(), y.data(), B, T);
      p[j] = p0;
      const double fd = (lp - lm) / (2 * h);
      // The loss is an f32 mean of f32 terms: FD noise ~ 1e-7 / h = 1e-4.
      EXPECT_NEAR(g[j], fd, 3e-4 + 1e-2 * std::fabs(fd)) << info.name << "[" << k << "]";
      ++checked;
    }
  }
  EXPECT_GT(checked, 100);
}

TEST(Gpt2, CpuBackendMatchesReferenceForwardAndBackward) {
  auto ref = makeRefOps();
  auto cpu = makeCpuOps();
  ModelConfig c = tinyConfig();
  c.nEmbd = 32;
  c.nHead = 4;
  c.blockSize = 16;
  c.vocabSize = 13;
  Gpt2 a(*ref, c), b(*cpu, c);
  a.initRandom(9);
  b.initRandom(9);
  std::vector<int32_t> x(3 * 16), y(3 * 16);
  Rng rng(1);
  for (auto& t : x) t = int32_t(rng.below(13));
  for (auto& t : y) t = int32_t(rng.below(13));
  const float la = a.forward(x.data(), y.data(), 3, 16), lb = b.forward(x.data(), y.data(), 3, 16);
  EXPECT_NEAR(la, lb, 1e-5 * std::fabs(la));
  a.zeroGrad();
  b.zeroGrad();
  a.backward();
  b.backward();
  std::vector<float> ga(size_t(a.numParams())), gb(ga.size());
  ref->download(ga.data(), a.gradData());
  cpu->download(gb.data(), b.gradData());
  EXPECT_LE(test::worstRatio(gb.data(), ga.data(), ga.size(), 1e-5, 1e-3), 1.0);
}

TEST(Gpt2, OverfitsAShortString) {
  auto ops = makeCpuOps();
  const std::string text = "hello posttrainllm, speed only counts if it preserves loss.";
  auto tok = CharTokenizer::fromText(text, "text");
  ModelConfig c;
  c.nLayer = 2;
  c.nHead = 2;
  c.nEmbd = 32;
  c.blockSize = int(text.size()) - 1;
  c.vocabSize = tok.size();
  Gpt2 m(*ops, c);
  m.initRandom(1);
  auto ids = tok.encode(text, "text");
  std::vector<int32_t> x(ids.begin(), ids.end() - 1), y(ids.begin() + 1, ids.end());
  float loss = 0;
  for (int step = 0; step < 300; ++step) {
    loss = m.forward(x.data(), y.data(), 1, c.blockSize);
    m.zeroGrad();
    m.backward();
    m.clipGradNorm(1.0f);
    m.adamwStep(3e-3f, 0.9f, 0.99f, 1e-8f, 0.0f);
  }
  EXPECT_LT(loss, 0.05f);
}

TEST(Gpt2, KvCacheLogitsEqualFullRecompute) {
  for (auto makeOps : {makeRefOps, makeCpuOps}) {
    auto ops = makeOps();
    ModelConfig c = tinyConfig();
    c.nEmbd = 16;
    c.blockSize = 12;
    c.vocabSize = 9;
    Gpt2 m(*ops, c);
    m.initRandom(4);
    std::vector<int32_t> seq = {1, 5, 2, 8, 0, 3, 3, 7, 6, 4, 2, 1};
    m.forward(seq.data(), nullptr, 1, 12);
    const auto full = m.logitsHost();  // [12, V]
    // Token by token, and as a prefill of 5 followed by single tokens.
    for (int prefill : {1, 5}) {
      m.resetCache();
      std::vector<float> logits(9);
      m.forwardCached(seq.data(), prefill, logits.data());
      EXPECT_LE(test::worstRatio(logits.data(), full.data() + (prefill - 1) * 9, 9, 1e-5, 1e-5),
                1.0);
      for (int t = prefill; t < 12; ++t) {
        m.forwardCached(seq.data() + t, 1, logits.data());
        EXPECT_LE(test::worstRatio(logits.data(), full.data() + t * 9, 9, 1e-5, 1e-5), 1.0)
            << "position " << t << " prefill " << prefill << " ops " << ops->name();
      }
      EXPECT_THROW(m.forwardCached(seq.data(), 1, logits.data()), Error);  // context full
    }
  }
}

TEST(Gpt2, SeededSamplingIsDeterministicAndSlidesTheWindow) {
  auto ops = makeCpuOps();
  ModelConfig c = tinyConfig();
  c.blockSize = 8;
  c.vocabSize = 9;
  Gpt2 m(*ops, c);
  m.initRandom(2);
  Generator gen(m);
  SampleOptions o;
  o.tokens = 40;  // well past the 8-token context: the window slides
  o.temperature = 0.8f;
  o.topK = 5;
  o.topP = 0.9f;
  o.seed = 42;
  const auto a = gen.generate({1, 2, 3}, o);
  EXPECT_GT(gen.slides(), 0);
  const auto b = gen.generate({1, 2, 3}, o);
  EXPECT_EQ(a, b);
  o.seed = 43;
  EXPECT_NE(a, gen.generate({1, 2, 3}, o));
  o.temperature = 0;
  const auto g1 = gen.generate({1, 2, 3}, o);
  o.seed = 44;
  EXPECT_EQ(g1, gen.generate({1, 2, 3}, o));  // greedy ignores the seed
  for (int32_t t : a) EXPECT_TRUE(t >= 0 && t < 9);
}

TEST(Sampler, TopKAndTopPRestrictTheChoice) {
  std::vector<float> logits = {0.0f, 5.0f, 4.9f, -1.0f, 1.0f};
  Rng rng(1);
  SampleOptions o;
  o.temperature = 1.0f;
  o.topK = 2;
  for (int i = 0; i < 200; ++i) {
    const int t = sampleToken(logits.data(), 5, o, rng);
    EXPECT_TRUE(t == 1 || t == 2);
  }
  o.topK = 0;
  o.topP = 0.3f;  // the top token alone holds > 30%
  for (int i = 0; i < 50; ++i) EXPECT_EQ(sampleToken(logits.data(), 5, o, rng), 1);
  o.temperature = 0;
  EXPECT_EQ(sampleToken(logits.data(), 5, o, rng), 1);
}

TEST(Sampler, NaNLogitsAreNeverDrawnAndAllBrokenLogitsAreAnError) {
  // Many NaNs among finite logits (enough that std::sort runs its introsort, where a comparator
  // that is not a strict weak ordering reads out of bounds): only finite ones are drawn.
  const int V = 1000;
  std::vector<float> logits(V, std::nanf(""));
  for (int i = 3; i < V; i += 7) logits[size_t(i)] = float(i % 13) * 0.1f;
  logits[500] = 9.0f;  // 500 % 7 == 3: a finite slot, the largest
  Rng rng(3);
  SampleOptions o;
  o.temperature = 1.0f;
  for (int i = 0; i < 100; ++i) {
    const int t = sampleToken(logits.data(), V, o, rng);
    ASSERT_TRUE(t >= 0 && t < V);
    EXPECT_FALSE(std::isnan(logits[size_t(t)])) << "drew NaN logit " << t;
  }
  o.topK = 1;
  EXPECT_EQ(sampleToken(logits.data(), V, o, rng), 500);
  o.topK = 0;
  logits[7] = INFINITY;
  EXPECT_EQ(sampleToken(logits.data(), V, o, rng), 7);
  std::vector<float> broken(V, std::nanf(""));
  broken[10] = -INFINITY;
  EXPECT_THROW(sampleToken(broken.data(), V, o, rng), Error);
}

TEST(Tokenizer, RoundTripsUnicodeAndNamesMissingCharacters) {
  auto tok = CharTokenizer::fromText("héllo wörld\n", "t");
  EXPECT_EQ(tok.decode(tok.encode("wörld héllo", "p")), "wörld héllo");
  try {
    tok.encode("hi!", "--prompt");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'i'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("--prompt"), std::string::npos);
  }
  EXPECT_THROW(CharTokenizer::fromText("bad \xff byte", "f"), Error);
  EXPECT_THROW(CharTokenizer::fromText("", "f"), Error);
  auto back = CharTokenizer::fromJson(tok.toJson(), "j");
  EXPECT_EQ(back.vocab(), tok.vocab());
}

}  // namespace
}  // namespace ptllm
