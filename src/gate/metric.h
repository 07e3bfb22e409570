// The spec's magnitude-aware comparison of a fast path's output with the canonical f32
// reference (docs: shared/spec/precision-gate.md, "The gate — design and thresholds").
// Public API: usable on its own to gate any kernel against any reference.
//
//   mean|ref| = mean over i of |ref[i]|
//   max_abs   = max |fast[i] - ref[i]|                      PASS needs max_abs  < 1% of mean|ref|
//   rel[i]    = |fast[i] - ref[i]| / max(|ref[i]|, 1% of mean|ref|)
//   mean_rel  = mean of rel[i]                              PASS needs mean_rel < 0.5%
//   max_rel   = max of rel[i]                               reported, never gating
//
// Sums in double. Both inequalities are strict. A NaN or Inf in either output, n == 0 or
// mean|ref| == 0 is a FAIL with `reason` set; nothing is divided by zero.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>

#include "kernels/registry.h"

namespace ptllm {

struct GateMetric {
  double meanAbsRef = 0;    // mean|ref|
  double maxAbs = 0;        // max_abs
  double maxAbsLimit = 0;   // thresholds.maxAbsOfMeanRef * mean|ref|
  double meanRel = 0;       // mean_rel, a fraction (0.00075 = 0.075%)
  double meanRelLimit = 0;  // thresholds.meanRel
  double maxRel = 0;        // max_rel, a fraction; informational
  bool pass = false;
  // Empty when the numbers were computed and judged; otherwise why they could not be (non-finite
  // output, empty output, zero reference, a gate that could not run the path). A threshold
  // miss leaves it empty: the numbers say why.
  std::string reason;
};

// Compares fast[0..n) with ref[0..n). When a non-finite value makes the comparison invalid
// the numbers are still filled in over the finite pairs, for diagnosis.
GateMetric compareOutputs(const float* ref, const float* fast, size_t n,
                          const GateThresholds& t = {});

nlohmann::json toJson(const GateMetric& m);
// The inverse of toJson (the gate cache); throws nlohmann::json::exception on a malformed object.
GateMetric metricFromJson(const nlohmann::json& j);

}  // namespace ptllm
