// Gate a matmul kernel of your own against posttrainllm's canonical f32 matmul, with the spec's
// magnitude-aware metric (max_abs < 1% of mean|ref|, mean_rel < 0.5%).
//
// Two ways, both shown:
//   1. compareOutputs(): you run both kernels yourself, the metric judges the outputs.
//   2. runGate(): describe your kernel as a PathEntry; the gate makes the seeded inputs, runs
//      the f32 reference through an Ops backend, runs your kernel and prints the console line.
#include <cmath>
#include <cstdio>
#include <vector>

#include "gate/gate.h"
#include "gate/metric.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

namespace {

// A good kernel: the same maths with a different loop order (k outer), f32 accumulation.
void goodMatmul(float* out, const float* in, const void* w, const float* bias, int M, int K,
                int N) {
  const float* W = static_cast<const float*>(w);
  for (int m = 0; m < M; ++m) {
    float* o = out + size_t(m) * N;
    for (int n = 0; n < N; ++n) o[n] = bias ? bias[n] : 0.0f;
    for (int k = 0; k < K; ++k)
      for (int n = 0; n < N; ++n) o[n] += in[size_t(m) * K + k] * W[size_t(k) * N + n];
  }
}

// A bad kernel: weights rounded to 6 significant bits on the fly (coarser than
// bf16), which costs far more than the gate allows.
void badMatmul(float* out, const float* in, const void* w, const float* bias, int M, int K, int N) {
  const float* W = static_cast<const float*>(w);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      float s = bias ? bias[n] : 0.0f;
      for (int k = 0; k < K; ++k) {
        int e;
        const float frac = std::frexp(W[size_t(k) * N + n], &e);
        s += in[size_t(m) * K + k] * std::ldexp(std::round(frac * 64) / 64, e);
      }
      out[size_t(m) * N + n] = s;
    }
}

ptllm::PathEntry entryFor(const char* name, ptllm::MatmulFn fn) {
  ptllm::PathEntry e;
  e.name = name;
  e.activeText = "my kernel active";
  e.dispatch = fn;                                 // no prepare: it takes the f32 weight as is
  e.gateShapes = {{64, 128, 128}, {33, 257, 65}};  // the spec's shape + an odd one
  return e;
}

}  // namespace

int main() {
  auto ops = ptllm::makeCpuOps();  // the canonical f32 reference comes from here

  // 1. The metric alone, on outputs you computed yourself.
  std::vector<float> ref{0.11f, -0.25f, 0.07f, 0.31f}, mine{0.1101f, -0.2499f, 0.07f, 0.3101f};
  ptllm::GateMetric m = ptllm::compareOutputs(ref.data(), mine.data(), ref.size());
  std::printf("compareOutputs: max_abs=%.2e (limit %.2e) mean_rel=%.3f%% -> %s\n", m.maxAbs,
              m.maxAbsLimit, m.meanRel * 100, m.pass ? "PASS" : "FAIL");

  // 2. The whole gate, one line per kernel, exactly as ptllm prints its own paths.
  int failures = 0;
  for (const auto& e : {entryFor("good-kernel", goodMatmul), entryFor("bad-kernel", badMatmul)}) {
    ptllm::GateResult r = ptllm::runGate(*ops, e);
    std::printf("%s\n", ptllm::consoleLine(r).c_str());
    failures += r.pass ? 0 : 1;
  }
  // Expected: the good kernel passes, the bad one fails.
  return failures == 1 ? 0 : 1;
}
