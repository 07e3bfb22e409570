// The gate (the spec's verifyF16Storage): the same seeded inputs through a path and through the
// canonical f32 Ops::matmul, compared with the magnitude-aware metric, a PASS/FAIL verdict and
// the spec's console line.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "gate/metric.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

namespace ptllm {

// Seed of the gate's inputs. Shape i of an entry draws from Rng(kGateSeed + i): first in[M,K],
// then w[K,N], each uniform in [-0.2, 0.2) (the spec's "typical weight initialisation scale").
// No bias: both sides add a bias in f32 after the dot product, and leaving it out keeps
// mean|ref| the spec's (~1.2e-1 at 64x128x128). Fixed, so a verdict is reproducible.
inline constexpr uint64_t kGateSeed = 0x9a7e5eed2026ull;

struct GateResult {
  std::string path;               // entry name, e.g. "f16-storage"
  std::string activeText;         // entry's activeText, e.g. "f16 path active"
  bool supported = false;         // device matches and every required capability is present
  std::string unsupportedReason;  // e.g. "missing f16c" (set when !supported)
  bool selected = false;          // --paths allows it
  bool ran = false;               // the gate ran (supported && selected)
  bool pass = false;              // every gate shape passed
  GateMetric metric;              // the spec shape's (the first); see shapes for all of them
  std::vector<std::pair<GateShape, GateMetric>> shapes;
  double millis = 0;  // wall time of the gate
  bool active() const { return supported && selected && ran && pass; }
};

// Runs the gate of `e` on `ops` (which must be the entry's device). Fills path, activeText,
// ran, pass, metric, shapes, millis; supported/selected are set true (the caller decides
// whether to run). Never throws for a misbehaving path: a throw, a refused prepare or a
// non-finite output is a FAIL with metric.reason set. Allocates through ops, so the same code
// serves a device backend.
GateResult runGate(Ops& ops, const PathEntry& e, uint64_t seed = kGateSeed);

// The spec's line, numbers to 3 significant digits (percentages as in the spec: mean_rel and
// its limit with 3 decimals, max_rel with 3 significant digits):
//   [ops] f16-storage gate: mean|ref|=1.22e-01, max_abs=1.33e-04 (limit 1.22e-03),
//   mean_rel=0.075% (limit 0.500%), max_rel=5.40% — PASS — f16 path active
// (one line). On failure "— FAIL — falling back to f32", with "FAIL (<reason>)" when the
// comparison was invalid. Not run: "[ops] NAME: not supported on this machine (missing f16c) —
// using f32" or "[ops] NAME: not selected (--paths) — using f32".
std::string consoleLine(const GateResult& r);

nlohmann::json toJson(const GateResult& r);

}  // namespace ptllm
