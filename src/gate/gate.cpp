#include "gate/gate.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <limits>
#include <memory>
#include <stdexcept>

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

std::string dims(const GateShape& s) {
  return fmt::format("{}x{}x{}", s.M, s.K, s.N);
}

std::string numbers(const GateMetric& m) {
  return fmt::format(
      "mean|ref|={:.2e}, max_abs={:.2e} (limit {:.2e}), mean_rel={:.3f}% (limit {:.3f}%), "
      "max_rel={}%",
      m.meanAbsRef, m.maxAbs, m.maxAbsLimit, m.meanRel * 100.0, m.meanRelLimit * 100.0,
      pct3(m.maxRel));
}

std::string verdict(const GateMetric& m) {
  if (m.pass) return "PASS";
  return m.reason.empty() ? "FAIL" : "FAIL (" + m.reason + ")";
}

double millisSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}
const char* kRefused = "prepare refused the gate's weights";

struct Check {
  bool eligible = true;
  GateMetric metric;
};

// Buffers of one gate run, sized once for its largest case and reused by every case: fresh
// multi-megabyte allocations per case cost more (page faults) than the matmuls themselves.
struct Arena {
  // hostIn/hostW: where runGate generates its inputs. On the CPU backend they are the same
  // buffers as in/w (no second copy: the bytes a gate touches are its main cost).
  std::shared_ptr<Buffer> in, w, bias, ref, fast, packed, hostIn, hostW, hostRef, hostFast;
  size_t maxMK = 1, maxKN = 1, maxN = 1, maxMN = 1, maxPacked = 1;
  void want(const PathEntry& e, int M, int K, int N) {
    if (M <= 0 || K <= 0 || N <= 0) return;
    maxMK = std::max(maxMK, size_t(M) * size_t(K));
    maxKN = std::max(maxKN, size_t(K) * size_t(N));
    maxN = std::max(maxN, size_t(N));
    maxMN = std::max(maxMN, size_t(M) * size_t(N));
    if (e.packedBytes) maxPacked = std::max(maxPacked, e.packedBytes(K, N));
  }
  void allocate(Ops& ops, bool hostInputs) {
    in = ops.allocBytes(maxMK * sizeof(float));
    w = ops.allocBytes(maxKN * sizeof(float));
    if (hostInputs) {
      hostIn = ops.device() == Device::CPU ? in : allocHost(maxMK * sizeof(float));
      hostW = ops.device() == Device::CPU ? w : allocHost(maxKN * sizeof(float));
    }
    bias = ops.allocBytes(maxN * sizeof(float));
    ref = ops.allocBytes(maxMN * sizeof(float));
    fast = ops.allocBytes(maxMN * sizeof(float));
    packed = ops.allocBytes(maxPacked);
    hostRef = allocHost(maxMN * sizeof(float));
    hostFast = allocHost(maxMN * sizeof(float));
  }
};

