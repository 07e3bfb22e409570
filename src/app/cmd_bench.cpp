// ptllm bench: throughput of our own paths, printed as `peer=ptllm mode=... key=value` lines in
// the format of ../shared/peers so one summariser compares them side by side (bench/).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <utility>
#include <vector>

#include "app/commands.h"
#include "app/engine.h"
#include "core/error.h"
#include "core/rng.h"
#include "core/thread_pool.h"
#include "gate/paths.h"
#include "kernels/cpu/cpu_kernels.h"
#include "model/checkpoint.h"
#include "model/gpt2.h"
#include "model/sampler.h"

namespace ptllm::app {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct ModelArgs {
  ModelConfig cfg;
  int batch = 12, steps = 50, warmup = 3, tokens = 200;
  // sample: timed generations (the median is reported); the decode step's form on a backend
  // with step graphs (fused, or the op kernels recorded) and the fused launch's cluster size.
  int repeats = 1, decodeCluster = 0, decodeForm = 0;
  bool fusedStep = true;
  bool greedyRunGraph = true;
  bool persistentRun = true;
  int speculative = 0;  // sample: speculative greedy lanes (Gpt2::setSpeculativeLanes)
  std::string model;    // sample: a checkpoint instead of random weights of cfg's shape
  ModelArgs() {
    cfg.nLayer = 4;
    cfg.nHead = 4;
    cfg.nEmbd = 128;
    cfg.blockSize = 64;
    cfg.vocabSize = 65;  // tiny-shakespeare's character set
  }
};

void addModelOptions(CLI::App* cmd, ModelArgs& a) {
  cmd->add_option("--n-layer", a.cfg.nLayer)->capture_default_str()->check(intRange(1));
  cmd->add_option("--n-head", a.cfg.nHead)->capture_default_str()->check(intRange(1));
  cmd->add_option("--n-embd", a.cfg.nEmbd)->capture_default_str()->check(intRange(1));
  cmd->add_option("--block-size", a.cfg.blockSize)->capture_default_str()->check(intRange(1));
  cmd->add_option("--vocab", a.cfg.vocabSize)->capture_default_str()->check(intRange(1));
}

std::string pathName(Gpt2& m) {
  return m.lastLinearPath();
}

void benchTrain(const ModelArgs& a, const GlobalOptions& g) {
  Engine e = makeEngine(g);
  Gpt2 m(*e.ops, a.cfg);
  m.initRandom(0);
  m.setPaths(e.paths.get());
  const int B = a.batch, T = a.cfg.blockSize;
  Rng rng(0);
  std::vector<int32_t> x(size_t(B) * T), y(x.size());
  std::vector<double> times;
  float loss = 0;
  Clock::time_point start;
  for (int s = 0; s < a.warmup + a.steps; ++s) {
    if (s == a.warmup) start = Clock::now();
    const auto t0 = Clock::now();
    for (auto& t : x) t = int32_t(rng.below(uint64_t(a.cfg.vocabSize)));
    for (auto& t : y) t = int32_t(rng.below(uint64_t(a.cfg.vocabSize)));
    m.invalidatePackedWeights();
    loss = m.forward(x.data(), y.data(), B, T);
    m.zeroGrad();
    m.backward();
    m.clipGradNorm(1.0f);
    m.adamwStep(1e-3f, 0.9f, 0.99f, 1e-8f, 0.1f);
    if (s >= a.warmup) times.push_back(since(t0));
  }
  const double secs = since(start);
  std::sort(times.begin(), times.end());
  std::printf(
      "peer=ptllm mode=train n_layer=%d n_head=%d n_embd=%d block=%d batch=%d steps=%d "
      "threads=%d path=%s params=%lld loss=%.4f secs=%.3f step_ms_median=%.2f tok_s=%.1f\n",
      a.cfg.nLayer, a.cfg.nHead, a.cfg.nEmbd, T, B, a.steps, threadCount(), pathName(m).c_str(),
      (long long)m.numParams(), loss, secs, times[times.size() / 2] * 1000,
      double(B) * T * a.steps / secs);
}

void benchSample(const ModelArgs& a, const GlobalOptions& g) {
  Engine e = makeEngine(g);
  // Random weights of the asked shape (what the PyTorch peer times), or a checkpoint (whose
  // greedy text decides how many drafts a speculative run keeps).
  LoadedModel lm;
  if (!a.model.empty()) {
    lm = loadCheckpoint(*e.ops, a.model);
  } else {
    lm.model = std::make_unique<Gpt2>(*e.ops, a.cfg);
    lm.model->initRandom(0);
  }
  Gpt2& m = *lm.model;
  const ModelConfig& cfg = m.config();
  m.setPaths(e.paths.get());
  m.setSpeculativeLanes(a.speculative);
  const Gpt2::FusedSteps form = !a.fusedStep                              ? Gpt2::FusedSteps::Off
                                : a.decodeCluster > 0 || a.decodeForm > 0 ? Gpt2::FusedSteps::On
                                                                          : Gpt2::FusedSteps::Auto;
  m.setFusedSteps(form, a.decodeCluster, a.decodeForm);
  m.setGreedyRunGraphs(a.greedyRunGraph);
  m.setPersistentGreedyRuns(a.persistentRun);
  m.prepareForInference();
  Generator gen(m);
  SampleOptions o;
  o.temperature = 0;
  std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6};  // "ROMEO:" has 6 characters
  o.tokens = std::min(5, a.tokens);
  gen.generate(prompt, o);  // warm-up, as the peer does
  o.tokens = a.tokens;
  std::vector<double> secs;
  std::vector<int32_t> text;
  int specTokens = 0, specSteps = 0, specLanesRun = 0;
  for (int r = 0; r < std::max(1, a.repeats); ++r) {
    const auto t0 = Clock::now();
    text = gen.generate(prompt, o);
    secs.push_back(since(t0));
    specTokens += gen.speculativeTokens();  // every greedy run of the generation
    specSteps += gen.speculativeSteps();
    specLanesRun = std::max(specLanesRun, gen.speculativeLanes());
  }
  // The text itself, so runs with and without speculation can be compared (FNV-1a).
  uint32_t textHash = 2166136261u;
  for (int32_t t : text) textHash = (textHash ^ uint32_t(t)) * 16777619u;
  std::sort(secs.begin(), secs.end());
  const double med = secs[secs.size() / 2];
  // The recorded step alone (replays back to back at the last position): us_token minus this
  // is the per-token host work (token upload, launch, logits download, sampling).
  const double stepUs = m.usedStepGraph() ? m.recordedStepMicros() : 0;
  std::printf(
      "peer=ptllm mode=sample device=%s n_layer=%d n_head=%d n_embd=%d block=%d threads=%d "
      "path=%s step_graph=%d step_form=%s fused_blocks=%d fused_form=%d greedy_graph=%d "
      "persistent_run=%d params=%lld tokens=%d repeats=%zu secs=%.4f secs_min=%.4f us_token=%.1f "
      "tok_s=%.2f step_us=%.1f weights=%s spec_lanes=%d spec_lanes_run=%d spec_tokens=%d "
      "spec_steps=%d spec_tokens_per_step=%.2f text_hash=%08x\n",
      e.ops->name(), cfg.nLayer, cfg.nHead, cfg.nEmbd, cfg.blockSize, threadCount(),
      pathName(m).c_str(), int(m.usedStepGraph()),
      form == Gpt2::FusedSteps::Auto ? "auto"
      : form == Gpt2::FusedSteps::On ? "fused"
                                     : "ops",
      m.usedFusedStep(), m.usedFusedForm(), int(a.greedyRunGraph), int(m.usedPersistentGreedyRun()),
      (long long)m.numParams(), a.tokens, secs.size(), med, secs.front(), med / a.tokens * 1e6,
      a.tokens / med, stepUs, a.model.empty() ? "random" : "checkpoint", a.speculative,
      specLanesRun, specTokens, specSteps, specSteps > 0 ? double(specTokens) / specSteps : 0.0,
      textHash);
}

