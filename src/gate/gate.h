// The gate (the spec's verifyF16Storage): the same inputs through a path and through the
// canonical f32 Ops::matmul, compared with the magnitude-aware metric, a PASS/FAIL verdict and
// the spec's console line.
//
// What a path's gate runs (all of it must hold for PASS):
//
// 1. Gate shapes (PathEntry::gateShapes). The spec's 64x128x128 first — its numbers are the
//    summary line's — then the shapes the production workload has (the spec's "Future work":
//    inference K=256, training K=1024, head K=vocab). Inputs: seeded uniform [-0.2, 0.2).
//    Every shape must pass the spec's thresholds; a refused prepare on a gate shape is a FAIL
//    (a path that cannot hold typical weights is useless).
//
// 2. Range-stress probes (PathEntry::gateProbes), judged with the same metric:
//      outliers    in[M,K] uniform in +-700 with 1 value in 64 scaled 100x (up to 7e4, past
//                  f16's 65504), w uniform +-0.2. Catches a path that rounds activations to
//                  f16 (Inf) or whose error is not relative to the outlier-dominated output.
//      f16-limit   w uniform +-6e4 (inside f16: packing is exact to 2^-11), in uniform +-1.
//                  Sums reach ~1e6: fine in f32, Inf in f16. Catches f16 accumulation or f16
//                  products.
//      beyond-f16  typical values but 1 weight in 64 is +-1e5, past the f16 range. A storage
//                  path's prepare must refuse this matrix; "not eligible, stays on f32" is then
//                  the right answer (the model decides per matrix), and the probe does not fail
//                  the path. A path that accepts it must produce the right numbers: a silent
//                  saturation or an Inf is a FAIL.
//      large-k     K=4096 of typical values: accumulation-length bugs between the shapes.
//    Magnitudes are chosen so the f32 reference itself stays finite (|ref| < ~1e7). Only an
//    eligible probe's numbers count; a refused prepare is "not eligible" for probes only.
//
// The poisoning rule holds everywhere: the path's output is pre-filled with NaN, so an element
// it forgets to write fails the comparison.
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
// Probe j draws from Rng(kGateSeed + 1000 + j). No bias: both sides add a bias in f32 after
// the dot product, and leaving it out keeps mean|ref| the spec's (~1.2e-1 at 64x128x128).
// Fixed, so a verdict is reproducible.
inline constexpr uint64_t kGateSeed = 0x9a7e5eed2026ull;

struct ProbeResult {
  GateProbe probe;
  bool eligible = true;  // false: prepare refused the probe's weights (stays on f32; not a FAIL)
  GateMetric metric;     // meaningful when eligible
  bool ok() const { return !eligible || metric.pass; }
};

struct GateResult {
  std::string path;               // entry name, e.g. "f16-storage"
  std::string activeText;         // entry's activeText, e.g. "f16 path active"
  bool supported = false;         // device matches and every required capability is present
  std::string unsupportedReason;  // e.g. "missing f16c" (set when !supported)
  bool selected = false;          // --paths allows it
  bool ran = false;               // the gate ran (supported && selected), or its cached verdict
  bool pass = false;              // every gate shape and every eligible probe passed
  bool cached = false;            // the verdict and numbers came from the gate cache
  GateMetric metric;              // the spec shape's (the first); see shapes for all of them
  std::vector<std::pair<GateShape, GateMetric>> shapes;  // compared shapes / data cases
  std::vector<ProbeResult> probes;
  std::vector<GateShape> ineligible;  // runGateOnData: cases whose prepare refused (stay f32)
  double millis = 0;                  // wall time of the gate (of the cache lookup when cached)
  bool active() const { return supported && selected && ran && pass; }
};

// Runs the gate of `e` on `ops` (which must be the entry's device): every gate shape, then
// every probe. Fills path, activeText, ran, pass, metric, shapes, probes, millis;
// supported/selected are set true (the caller decides whether to run). Never throws for a
// misbehaving path: a throw, a refused prepare on a gate shape or a non-finite output is a
// FAIL with metric.reason set. Allocates through ops, so the same code serves a device backend.
GateResult runGate(Ops& ops, const PathEntry& e, uint64_t seed = kGateSeed);

// A workload case for runGateOnData: real activations and weights (host memory, row-major,
// not copied: they must stay valid during the call).
struct GateCase {
  std::string label;  // e.g. "h0.attn.qkv"; shown in the console lines
  int M = 0, K = 0, N = 0;
  const float* input = nullptr;   // [M,K]
  const float* weight = nullptr;  // [K,N]
  const float* bias = nullptr;    // [N] or null (added on both sides)
};

// The gate on caller-supplied data (the model's workload gate): each case through the path and
// the f32 reference, the same metric, the same NaN poisoning, the same lines. A case whose
// prepare refuses its weights is recorded in `ineligible` (that matrix stays on f32) and does
// not fail the path; every other case must pass. No eligible case at all is a FAIL ("no
// eligible case"): there is nothing the path could be trusted with. metric = the first
// compared case's.
GateResult runGateOnData(Ops& ops, const PathEntry& e, const std::vector<GateCase>& cases);

// The summary line. With a single shape and no probes, exactly the spec's line (numbers to 3
// significant digits; percentages as in the spec):
//   [ops] f16-storage gate: mean|ref|=1.22e-01, max_abs=1.33e-04 (limit 1.22e-03),
//   mean_rel=0.075% (limit 0.500%), max_rel=5.40% — PASS — f16 path active
// With several shapes or probes the verdict carries the counts, the numbers stay the spec
// shape's: "— PASS (4/4 shapes, 4/4 probes, 1 not eligible) — f16 path active". On failure
// "— FAIL (<why>; 3/4 shapes, 4/4 probes) — falling back to f32" where why is the spec shape's
// reason or the first failing shape/probe. " (cached)" ends the line of a cached verdict.
// Not run: "[ops] NAME: not supported on this machine (missing f16c) — using f32" or
// "[ops] NAME: not selected (--paths) — using f32".
std::string consoleLine(const GateResult& r);

// Every line of a result, in order: one per shape ("[ops] NAME gate 64x128x128: mean|ref|=...
// — PASS"), one per probe ("[ops] NAME probe outliers 8x256x64: ... — PASS", or "...: not
// eligible (prepare refused) — stays on f32"), one per ineligible case, then consoleLine(r).
// A single-shape, probe-less result has only the summary line.
std::vector<std::string> consoleLines(const GateResult& r);

// "64x128x128", or the label when the shape has one ("h0.qkv 1x768x2304").
std::string shapeText(const GateShape& s);

nlohmann::json toJson(const GateResult& r);
// The inverse of toJson (the gate cache); throws (nlohmann::json::exception or
// std::runtime_error) on a malformed object.
GateResult gateResultFromJson(const nlohmann::json& j);

}  // namespace ptllm
