#include "gate/gate.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <exception>
#include <limits>

#include "core/rng.h"

namespace ptllm {
namespace {

// max_rel as a percentage with 3 significant digits ("5.40", "54.0", "540").
std::string pct3(double fraction) {
  const double p = fraction * 100.0;
  if (!std::isfinite(p)) return fmt::format("{}", p);
  if (p >= 99.95) return fmt::format("{:.0f}", p);
  if (p >= 9.995) return fmt::format("{:.1f}", p);
  return fmt::format("{:.2f}", p);
}

std::string shapeText(const GateShape& s) {
  return fmt::format("{}x{}x{}", s.M, s.K, s.N);
}

GateMetric gateShape(Ops& ops, const PathEntry& e, const GateShape& s, uint64_t seed) {
  GateMetric fail;
  fail.meanRelLimit = e.thresholds.meanRel;
  const int M = s.M, K = s.K, N = s.N;
  if (M <= 0 || K <= 0 || N <= 0) {
    fail.reason = fmt::format("bad gate shape {}", shapeText(s));
    return fail;
  }
  Rng rng(seed);
  Tensor hostIn({M, K}), hostW({K, N});
  for (int64_t i = 0; i < hostIn.numel(); ++i) hostIn[i] = rng.uniform(-0.2f, 0.2f);
  for (int64_t i = 0; i < hostW.numel(); ++i) hostW[i] = rng.uniform(-0.2f, 0.2f);

  Tensor in = ops.alloc({M, K}), w = ops.alloc({K, N});
  ops.upload(in, hostIn.data());
  ops.upload(w, hostW.data());
  Tensor ref = ops.alloc({M, N}), fast = ops.alloc({M, N});
  ops.matmul(ref.data(), in.data(), w.data(), nullptr, M, K, N);

  // Poison the path's output: an element it forgets to write reads as NaN and fails.
  ops.fill(fast.data(), std::numeric_limits<float>::quiet_NaN(), fast.numel());
  std::shared_ptr<Buffer> packed;
  const void* weight = w.data();
  if (e.prepare) {
    if (!e.packedBytes) {
      fail.reason = "entry has prepare but no packedBytes";
      return fail;
    }
    packed = ops.allocBytes(e.packedBytes(K, N));
    if (!e.prepare(packed->ptr, w.data(), K, N)) {
      fail.reason = "prepare refused the gate's weights";
      return fail;
    }
    weight = packed->ptr;
  }
  e.dispatch(fast.data(), in.data(), weight, nullptr, M, K, N);

  Tensor hostRef({M, N}), hostFast({M, N});
  ops.download(hostRef.data(), ref);
  ops.download(hostFast.data(), fast);
  return compareOutputs(hostRef.data(), hostFast.data(), size_t(hostRef.numel()), e.thresholds);
}

}  // namespace

GateResult runGate(Ops& ops, const PathEntry& e, uint64_t seed) {
  const auto t0 = std::chrono::steady_clock::now();
  GateResult r;
  r.path = e.name;
  r.activeText = e.activeText;
  r.supported = true;
  r.selected = true;
  r.ran = true;
  r.pass = !e.gateShapes.empty() && e.dispatch != nullptr;
  r.metric.meanRelLimit = e.thresholds.meanRel;
  if (!e.dispatch) r.metric.reason = "entry has no dispatch";
  if (e.gateShapes.empty()) r.metric.reason = "entry has no gate shapes";
  for (size_t i = 0; i < e.gateShapes.size() && e.dispatch; ++i) {
    GateMetric m;
    try {
      m = gateShape(ops, e, e.gateShapes[i], seed + i);
    } catch (const std::exception& ex) {
      m = GateMetric{};
      m.meanRelLimit = e.thresholds.meanRel;
      m.reason = fmt::format("path threw: {}", ex.what());
    } catch (...) {
      m = GateMetric{};
      m.meanRelLimit = e.thresholds.meanRel;
      m.reason = "path threw a non-standard exception";
    }
    r.pass = r.pass && m.pass;
    r.shapes.emplace_back(e.gateShapes[i], m);
  }
  if (!r.shapes.empty()) r.metric = r.shapes.front().second;
  r.millis =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

std::string consoleLine(const GateResult& r) {
  if (!r.supported)
    return fmt::format("[ops] {}: not supported on this machine ({}) — using f32", r.path,
                       r.unsupportedReason);
  if (!r.selected) return fmt::format("[ops] {}: not selected (--paths) — using f32", r.path);
  const GateMetric& m = r.metric;
  std::string line = fmt::format(
      "[ops] {} gate: mean|ref|={:.2e}, max_abs={:.2e} (limit {:.2e}), mean_rel={:.3f}% (limit "
      "{:.3f}%), max_rel={}% — ",
      r.path, m.meanAbsRef, m.maxAbs, m.maxAbsLimit, m.meanRel * 100.0, m.meanRelLimit * 100.0,
      pct3(m.maxRel));
  if (r.pass) return line + "PASS — " + r.activeText;
  // Why, when the spec shape's numbers do not show it: an invalid comparison, or another shape.
  std::string why = m.reason;
  if (why.empty() && m.pass) {
    for (const auto& [shape, sm] : r.shapes) {
      if (sm.pass) continue;
      why = fmt::format("at {}: {}", shapeText(shape),
                        sm.reason.empty()
                            ? fmt::format("max_abs={:.2e} (limit {:.2e}), mean_rel={:.3f}%",
                                          sm.maxAbs, sm.maxAbsLimit, sm.meanRel * 100.0)
                            : sm.reason);
      break;
    }
  }
  return line + (why.empty() ? "FAIL" : "FAIL (" + why + ")") + " — falling back to f32";
}

nlohmann::json toJson(const GateResult& r) {
  nlohmann::json j;
  j["path"] = r.path;
  j["supported"] = r.supported;
  if (!r.supported) j["unsupported_reason"] = r.unsupportedReason;
  j["selected"] = r.selected;
  j["ran"] = r.ran;
  j["pass"] = r.pass;
  j["active"] = r.active();
  j["verdict"] = !r.supported  ? "not supported"
                 : !r.selected ? "not selected"
                 : r.pass      ? "PASS"
                               : "FAIL";
  if (r.ran) {
    j["metric"] = toJson(r.metric);
    nlohmann::json shapes = nlohmann::json::array();
    for (const auto& [s, m] : r.shapes) {
      nlohmann::json sj = toJson(m);
      sj["M"] = s.M;
      sj["K"] = s.K;
      sj["N"] = s.N;
      shapes.push_back(sj);
    }
    j["shapes"] = shapes;
    j["millis"] = r.millis;
  }
  j["console"] = consoleLine(r);
  return j;
}

}  // namespace ptllm