// One comparison: host inputs through ops' f32 matmul and through the path.
Check checkOne(Ops& ops, Arena& a, const PathEntry& e, int M, int K, int N, const float* hIn,
               const float* hW, const float* hBias) {
  Check c;
  c.metric.meanRelLimit = e.thresholds.meanRel;
  if (M <= 0 || K <= 0 || N <= 0 || !hIn || !hW) {
    c.metric.reason = fmt::format("bad gate case {}x{}x{}", M, K, N);
    return c;
  }
  try {
    Tensor in({M, K}, a.in), w({K, N}, a.w);
    if (hIn != in.data()) ops.upload(in, hIn);
    if (hW != w.data()) ops.upload(w, hW);
    const float* dBias = nullptr;
    if (hBias) {
      Tensor bias({N}, a.bias);
      ops.upload(bias, hBias);
      dBias = bias.data();
    }
    Tensor ref({M, N}, a.ref), fast({M, N}, a.fast);
    ops.matmul(ref.data(), in.data(), w.data(), dBias, M, K, N);

    // Poison the path's output: an element it forgets to write reads as NaN and fails.
    ops.fill(fast.data(), std::numeric_limits<float>::quiet_NaN(), fast.numel());
    const void* weight = w.data();
    if (e.prepare) {
      if (!e.packedBytes) {
        c.metric.reason = "entry has prepare but no packedBytes";
        return c;
      }
      if (!a.packed || a.packed->bytes < e.packedBytes(K, N))
        a.packed = ops.allocBytes(e.packedBytes(K, N));
      if (!e.prepare(a.packed->ptr, w.data(), K, N)) {
        c.eligible = false;
        c.metric.reason = kRefused;
        return c;
      }
      weight = a.packed->ptr;
    }
    e.dispatch(fast.data(), in.data(), weight, dBias, M, K, N);

    Tensor hostRef({M, N}, a.hostRef), hostFast({M, N}, a.hostFast);
    ops.download(hostRef.data(), ref);
    ops.download(hostFast.data(), fast);
    c.metric =
        compareOutputs(hostRef.data(), hostFast.data(), size_t(hostRef.numel()), e.thresholds);
  } catch (const std::exception& ex) {
    c.metric = GateMetric{};
    c.metric.meanRelLimit = e.thresholds.meanRel;
    c.metric.reason = fmt::format("path threw: {}", ex.what());
  } catch (...) {
    c.metric = GateMetric{};
    c.metric.meanRelLimit = e.thresholds.meanRel;
    c.metric.reason = "path threw a non-standard exception";
  }
  return c;
}

struct Span {
  float* p;
  size_t n;
  float* begin() const { return p; }
  float* end() const { return p + n; }
};

void fillUniform(Rng& rng, Span v, float lo, float hi) {
  for (float& x : v) x = rng.uniform(lo, hi);
}

// Host data of a probe (see gate.h for the design of each kind).
void probeData(const GateProbe& p, uint64_t seed, Span in, Span w) {
  Rng rng(seed);
  switch (p.kind) {
    case ProbeKind::Outliers:
      fillUniform(rng, in, -700.0f, 700.0f);
      for (float& x : in)
        if (rng.below(64) == 0) x *= 100.0f;  // up to 7e4: past f16's 65504
      fillUniform(rng, w, -0.2f, 0.2f);
      break;
    case ProbeKind::F16Limit:
      fillUniform(rng, in, -1.0f, 1.0f);
      fillUniform(rng, w, -6.0e4f, 6.0e4f);  // inside f16 (max 65504)
      break;
    case ProbeKind::BeyondF16:
      fillUniform(rng, in, -0.2f, 0.2f);
      fillUniform(rng, w, -0.2f, 0.2f);
      for (float& x : w)
        if (rng.below(64) == 0) x = (x < 0 ? -1.0e5f : 1.0e5f);  // past f16's 65504
      break;
    case ProbeKind::LargeK:
      fillUniform(rng, in, -0.2f, 0.2f);
      fillUniform(rng, w, -0.2f, 0.2f);
      break;
  }
}

GateResult startResult(const PathEntry& e) {
  GateResult r;
  r.path = e.name;
  r.activeText = e.activeText;
  r.supported = true;
  r.selected = true;
  r.ran = true;
  r.metric.meanRelLimit = e.thresholds.meanRel;
  return r;
}

std::string countsText(const GateResult& r) {
  int shapesOk = 0, probesOk = 0, notEligible = 0;
  for (const auto& sm : r.shapes) shapesOk += sm.second.pass ? 1 : 0;
  for (const auto& p : r.probes) {
    probesOk += p.ok() ? 1 : 0;
    notEligible += p.eligible ? 0 : 1;
  }
  notEligible += int(r.ineligible.size());
  std::string s = fmt::format("{}/{} shapes", shapesOk, r.shapes.size());
  if (!r.probes.empty()) s += fmt::format(", {}/{} probes", probesOk, r.probes.size());
  if (notEligible) s += fmt::format(", {} not eligible", notEligible);
  return s;
}

bool multi(const GateResult& r) {
  return r.shapes.size() > 1 || !r.probes.empty() || !r.ineligible.empty();
}

}  // namespace

