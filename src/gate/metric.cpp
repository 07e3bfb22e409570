#include "gate/metric.h"

#include <fmt/format.h>

#include <cmath>

namespace ptllm {
namespace {

// "" when all of x[0..n) is finite, else "NaN in <which> output at index i" (or +Inf / -Inf).
std::string firstNonFinite(const float* x, size_t n, const char* which) {
  for (size_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return fmt::format("NaN in {} output at index {}", which, i);
    if (std::isinf(x[i]))
      return fmt::format("{}Inf in {} output at index {}", x[i] > 0 ? "+" : "-", which, i);
  }
  return {};
}

}  // namespace

GateMetric compareOutputs(const float* ref, const float* fast, size_t n, const GateThresholds& t) {
  GateMetric m;
  m.meanRelLimit = t.meanRel;
  if (n == 0 || !ref || !fast) {
    m.reason = "empty output (n == 0)";
    return m;
  }
  m.reason = firstNonFinite(ref, n, "reference");
  if (m.reason.empty()) m.reason = firstNonFinite(fast, n, "fast");

  // Over the pairs where both values are finite (all of them unless reason is set).
  double sumAbsRef = 0;
  size_t finite = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(ref[i]) || !std::isfinite(fast[i])) continue;
    sumAbsRef += std::fabs(double(ref[i]));
    ++finite;
  }
  m.meanAbsRef = finite ? sumAbsRef / double(finite) : 0.0;
  m.maxAbsLimit = t.maxAbsOfMeanRef * m.meanAbsRef;
  const double floor = t.relFloorOfMeanRef * m.meanAbsRef;

  double sumRel = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(ref[i]) || !std::isfinite(fast[i])) continue;
    const double r = ref[i];
    const double err = std::fabs(double(fast[i]) - r);
    if (err > m.maxAbs) m.maxAbs = err;
    const double denom = std::fmax(std::fabs(r), floor);
    if (denom > 0) {  // 0 only when mean|ref| == 0, which fails below
      const double rel = err / denom;
      sumRel += rel;
      if (rel > m.maxRel) m.maxRel = rel;
    }
  }
  m.meanRel = finite ? sumRel / double(finite) : 0.0;

  if (m.reason.empty() && !(m.meanAbsRef > 0)) m.reason = "mean|ref| is 0";
  m.pass = m.reason.empty() && m.maxAbs < m.maxAbsLimit && m.meanRel < m.meanRelLimit;
  return m;
}

nlohmann::json toJson(const GateMetric& m) {
  nlohmann::json j;
  j["mean_abs_ref"] = m.meanAbsRef;
  j["max_abs"] = m.maxAbs;
  j["max_abs_limit"] = m.maxAbsLimit;
  j["mean_rel"] = m.meanRel;
  j["mean_rel_limit"] = m.meanRelLimit;
  j["max_rel"] = m.maxRel;
  j["pass"] = m.pass;
  if (!m.reason.empty()) j["reason"] = m.reason;
  return j;
}

GateMetric metricFromJson(const nlohmann::json& j) {
  GateMetric m;
  m.meanAbsRef = j.at("mean_abs_ref").get<double>();
  m.maxAbs = j.at("max_abs").get<double>();
  m.maxAbsLimit = j.at("max_abs_limit").get<double>();
  m.meanRel = j.at("mean_rel").get<double>();
  m.meanRelLimit = j.at("mean_rel_limit").get<double>();
  m.maxRel = j.at("max_rel").get<double>();
  m.pass = j.at("pass").get<bool>();
  if (j.contains("reason")) m.reason = j.at("reason").get<std::string>();
  return m;
}

}  // namespace ptllm
