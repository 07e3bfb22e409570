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
  f16.gateShapes = {{64, 128, 128}};  // the spec's shape
  f16.thresholds = GateThresholds{};  // the spec's: 1% / 0.5% / floor 1%
  paths.push_back(std::move(f16));

  return paths;
}

const std::vector<PathEntry>& registeredPaths() {
  static const std::vector<PathEntry> all = [] {
    std::vector<PathEntry> v = cpuPaths();
    for (auto& e : cudaPaths()) v.push_back(std::move(e));
    return v;
  }();
  return all;
}

const PathEntry* findPath(const std::string& name) {
  for (const auto& e : registeredPaths())
    if (e.name == name) return &e;
  return nullptr;
}

}  // namespace ptllm