std::string shapeText(const GateShape& s) {
  return s.label.empty() ? dims(s) : s.label + " " + dims(s);
}

GateResult runGate(Ops& ops, const PathEntry& e, uint64_t seed) {
  const auto t0 = std::chrono::steady_clock::now();
  GateResult r = startResult(e);
  r.pass = !e.gateShapes.empty() && e.dispatch != nullptr;
  if (!e.dispatch) r.metric.reason = "entry has no dispatch";
  if (e.gateShapes.empty()) r.metric.reason = "entry has no gate shapes";
  if (!e.dispatch) {
    r.millis = millisSince(t0);
    return r;
  }
  Arena arena;
  for (const auto& s : e.gateShapes) arena.want(e, s.M, s.K, s.N);
  for (const auto& p : e.gateProbes) arena.want(e, p.shape.M, p.shape.K, p.shape.N);
  try {
    arena.allocate(ops, true);
  } catch (const std::exception& ex) {
    r.pass = false;
    r.metric.reason = fmt::format("gate allocation failed: {}", ex.what());
    r.millis = millisSince(t0);
    return r;
  }
  for (size_t i = 0; i < e.gateShapes.size(); ++i) {
    const GateShape& s = e.gateShapes[i];
    Check c;
    if (s.M <= 0 || s.K <= 0 || s.N <= 0) {
      c.metric.meanRelLimit = e.thresholds.meanRel;
      c.metric.reason = fmt::format("bad gate shape {}", dims(s));
    } else {
      Rng rng(seed + i);
      const Span in{static_cast<float*>(arena.hostIn->ptr), size_t(s.M) * size_t(s.K)};
      const Span w{static_cast<float*>(arena.hostW->ptr), size_t(s.K) * size_t(s.N)};
      fillUniform(rng, in, -0.2f, 0.2f);
      fillUniform(rng, w, -0.2f, 0.2f);
      c = checkOne(ops, arena, e, s.M, s.K, s.N, in.p, w.p, nullptr);
      // A gate shape holds typical weights: refusing them is a FAIL, not "not eligible".
    }
    r.pass = r.pass && c.metric.pass;
    r.shapes.emplace_back(s, c.metric);
  }
  for (size_t j = 0; j < e.gateProbes.size(); ++j) {
    const GateProbe& p = e.gateProbes[j];
    ProbeResult pr;
    pr.probe = p;
    if (p.shape.M <= 0 || p.shape.K <= 0 || p.shape.N <= 0) {
      pr.metric.meanRelLimit = e.thresholds.meanRel;
      pr.metric.reason = fmt::format("bad probe shape {}", dims(p.shape));
    } else {
      const Span in{static_cast<float*>(arena.hostIn->ptr), size_t(p.shape.M) * size_t(p.shape.K)};
      const Span w{static_cast<float*>(arena.hostW->ptr), size_t(p.shape.K) * size_t(p.shape.N)};
      probeData(p, seed + 1000 + j, in, w);
      const Check c = checkOne(ops, arena, e, p.shape.M, p.shape.K, p.shape.N, in.p, w.p, nullptr);
      pr.eligible = c.eligible;
      pr.metric = c.metric;
    }
    r.pass = r.pass && pr.ok();
    r.probes.push_back(std::move(pr));
  }
  if (!r.shapes.empty()) r.metric = r.shapes.front().second;
  r.millis = millisSince(t0);
  return r;
}