// Median seconds of fn over `iters` calls after 3 warm-ups.
template <typename F>
double medianSeconds(F&& fn, int iters) {
  for (int i = 0; i < 3; ++i) fn();
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = Clock::now();
    fn();
    t.push_back(since(t0));
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void benchMatmul(const GlobalOptions& g, int iters) {
  Engine e = makeEngine(g);
  const PathEntry* f16 = findPath("f16-storage");
  if (!f16) fail("bench matmul: this build has no f16-storage path");
  const auto verdict = e.paths->ready("f16-storage").get();
  // A path is timed only after it passed its gate (or with --paths f32 never).
  if (!verdict.active())
    fail("bench matmul: f16-storage is not active here (gate: {})", verdict.pass ? "PASS" : "FAIL");
  struct S {
    int M, K, N;
  };
  for (S s : {S{1, 4096, 4096}, S{1, 1024, 1024}, S{64, 1024, 1024}, S{256, 1024, 1024}}) {
    Rng rng(1);
    std::vector<float> x(size_t(s.M) * s.K), b(size_t(s.N)), y(size_t(s.M) * s.N);
    for (auto& v : x) v = rng.uniform(-1, 1);
    // Decode reads its weights from DRAM: cycle over enough copies (>= 512 MiB of f32) that no
    // call finds its matrix in the last-level cache, for both paths.
    const size_t f32Bytes = size_t(s.K) * s.N * 4;
    const int copies = int(std::max<size_t>(1, (size_t(512) << 20) / f32Bytes));
    std::vector<std::vector<float>> w(static_cast<size_t>(copies));
    std::vector<std::shared_ptr<Buffer>> packed;
    for (auto& wc : w) {
      wc.resize(size_t(s.K) * s.N);
      for (auto& v : wc) v = rng.uniform(-0.2f, 0.2f);
      packed.push_back(e.ops->allocBytes(f16->packedBytes(s.K, s.N)));
      PTLLM_ASSERT(f16->prepare(packed.back()->ptr, wc.data(), s.K, s.N));
    }
    int i32 = 0, i16 = 0;
    const double tf32 = medianSeconds(
        [&] {
          e.ops->matmul(y.data(), x.data(), w[size_t(i32++ % copies)].data(), b.data(), s.M, s.K,
                        s.N);
        },
        iters);
    const double tf16 = medianSeconds(
        [&] {
          f16->dispatch(y.data(), x.data(), packed[size_t(i16++ % copies)]->ptr, b.data(), s.M, s.K,
                        s.N);
        },
        iters);
    const double flop = 2.0 * s.M * s.K * s.N, wElems = double(s.K) * s.N;
    std::printf(
        "peer=ptllm mode=matmul M=%d K=%d N=%d threads=%d copies=%d f32_us=%.1f f16_us=%.1f "
        "f16_speedup=%.2f f32_gflops=%.1f f16_gflops=%.1f f32_weight_gbs=%.1f "
        "f16_weight_gbs=%.1f\n",
        s.M, s.K, s.N, threadCount(), copies, tf32 * 1e6, tf16 * 1e6, tf32 / tf16,
        flop / tf32 / 1e9, flop / tf16 / 1e9, wElems * 4 / tf32 / 1e9, wElems * 2 / tf16 / 1e9);
  }
  // Gate cost: every gate from a fresh ops object, as at startup.
  const auto t0 = Clock::now();
  {
    Engine fresh = makeEngine(g);
    fresh.paths->results();
  }
  std::printf("peer=ptllm mode=gates threads=%d all_gates_ms=%.2f simd=%s\n", threadCount(),
              since(t0) * 1000, cpu::simdTargetName());
}

// The training step's GEMMs (the four linear layers of a block: forward, dX = dY W^T, dW = X^T
// dY with the bias gradient) at the config's token count, in GFLOP/s against the micro-kernel's
// FMA ceiling measured in the same run. "warm": the same operands back to back (they stay in
// cache); "cold": rotating over copies (>= 256 MiB a shape), as the step finds them in memory.
// bench/gemm_peer.c prints OpenBLAS's figures for the same shapes (bench/run_bench.sh).
void benchGemm(const ModelArgs& a, int iters) {
  const int T = a.batch * a.cfg.blockSize, C = a.cfg.nEmbd;
  if (T < 1 || C < 1) fail("bench gemm: --batch-size x --block-size and --n-embd must be >= 1");
  const double ceiling = cpu::fmaCeilingGflops(0.5);
  std::printf("peer=ptllm mode=fma_ceiling threads=%d gflops=%.1f simd=%s\n", threadCount(),
              ceiling, cpu::simdTargetName());
  struct Shape {
    const char* layer;
    int K, N;
  };
  double stepSecs[2] = {0, 0};
  for (Shape s : {Shape{"attn", C, 3 * C}, Shape{"proj", C, C}, Shape{"fc", C, 4 * C},
                  Shape{"fcproj", 4 * C, C}}) {
    struct Operands {
      std::vector<float> in, w, b, dy, out, dx, dw, db;
    };
    const size_t setBytes = sizeof(float) * (2 * size_t(T) * s.K + 2 * size_t(T) * s.N +
                                             2 * size_t(s.K) * s.N + 2 * size_t(s.N));
    const int copies = int(std::max<size_t>(2, (size_t(256) << 20) / setBytes + 1));
    Rng rng(7);
    std::vector<Operands> sets(static_cast<size_t>(copies));
    for (Operands& o : sets) {
      for (auto* v : {&o.in, &o.dx}) v->resize(size_t(T) * s.K);
      for (auto* v : {&o.dy, &o.out}) v->resize(size_t(T) * s.N);
      for (auto* v : {&o.w, &o.dw}) v->resize(size_t(s.K) * s.N);
      for (auto* v : {&o.b, &o.db}) v->resize(size_t(s.N));
      for (auto* v : {&o.in, &o.dy, &o.w, &o.b}) {
        for (float& x : *v) x = rng.uniform(-1, 1);
      }
    }
    const double flop = 2.0 * T * s.K * s.N;
    const auto fwd = [&](Operands& o) {
      cpu::matmul(o.out.data(), o.in.data(), o.w.data(), o.b.data(), T, s.K, s.N);
    };
    const auto abt = [&](Operands& o) {
      cpu::matmulAbt(o.dx.data(), o.dy.data(), o.w.data(), T, s.N, s.K, false);
    };
    const auto atb = [&](Operands& o) {
      cpu::matmulAtbBias(o.dw.data(), o.db.data(), o.in.data(), o.dy.data(), s.K, T, s.N, false);
    };
    const std::pair<const char*, std::function<void(Operands&)>> ops[] = {
        {"fwd", fwd}, {"abt", abt}, {"atb", atb}};
    for (const auto& [op, fn] : ops) {
      int i = 0;
      const double warm = medianSeconds([&] { fn(sets[0]); }, iters);
      const double cold = medianSeconds([&] { fn(sets[size_t(++i % copies)]); }, iters);
      stepSecs[0] += warm * a.cfg.nLayer;
      stepSecs[1] += cold * a.cfg.nLayer;
      std::printf(
          "peer=ptllm mode=gemm layer=%s op=%s M=%d K=%d N=%d threads=%d warm_ms=%.3f "
          "cold_ms=%.3f warm_gflops=%.1f cold_gflops=%.1f warm_of_ceiling=%.3f "
          "cold_of_ceiling=%.3f\n",
          s.layer, op, T, s.K, s.N, threadCount(), warm * 1e3, cold * 1e3, flop / warm / 1e9,
          flop / cold / 1e9, flop / warm / 1e9 / ceiling, flop / cold / 1e9 / ceiling);
    }
  }
  const double stepFlop = 6.0 * T * (12.0 * C * C) * a.cfg.nLayer;
  std::printf(
      "peer=ptllm mode=gemm_step n_layer=%d n_embd=%d tokens=%d threads=%d gflop=%.2f "
      "ceiling_ms=%.2f warm_ms=%.2f cold_ms=%.2f\n",
      a.cfg.nLayer, C, T, threadCount(), stepFlop / 1e9, stepFlop / ceiling / 1e6,
      stepSecs[0] * 1e3, stepSecs[1] * 1e3);
}

}  // namespace

