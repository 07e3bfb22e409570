// The spec's magnitude-aware metric (gate/metric.h) on hand-computed cases, and the exact
// console line (gate/gate.h).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "gate/gate.h"
#include "gate/metric.h"

namespace ptllm {
namespace {

GateMetric cmp(const std::vector<float>& ref, const std::vector<float>& fast,
               const GateThresholds& t = {}) {
  EXPECT_EQ(ref.size(), fast.size());
  return compareOutputs(ref.data(), fast.data(), ref.size(), t);
}

void expectAllFinite(const GateMetric& m) {
  EXPECT_TRUE(std::isfinite(m.meanAbsRef));
  EXPECT_TRUE(std::isfinite(m.maxAbs));
  EXPECT_TRUE(std::isfinite(m.maxAbsLimit));
  EXPECT_TRUE(std::isfinite(m.meanRel));
  EXPECT_TRUE(std::isfinite(m.maxRel));
}

TEST(Metric, DefaultThresholdsAreTheSpecs) {
  GateThresholds t;
  EXPECT_EQ(t.maxAbsOfMeanRef, 0.01);
  EXPECT_EQ(t.meanRel, 0.005);
  EXPECT_EQ(t.relFloorOfMeanRef, 0.01);
}

TEST(Metric, ExactEqualityPassesWithZeroErrors) {
  // Zeros in the reference are fine: their denominator is the floor, their error 0.
  const std::vector<float> ref{0.0f, 0.25f, 0.0f, -0.25f};
  GateMetric m = cmp(ref, ref);
  EXPECT_TRUE(m.pass);
  EXPECT_TRUE(m.reason.empty());
  EXPECT_DOUBLE_EQ(m.meanAbsRef, 0.125);
  EXPECT_DOUBLE_EQ(m.maxAbsLimit, 0.01 * 0.125);
  EXPECT_EQ(m.maxAbs, 0.0);
  EXPECT_EQ(m.meanRel, 0.0);
  EXPECT_EQ(m.maxRel, 0.0);
  EXPECT_EQ(m.meanRelLimit, 0.005);
}

TEST(Metric, SingleBlowUpFailsMaxAbsOnly) {
  // 100 elements of 0.25: mean|ref| 0.25, max_abs limit 2.5e-3. One element off by 0.005:
  // max_abs 0.005 >= limit (FAIL) while mean_rel = (0.005/0.25)/100 = 2e-4 < 0.5%.
  std::vector<float> ref(100, 0.25f), fast = ref;
  fast[42] = 0.255f;
  GateMetric m = cmp(ref, fast);
  const double err = double(0.255f) - 0.25;
  EXPECT_FALSE(m.pass);
  EXPECT_TRUE(m.reason.empty());  // a threshold miss: the numbers say why
  EXPECT_DOUBLE_EQ(m.maxAbs, err);
  EXPECT_GE(m.maxAbs, m.maxAbsLimit);
  EXPECT_NEAR(m.meanRel, err / 0.25 / 100, 1e-12);
  EXPECT_LT(m.meanRel, m.meanRelLimit);
  EXPECT_NEAR(m.maxRel, err / 0.25, 1e-12);
}

TEST(Metric, SystematicOnePercentBiasFailsMeanRel) {
  std::vector<float> ref(64), fast(64);
  for (int i = 0; i < 64; ++i) {
    ref[size_t(i)] = (i % 2 ? -0.1f : 0.1f);
    fast[size_t(i)] = ref[size_t(i)] * 1.01f;
  }
  GateMetric m = cmp(ref, fast);
  EXPECT_FALSE(m.pass);
  EXPECT_NEAR(m.meanRel, 0.01, 1e-6);  // 1%
  EXPECT_GE(m.meanRel, m.meanRelLimit);
}

TEST(Metric, BiasBelowMaxAbsButAboveMeanRelFailsOnMeanRelAlone) {
  // A uniform 0.6% bias on constant 0.1: max_abs 6e-4 < limit 1e-3, mean_rel 0.6% >= 0.5%.
  std::vector<float> ref(50, 0.1f), fast(50, 0.1f * 1.006f);
  GateMetric m = cmp(ref, fast);
  EXPECT_LT(m.maxAbs, m.maxAbsLimit);
  EXPECT_NEAR(m.meanRel, 0.006, 1e-6);
  EXPECT_FALSE(m.pass);
}

TEST(Metric, NearZeroReferenceIsFlooredAndPasses) {
  // The spec's case: a reference element of 1e-6 with an error of 1e-4. Naively that is
  // 10000% relative; against the floor (1% of mean|ref| ~ 1e-3) it is ~10%, and the mean over
  // 100 elements stays far below 0.5%.
  std::vector<float> ref(100, 0.1f), fast;
  ref[7] = 1e-6f;
  fast = ref;
  fast[7] = 1e-6f + 1e-4f;
  GateMetric m = cmp(ref, fast);
  const double err = double(fast[7]) - double(ref[7]);
  const double mean = (99 * double(0.1f) + double(1e-6f)) / 100;
  EXPECT_NEAR(err / double(ref[7]), 100.0, 1e-3);  // the naive 10000%
  EXPECT_NEAR(m.meanAbsRef, mean, 1e-15);
  EXPECT_NEAR(m.maxRel, err / (0.01 * mean), 1e-9);  // ~10%: floored
  EXPECT_GT(m.maxRel, 0.1);
  EXPECT_NEAR(m.meanRel, m.maxRel / 100, 1e-12);
  EXPECT_TRUE(m.pass) << m.maxAbs << " " << m.meanRel;
}

TEST(Metric, NaNInReferenceFails) {
  std::vector<float> ref(8, 0.1f), fast(8, 0.1f);
  ref[3] = std::numeric_limits<float>::quiet_NaN();
  GateMetric m = cmp(ref, fast);
  EXPECT_FALSE(m.pass);
  EXPECT_EQ(m.reason, "NaN in reference output at index 3");
  expectAllFinite(m);
}

TEST(Metric, NaNInFastFails) {
  std::vector<float> ref(32, 0.1f), fast(32, 0.1f);
  fast[17] = std::numeric_limits<float>::quiet_NaN();
  GateMetric m = cmp(ref, fast);
  EXPECT_FALSE(m.pass);
  EXPECT_EQ(m.reason, "NaN in fast output at index 17");
  expectAllFinite(m);
  EXPECT_NEAR(m.meanAbsRef, double(0.1f), 1e-12);  // over the finite pairs, for diagnosis
}

TEST(Metric, InfFails) {
  std::vector<float> ref(4, 0.1f), fast(4, 0.1f);
  fast[2] = std::numeric_limits<float>::infinity();
  GateMetric m = cmp(ref, fast);
  EXPECT_FALSE(m.pass);
  EXPECT_EQ(m.reason, "+Inf in fast output at index 2");
  expectAllFinite(m);

  std::vector<float> ref2(4, 0.1f);
  ref2[0] = -std::numeric_limits<float>::infinity();
  m = cmp(ref2, std::vector<float>(4, 0.1f));
  EXPECT_FALSE(m.pass);
  EXPECT_EQ(m.reason, "-Inf in reference output at index 0");
}

TEST(Metric, NonFiniteInBothReportsTheReferenceFirst) {
  std::vector<float> ref(4, 0.1f), fast(4, 0.1f);
  ref[2] = fast[1] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(cmp(ref, fast).reason, "NaN in reference output at index 2");
}

TEST(Metric, AllZeroReferenceFailsWithoutDividingByZero) {
  std::vector<float> ref(16, 0.0f);
  GateMetric same = cmp(ref, ref);
  EXPECT_FALSE(same.pass);
  EXPECT_EQ(same.reason, "mean|ref| is 0");
  expectAllFinite(same);

  std::vector<float> fast(16, 0.0f);
  fast[5] = 1e-3f;
  GateMetric m = cmp(ref, fast);
  EXPECT_FALSE(m.pass);
  EXPECT_EQ(m.reason, "mean|ref| is 0");
  expectAllFinite(m);
  EXPECT_DOUBLE_EQ(m.maxAbs, double(1e-3f));
}

TEST(Metric, EmptyOutputFails) {
  GateMetric m = compareOutputs(nullptr, nullptr, 0);
  EXPECT_FALSE(m.pass);
  EXPECT_FALSE(m.reason.empty());
  float x = 1.0f;
  m = compareOutputs(&x, &x, 0);
  EXPECT_FALSE(m.pass);
  EXPECT_FALSE(m.reason.empty());
  expectAllFinite(m);
}

TEST(Metric, MaxAbsBoundaryIsStrict) {
  // Thresholds chosen so every number is exact in binary: mean|ref| = 1, max_abs limit 0.25.
  GateThresholds t;
  t.maxAbsOfMeanRef = 0.25;
  t.meanRel = 0.5;
  t.relFloorOfMeanRef = 0.25;
  std::vector<float> ref(4, 1.0f), fast(4, 1.0f);
  fast[0] = 1.25f;  // max_abs == limit exactly
  GateMetric m = cmp(ref, fast, t);
  EXPECT_EQ(m.maxAbs, 0.25);
  EXPECT_EQ(m.maxAbsLimit, 0.25);
  EXPECT_FALSE(m.pass);
  fast[0] = std::nextafter(1.25f, 0.0f);  // just under
  EXPECT_TRUE(cmp(ref, fast, t).pass);
}

TEST(Metric, MeanRelBoundaryIsStrict) {
  GateThresholds t;
  t.maxAbsOfMeanRef = 1.0;
  t.meanRel = 0.25;
  t.relFloorOfMeanRef = 0.25;
  std::vector<float> ref(4, 1.0f), fast(4, 1.25f);  // rel 0.25 everywhere == limit
  GateMetric m = cmp(ref, fast, t);
  EXPECT_EQ(m.meanRel, 0.25);
  EXPECT_EQ(m.meanRelLimit, 0.25);
  EXPECT_LT(m.maxAbs, m.maxAbsLimit);
  EXPECT_FALSE(m.pass);
  fast[3] = 1.125f;  // mean_rel 0.21875
  EXPECT_TRUE(cmp(ref, fast, t).pass);
}

GateResult specResult() {
  GateResult r;
  r.path = "f16-storage";
  r.activeText = "f16 path active";
  r.supported = r.selected = r.ran = r.pass = true;
  r.metric.meanAbsRef = 0.122;
  r.metric.maxAbs = 1.33e-4;
  r.metric.maxAbsLimit = 1.22e-3;
  r.metric.meanRel = 0.00075;
  r.metric.meanRelLimit = 0.005;
  r.metric.maxRel = 0.054;
  r.metric.pass = true;
  r.shapes.push_back({GateShape{64, 128, 128}, r.metric});
  return r;
}

TEST(ConsoleLine, PassIsTheSpecsLine) {
  EXPECT_EQ(consoleLine(specResult()),
            "[ops] f16-storage gate: mean|ref|=1.22e-01, max_abs=1.33e-04 (limit 1.22e-03), "
            "mean_rel=0.075% (limit 0.500%), max_rel=5.40% — PASS — f16 path active");
  EXPECT_TRUE(specResult().active());
}

TEST(ConsoleLine, FailFallsBackToF32) {
  GateResult r = specResult();
  r.pass = r.metric.pass = false;
  r.metric.maxAbs = 2.5e-3;
  r.metric.meanRel = 0.01234;
  r.metric.maxRel = 1.5;
  EXPECT_EQ(consoleLine(r),
            "[ops] f16-storage gate: mean|ref|=1.22e-01, max_abs=2.50e-03 (limit 1.22e-03), "
            "mean_rel=1.234% (limit 0.500%), max_rel=150% — FAIL — falling back to f32");
  EXPECT_FALSE(r.active());
}

TEST(ConsoleLine, InvalidComparisonAppendsTheReason) {
  GateResult r = specResult();
  r.pass = r.metric.pass = false;
  r.metric.reason = "NaN in fast output at index 3";
  EXPECT_EQ(consoleLine(r),
            "[ops] f16-storage gate: mean|ref|=1.22e-01, max_abs=1.33e-04 (limit 1.22e-03), "
            "mean_rel=0.075% (limit 0.500%), max_rel=5.40% — FAIL (NaN in fast output at "
            "index 3) — falling back to f32");
}

TEST(ConsoleLine, NotSupportedAndNotSelected) {
  GateResult r;
  r.path = "f16-storage";
  r.unsupportedReason = "missing f16c";
  EXPECT_EQ(consoleLine(r),
            "[ops] f16-storage: not supported on this machine (missing f16c) — using f32");
  r.supported = true;
  EXPECT_EQ(consoleLine(r), "[ops] f16-storage: not selected (--paths) — using f32");
  EXPECT_FALSE(r.active());
}

TEST(ConsoleLine, JsonCarriesTheVerdictAndTheLine) {
  nlohmann::json j = toJson(specResult());
  EXPECT_EQ(j["verdict"], "PASS");
  EXPECT_EQ(j["active"], true);
  EXPECT_DOUBLE_EQ(j["metric"]["mean_abs_ref"].get<double>(), 0.122);
  EXPECT_EQ(j["console"], consoleLine(specResult()));
}

}  // namespace
}  // namespace ptllm