GateResult runGateOnData(Ops& ops, const PathEntry& e, const std::vector<GateCase>& cases) {
  const auto t0 = std::chrono::steady_clock::now();
  GateResult r = startResult(e);
  r.pass = e.dispatch != nullptr;
  if (!e.dispatch) {
    r.metric.reason = "entry has no dispatch";
    r.millis = millisSince(t0);
    return r;
  }
  Arena arena;
  for (const GateCase& gc : cases) arena.want(e, gc.M, gc.K, gc.N);
  try {
    arena.allocate(ops, false);
  } catch (const std::exception& ex) {
    r.pass = false;
    r.metric.reason = fmt::format("gate allocation failed: {}", ex.what());
    r.millis = millisSince(t0);
    return r;
  }
  for (const GateCase& gc : cases) {
    GateShape s{gc.M, gc.K, gc.N, gc.label};
    const Check c = checkOne(ops, arena, e, gc.M, gc.K, gc.N, gc.input, gc.weight, gc.bias);
    if (!c.eligible) {
      r.ineligible.push_back(s);
      continue;
    }
    r.pass = r.pass && c.metric.pass;
    r.shapes.emplace_back(s, c.metric);
  }
  if (r.shapes.empty()) {
    r.pass = false;
    r.metric.reason = "no eligible case";
  } else {
    r.metric = r.shapes.front().second;
  }
  r.millis = millisSince(t0);
  return r;
}

std::string consoleLine(const GateResult& r) {
  if (!r.supported)
    return fmt::format("[ops] {}: not supported on this machine ({}) — using f32", r.path,
                       r.unsupportedReason);
  if (!r.selected) return fmt::format("[ops] {}: not selected (--paths) — using f32", r.path);
  const GateMetric& m = r.metric;
  std::string line = fmt::format("[ops] {} gate: {} — ", r.path, numbers(m));
  const std::string tail = r.cached ? " (cached)" : "";
  if (r.pass) {
    line += "PASS";
    if (multi(r)) line += " (" + countsText(r) + ")";
    return line + " — " + r.activeText + tail;
  }
  // Why, when the spec shape's numbers do not show it: an invalid comparison, or another
  // shape, or a probe.
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
  if (why.empty() && m.pass) {
    for (const auto& p : r.probes) {
      if (p.ok()) continue;
      const GateMetric& pm = p.metric;
      why = fmt::format("probe {} {}: {}", p.probe.name, dims(p.probe.shape),
                        pm.reason.empty()
                            ? fmt::format("max_abs={:.2e} (limit {:.2e}), mean_rel={:.3f}%",
                                          pm.maxAbs, pm.maxAbsLimit, pm.meanRel * 100.0)
                            : pm.reason);
      break;
    }
  }
  if (multi(r)) why += (why.empty() ? "" : "; ") + countsText(r);
  return line + (why.empty() ? "FAIL" : "FAIL (" + why + ")") + " — falling back to f32" + tail;
}

std::vector<std::string> consoleLines(const GateResult& r) {
  std::vector<std::string> lines;
  if (r.supported && r.selected && multi(r)) {
    const std::string tail = r.cached ? " (cached)" : "";
    for (const auto& [s, m] : r.shapes)
      lines.push_back(fmt::format("[ops] {} gate {}: {} — {}{}", r.path, shapeText(s), numbers(m),
                                  verdict(m), tail));
    for (const auto& p : r.probes) {
      if (!p.eligible)
        lines.push_back(
            fmt::format("[ops] {} probe {} {}: not eligible ({}) — this matrix stays on f32{}",
                        r.path, p.probe.name, dims(p.probe.shape), p.metric.reason, tail));
      else
        lines.push_back(fmt::format("[ops] {} probe {} {}: {} — {}{}", r.path, p.probe.name,
                                    dims(p.probe.shape), numbers(p.metric), verdict(p.metric),
                                    tail));
    }
    for (const auto& s : r.ineligible)
      lines.push_back(
          fmt::format("[ops] {} gate {}: not eligible ({}) — this matrix stays on f32{}", r.path,
                      shapeText(s), kRefused, tail));
  }
  lines.push_back(consoleLine(r));
  return lines;
}