void addBenchCommand(CLI::App& app, GlobalOptions& g) {
  auto* cmd = app.add_subcommand("bench", "measure throughput (see bench/run_bench.sh for peers)");
  cmd->require_subcommand(1);
  auto a = std::make_shared<ModelArgs>();
  auto* train = cmd->add_subcommand("train", "training tokens/s on random tokens");
  addModelOptions(train, *a);
  train->add_option("--batch-size", a->batch)->capture_default_str()->check(intRange(1));
  train->add_option("--steps", a->steps)->capture_default_str()->check(intRange(1));
  train->add_option("--warmup", a->warmup)->capture_default_str()->check(intRange(0));
  train->callback([a, &g] {
    g.apply();
    benchTrain(*a, g);
  });
  auto* sample = cmd->add_subcommand("sample", "greedy sampling tokens/s with the KV cache");
  addModelOptions(sample, *a);
  sample->add_option("--tokens", a->tokens)->capture_default_str()->check(intRange(1));
  sample->add_option("--repeats", a->repeats, "timed generations; the median is reported")
      ->capture_default_str()
      ->check(intRange(1));
  sample->add_flag("!--no-fused-step", a->fusedStep,
                   "record the op kernels per decode step (default: the faster of them and "
                   "the fused launch, timed on the first step)");
  sample->add_flag("!--no-greedy-run-graph", a->greedyRunGraph,
                   "replay the decode step and queue the pick per token (default: one graph "
                   "per 32 greedy steps)");
  sample->add_flag("!--no-persistent-run", a->persistentRun,
                   "a greedy run graph replays one fused launch per step (default: one launch "
                   "runs the whole run's steps where the fused form can)");
  addSpeculativeOption(sample, a->speculative,
                       "greedy runs check drafted tokens with this many decode steps side by "
                       "side (0: off); the text is the same");
  sample->add_option("--model", a->model,
                     "time this checkpoint's greedy text (default: random weights of the "
                     "--n-* shape)");
  sample
      ->add_option("--decode-cluster", a->decodeCluster,
                   "always the fused decode launch, of this many blocks (0: the faster form, "
                   "the backend's launch size)")
      ->capture_default_str()
      ->check(intRange(0, 16));
  sample
      ->add_option("--decode-form", a->decodeForm,
                   "always the fused decode launch, in this form (1-4; 0: the fastest form, "
                   "timed on the first step)")
      ->capture_default_str()
      ->check(intRange(0, 8));
  sample->callback([a, &g] {
    g.apply();
    benchSample(*a, g);
  });
  auto iters = std::make_shared<int>(50);
  auto* mm = cmd->add_subcommand("matmul", "f16-storage vs f32 matmul, GB/s of weight reads");
  mm->add_option("--iters", *iters)->capture_default_str()->check(intRange(1));
  mm->callback([iters, &g] {
    g.apply();
    benchMatmul(g, *iters);
  });
  auto* gemm = cmd->add_subcommand(
      "gemm", "the training step's GEMMs, GFLOP/s warm and cold against the FMA ceiling");
  addModelOptions(gemm, *a);
  gemm->add_option("--batch-size", a->batch)->capture_default_str()->check(intRange(1));
  gemm->add_option("--iters", *iters)->capture_default_str()->check(intRange(1));
  gemm->callback([a, iters, &g] {
    g.apply();
    benchGemm(*a, *iters);
  });
  addCudaBenchSubcommand(cmd, g);
}

}  // namespace ptllm::app
