// The one table of gated paths. To add a path: append an entry here (or to the backend's
// table), give it a kernel next to its reference and a test; see docs/extending.md.
#include "kernels/registry.h"

#include "kernels/cpu/cpu_kernels.h"

namespace ptllm {

std::vector<PathEntry> cpuPaths() {
  std::vector<PathEntry> paths;

  // f16-storage: weights packed once to IEEE binary16 (halves the weight bytes a
  // bandwidth-bound matmul reads); products and sums stay f32. Highway's F16 promote needs
  // F16C on x86.
  PathEntry f16;
  f16.name = "f16-storage";
  f16.pill = "+f16 storage";
  f16.statusClause = "f16-storage matmul";
  f16.activeText = "f16 path active";
  f16.device = Device::CPU;
  f16.requiredCaps = {"f16c"};
  f16.dispatch = cpu::matmulF16;
  f16.prepare = cpu::packF16;
  f16.packedBytes = cpu::f16PackedBytes;
  // The spec's shape first (its numbers are the summary line's), then the spec's "Future
  // work" shapes: inference-typical K=256 (one decode row against a 768-wide projection),
  // training-typical K=1024 (a batch of rows through an MLP fc_out-like K), and head-output
  // K=vocab (GPT-2's 50257: the longest dot product the model has). The head shape keeps M and
  // N small (2 x 8; N=8 also exercises a column tail narrower than a SIMD vector): the question is
  // the accumulation length, and the gate must stay cheap.
  f16.gateShapes = {{64, 128, 128}, {1, 256, 768}, {64, 1024, 256}, {2, 50257, 8}};
  f16.gateProbes = standardGateProbes();
  f16.thresholds = GateThresholds{};  // the spec's: 1% / 0.5% / floor 1%
  paths.push_back(std::move(f16));

  return paths;
}

std::vector<GateProbe> standardGateProbes() {
  return {
      {"outliers", ProbeKind::Outliers, {8, 256, 64}},
      {"f16-limit", ProbeKind::F16Limit, {8, 128, 64}},
      {"beyond-f16", ProbeKind::BeyondF16, {8, 128, 64}},
      {"large-k", ProbeKind::LargeK, {2, 4096, 64}},
  };
}

const std::vector<PathEntry>& registeredPaths() {
  static const std::vector<PathEntry> all = [] {
    std::vector<PathEntry> v = cpuPaths();
    for (auto& e : cudaPaths()) v.push_back(std::move(e));
    return v;
  }();
  return all;
}

std::vector<PathEntry> pathsFor(Device device) {
  std::vector<PathEntry> out;
  for (const auto& e : registeredPaths())
    if (e.device == device) out.push_back(e);
  return out;
}

const PathEntry* findPath(const std::string& name) {
  for (const auto& e : registeredPaths())
    if (e.name == name) return &e;
  return nullptr;
}

}  // namespace ptllm