namespace {
nlohmann::json shapeJson(const GateShape& s) {
  nlohmann::json j;
  j["M"] = s.M;
  j["K"] = s.K;
  j["N"] = s.N;
  if (!s.label.empty()) j["label"] = s.label;
  return j;
}
GateShape shapeFromJson(const nlohmann::json& j) {
  GateShape s{j.at("M").get<int>(), j.at("K").get<int>(), j.at("N").get<int>()};
  if (j.contains("label")) s.label = j.at("label").get<std::string>();
  return s;
}
const char* probeKindName(ProbeKind k) {
  switch (k) {
    case ProbeKind::Outliers:
      return "outliers";
    case ProbeKind::F16Limit:
      return "f16-limit";
    case ProbeKind::BeyondF16:
      return "beyond-f16";
    case ProbeKind::LargeK:
      return "large-k";
  }
  return "?";
}
ProbeKind probeKindFromName(const std::string& n) {
  if (n == "outliers") return ProbeKind::Outliers;
  if (n == "f16-limit") return ProbeKind::F16Limit;
  if (n == "beyond-f16") return ProbeKind::BeyondF16;
  if (n == "large-k") return ProbeKind::LargeK;
  throw std::runtime_error("unknown probe kind " + n);
}
}  // namespace

nlohmann::json toJson(const GateResult& r) {
  nlohmann::json j;
  j["path"] = r.path;
  j["supported"] = r.supported;
  if (!r.supported) j["unsupported_reason"] = r.unsupportedReason;
  j["selected"] = r.selected;
  j["ran"] = r.ran;
  j["pass"] = r.pass;
  j["active"] = r.active();
  j["cached"] = r.cached;
  j["verdict"] = !r.supported  ? "not supported"
                 : !r.selected ? "not selected"
                 : r.pass      ? "PASS"
                               : "FAIL";
  if (r.ran) {
    j["active_text"] = r.activeText;
    j["metric"] = toJson(r.metric);
    nlohmann::json shapes = nlohmann::json::array();
    for (const auto& [s, m] : r.shapes) {
      nlohmann::json sj = toJson(m);
      sj.update(shapeJson(s));
      shapes.push_back(sj);
    }
    j["shapes"] = shapes;
    nlohmann::json probes = nlohmann::json::array();
    for (const auto& p : r.probes) {
      nlohmann::json pj = toJson(p.metric);
      pj.update(shapeJson(p.probe.shape));
      pj["probe"] = p.probe.name;
      pj["kind"] = probeKindName(p.probe.kind);
      pj["eligible"] = p.eligible;
      pj["ok"] = p.ok();
      probes.push_back(pj);
    }
    j["probes"] = probes;
    nlohmann::json inel = nlohmann::json::array();
    for (const auto& s : r.ineligible) inel.push_back(shapeJson(s));
    j["ineligible"] = inel;
    j["millis"] = r.millis;
  }
  j["console"] = consoleLine(r);
  j["lines"] = consoleLines(r);
  return j;
}

GateResult gateResultFromJson(const nlohmann::json& j) {
  GateResult r;
  r.path = j.at("path").get<std::string>();
  r.supported = j.at("supported").get<bool>();
  if (j.contains("unsupported_reason"))
    r.unsupportedReason = j.at("unsupported_reason").get<std::string>();
  r.selected = j.at("selected").get<bool>();
  r.ran = j.at("ran").get<bool>();
  r.pass = j.at("pass").get<bool>();
  r.cached = j.value("cached", false);
  if (!r.ran) return r;
  r.activeText = j.at("active_text").get<std::string>();
  r.metric = metricFromJson(j.at("metric"));
  for (const auto& sj : j.at("shapes"))
    r.shapes.emplace_back(shapeFromJson(sj), metricFromJson(sj));
  for (const auto& pj : j.at("probes")) {
    ProbeResult p;
    p.probe.name = pj.at("probe").get<std::string>();
    p.probe.kind = probeKindFromName(pj.at("kind").get<std::string>());
    p.probe.shape = shapeFromJson(pj);
    p.eligible = pj.at("eligible").get<bool>();
    p.metric = metricFromJson(pj);
    r.probes.push_back(std::move(p));
  }
  for (const auto& sj : j.at("ineligible")) r.ineligible.push_back(shapeFromJson(sj));
  r.millis = j.at("millis").get<double>();
  return r;
}

}  // namespace ptllm
