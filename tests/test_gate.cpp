// The gate end to end: the real f16-storage path passes on this machine; broken variants
// registered only here fail and are never used; unsupported is reported apart from FAIL;
// --paths; pills; concurrent waiting on the background gate (run under TSan in CI);
// determinism.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "core/rng.h"
#include "gate/capabilities.h"
#include "gate/gate.h"
#include "gate/paths.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

namespace ptllm {
namespace {

std::atomic<int> gDispatches{0};

// ---- broken variants of f16-storage: the same pack, a damaged output ----
void dropLowBits(float* out, const float* in, const void* w, const float* bias, int M, int K,
                 int N) {
  cpu::matmulF16(out, in, w, bias, M, K, N);
  for (int64_t i = 0; i < int64_t(M) * N; ++i) {  // keep 5 of 23 mantissa bits
    uint32_t u;
    std::memcpy(&u, &out[i], 4);
    u &= ~((1u << 18) - 1);
    std::memcpy(&out[i], &u, 4);
  }
}
void corruptOne(float* out, const float* in, const void* w, const float* bias, int M, int K,
                int N) {
  cpu::matmulF16(out, in, w, bias, M, K, N);
  out[17] += 1.0f;
}
void nanAtThree(float* out, const float* in, const void* w, const float* bias, int M, int K,
                int N) {
  cpu::matmulF16(out, in, w, bias, M, K, N);
  out[3] = std::numeric_limits<float>::quiet_NaN();
}
void skipsLastRow(float* out, const float* in, const void* w, const float* bias, int M, int K,
                  int N) {
  cpu::matmulF16(out, in, w, bias, M - 1, K, N);  // the last row keeps the gate's NaN poison
}
void countingF16(float* out, const float* in, const void* w, const float* bias, int M, int K,
                 int N) {
  gDispatches.fetch_add(1);
  cpu::matmulF16(out, in, w, bias, M, K, N);
}
bool refusePrepare(void*, const float*, int, int) {
  return false;
}

// ---- the fault matrix: variants each caught by the part of the gate designed for them ----
// A K-tiling bug: only the first 1000 rows of K are summed. Right at K=128 and K=256 (the
// single-shape gate passes), wrong from K=1024 on (the multi-shape gate fails).
void kTileBug(float* out, const float* in, const void* w, const float* bias, int M, int K, int N) {
  if (K <= 1000) return cpu::matmulF16(out, in, w, bias, M, K, N);
  std::vector<float> head(in, in + size_t(M) * K);  // zero past k = 1000: w's first 1000 rows
  for (int m = 0; m < M; ++m)
    std::fill(head.begin() + size_t(m) * K + 1000, head.begin() + size_t(m + 1) * K, 0.0f);
  cpu::matmulF16(out, head.data(), w, bias, M, K, N);
}
// Rounds the activations to f16 too: fine on typical values, Inf on an outlier past 65504.
void inputToF16(float* out, const float* in, const void* w, const float* bias, int M, int K,
                int N) {
  std::vector<float> r(size_t(M) * K);
  for (size_t i = 0; i < r.size(); ++i) r[i] = f16ToF32(f32ToF16(in[i]));
  cpu::matmulF16(out, r.data(), w, bias, M, K, N);
}
// Accumulates in f16 (the running sum rounded to f16 after every add): overflows near the
// f16 limit.
void accumulateF16(float* out, const float* in, const void* w, const float* bias, int M, int K,
                   int N) {
  std::vector<float> wf(size_t(K) * N);
  for (int k = 0; k < K; ++k)
    for (int n = 0; n < N; ++n) wf[size_t(k) * N + n] = cpu::f16PackedAt(w, K, N, k, n);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      float acc = 0;
      for (int k = 0; k < K; ++k)
        acc = f16ToF32(f32ToF16(acc + in[size_t(m) * K + k] * wf[size_t(k) * N + n]));
      out[size_t(m) * N + n] = acc + (bias ? bias[n] : 0.0f);
    }
}
// A pack that saturates out-of-range weights to +-65504 instead of refusing the matrix.
// Clamps to the f16 range, then the real pack (its layout is private to matmul_f16.cpp).
bool saturatingPack(void* dst, const float* w, int K, int N) {
  std::vector<float> c(size_t(K) * N);
  for (size_t i = 0; i < c.size(); ++i) c[i] = std::fmax(-65504.0f, std::fmin(65504.0f, w[i]));
  return cpu::packF16(dst, c.data(), K, N);
}

size_t summaryCount(const std::vector<std::string>& lines) {
  size_t n = 0;
  for (const auto& l : lines)
    if (l.find(" gate: ") != std::string::npos || l.find(": not supported") != std::string::npos ||
        l.find(": not selected") != std::string::npos)
      ++n;
  return n;
}

PathEntry realEntry() {
  const PathEntry* e = findPath("f16-storage");
  EXPECT_NE(e, nullptr);
  return e ? *e : PathEntry{};
}
PathEntry variant(const std::string& name, MatmulFn fn) {
  PathEntry e = realEntry();
  e.name = name;
  e.pill = "+" + name;
  e.dispatch = fn;
  return e;
}

// Captures the gate console lines for the life of the object.
struct LogCapture {
  std::mutex mu;
  std::vector<std::string> lines;
  GateLogSink previous;
  LogCapture() {
    previous = setGateLogSink([this](const std::string& l) {
      std::lock_guard<std::mutex> lock(mu);
      lines.push_back(l);
    });
  }
  ~LogCapture() { setGateLogSink(previous); }
  std::vector<std::string> get() {
    std::lock_guard<std::mutex> lock(mu);
    return lines;
  }
};

class Gate : public ::testing::Test {
 protected:
  std::unique_ptr<Ops> ops = makeCpuOps();
  const Capabilities& caps = detectCapabilities();
};

TEST_F(Gate, RegistryDeclaresF16Storage) {
  const PathEntry& e = realEntry();
  EXPECT_EQ(e.pill, "+f16 storage");
  EXPECT_EQ(e.statusClause, "f16-storage matmul");
  EXPECT_EQ(e.activeText, "f16 path active");
  EXPECT_EQ(e.requiredCaps, std::vector<std::string>{"f16c"});
  ASSERT_EQ(e.gateShapes.size(), 4u);
  EXPECT_EQ(e.gateShapes[0].M, 64);  // the spec's shape first
  EXPECT_EQ(e.gateShapes[0].K, 128);
  EXPECT_EQ(e.gateShapes[0].N, 128);
  EXPECT_EQ(e.gateShapes[1].K, 256);    // inference-typical
  EXPECT_EQ(e.gateShapes[2].K, 1024);   // training-typical
  EXPECT_EQ(e.gateShapes[3].K, 50257);  // head output: GPT-2's vocab
  ASSERT_EQ(e.gateProbes.size(), 4u);
  bool largeK = false;
  for (const auto& p : e.gateProbes) largeK = largeK || p.shape.K >= 4096;
  EXPECT_TRUE(largeK);
  EXPECT_EQ(findPath("no-such-path"), nullptr);
}

TEST_F(Gate, CapabilitiesAreDetectedOnceAndCanBeRemoved) {
  EXPECT_EQ(&caps, &detectCapabilities());
  EXPECT_FALSE(caps.cpuModel.empty());
  EXPECT_FALSE(caps.hwyTargets.empty());
  EXPECT_FALSE(caps.has("no-such-flag"));
#if defined(__x86_64__)
  EXPECT_EQ(caps.flags.count("f16c"), 1u);
  EXPECT_EQ(caps.flags.count("amx_tile"), 1u);
#endif
  Capabilities without = caps.withOut("f16c");
  EXPECT_FALSE(without.has("f16c"));
  EXPECT_EQ(without.missing({"f16c"}), std::vector<std::string>{"f16c"});
  nlohmann::json j = caps.toJson();
  EXPECT_TRUE(j.contains("cpu_model"));
  EXPECT_TRUE(j["flags"].is_object());
}

TEST_F(Gate, RealF16StoragePassesOnThisMachine) {
  if (!caps.has("f16c")) GTEST_SKIP() << "no F16C here";
  runGate(*ops, realEntry());  // warm-up (pool, pages)
  GateResult r = runGate(*ops, realEntry());
  for (const auto& l : consoleLines(r)) std::printf("%s\n", l.c_str());
  std::printf("gate time: %.1f ms\n", r.millis);
  EXPECT_TRUE(r.ran);
  EXPECT_TRUE(r.pass) << consoleLine(r);
  ASSERT_EQ(r.shapes.size(), 4u);
  for (const auto& [s, m] : r.shapes) EXPECT_TRUE(m.pass) << shapeText(s);
  ASSERT_EQ(r.probes.size(), 4u);
  for (const auto& p : r.probes) {
    SCOPED_TRACE(p.probe.name);
    EXPECT_TRUE(p.ok());
    // beyond-f16's weights overflow f16: the real pack refuses them (not eligible); every
    // other probe is eligible and passes on its numbers, finite on both sides.
    EXPECT_EQ(p.eligible, p.probe.kind != ProbeKind::BeyondF16);
    if (p.eligible) {
      EXPECT_TRUE(p.metric.pass && p.metric.reason.empty()) << p.metric.reason;
    }
  }
  EXPECT_EQ(consoleLines(r).size(), 4u + 4u + 1u);
  EXPECT_LT(r.millis, 1000.0);  // generous: ~tens of ms on 2 cores in Release
  EXPECT_TRUE(r.active());
  EXPECT_TRUE(r.metric.reason.empty());
  // mean|ref| of a K=128 dot product of U(-0.2,0.2) values: sqrt(128) * 0.2^2/3 * sqrt(2/pi).
  EXPECT_NEAR(r.metric.meanAbsRef, 0.12, 0.01);
  EXPECT_GT(r.metric.maxAbs, 0.0);  // f16 storage is not bit-exact
  EXPECT_LT(r.metric.maxAbs, r.metric.maxAbsLimit);
  EXPECT_LT(r.metric.meanRel, r.metric.meanRelLimit);
  const std::string line = consoleLine(r);
  EXPECT_EQ(line.rfind("[ops] f16-storage gate: mean|ref|=", 0), 0u) << line;
  EXPECT_NE(line.find(" — PASS (4/4 shapes, 4/4 probes, 1 not eligible) — f16 path active"),
            std::string::npos)
      << line;
  EXPECT_EQ(consoleLines(r)[0].rfind("[ops] f16-storage gate 64x128x128: mean|ref|=", 0), 0u);
}

TEST_F(Gate, GateIsDeterministic) {
  GateResult a = runGate(*ops, realEntry()), b = runGate(*ops, realEntry());
  EXPECT_EQ(a.metric.meanAbsRef, b.metric.meanAbsRef);
  EXPECT_EQ(a.metric.maxAbs, b.metric.maxAbs);
  EXPECT_EQ(a.metric.meanRel, b.metric.meanRel);
  EXPECT_EQ(a.metric.maxRel, b.metric.maxRel);
  EXPECT_EQ(a.pass, b.pass);
  EXPECT_EQ(consoleLine(a), consoleLine(b));
  GateResult c = runGate(*ops, realEntry(), kGateSeed + 1);  // other inputs, other numbers
  EXPECT_NE(a.metric.maxAbs, c.metric.maxAbs);
}

TEST_F(Gate, BrokenVariantsFailAndAreNeverUsed) {
  struct Case {
    PathEntry entry;
    std::string reason;  // expected metric.reason ("" = a threshold miss)
  };
  std::vector<Case> cases{
      {variant("drop-low-bits", dropLowBits), ""},
      {variant("corrupt-one", corruptOne), ""},
      {variant("nan-out", nanAtThree), "NaN in fast output at index 3"},
      {variant("skips-last-row", skipsLastRow), "NaN in fast output at index 8064"},
  };
  PathEntry refused = realEntry();
  refused.name = "refuses-prepare";
  refused.prepare = refusePrepare;
  cases.push_back({refused, "prepare refused the gate's weights"});

  for (const Case& c : cases) {
    SCOPED_TRACE(c.entry.name);
    GateResult r = runGate(*ops, c.entry);
    EXPECT_TRUE(r.ran);
    EXPECT_FALSE(r.pass);
    EXPECT_FALSE(r.active());
    EXPECT_EQ(r.metric.reason, c.reason);
    const std::string line = consoleLine(r);
    std::printf("%s\n", line.c_str());  // quoted in docs/precision.md
    const std::string verdict = c.reason.empty() ? "— FAIL (" : "— FAIL (" + c.reason + ";";
    EXPECT_NE(line.find(verdict), std::string::npos) << line;
    EXPECT_NE(line.find("falling back to f32"), std::string::npos) << line;

    LogCapture log;
    PathSet set(*ops, PathSelection{}, caps.withOut("nothing"), {c.entry});
    EXPECT_EQ(set.forwardPath(), nullptr);  // the model runs f32
    EXPECT_TRUE(set.activePills().empty());
    EXPECT_EQ(set.statusClause(), "");
    EXPECT_FALSE(set.isActive(c.entry.name));
    EXPECT_EQ(log.get(), consoleLines(r));  // logged once
  }
  const GateResult drop = runGate(*ops, cases[0].entry);
  EXPECT_GE(drop.metric.meanRel, drop.metric.meanRelLimit);  // systematic: mean_rel catches it
  const GateResult one = runGate(*ops, cases[1].entry);
  EXPECT_GE(one.metric.maxAbs, one.metric.maxAbsLimit);  // one blow-up: max_abs catches it
  EXPECT_LT(one.metric.meanRel, one.metric.meanRelLimit);
}

TEST_F(Gate, FailedPathIsSkippedForTheNextActiveOne) {
  if (!caps.has("f16c")) GTEST_SKIP() << "no F16C here";
  LogCapture log;
  PathSet set(*ops, PathSelection{}, caps, {variant("nan-out", nanAtThree), realEntry()});
  const PathEntry* p = set.forwardPath();
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->name, "f16-storage");
  EXPECT_EQ(set.activePills(), std::vector<std::string>{"+f16 storage"});
  EXPECT_EQ(set.statusClause(), " · f16-storage matmul active");
  EXPECT_EQ(summaryCount(log.get()), 2u);
}

TEST_F(Gate, MissingCapabilityIsNotSupportedNotFail) {
  gDispatches = 0;
  LogCapture log;
  PathSet set(*ops, PathSelection{}, caps.withOut("f16c"), {variant("f16-storage", countingF16)});
  EXPECT_EQ(set.forwardPath(), nullptr);
  std::vector<GateResult> rs = set.results();
  ASSERT_EQ(rs.size(), 1u);
  EXPECT_FALSE(rs[0].supported);
  EXPECT_EQ(rs[0].unsupportedReason, "missing f16c");
  EXPECT_FALSE(rs[0].ran);
  EXPECT_FALSE(rs[0].pass);
  EXPECT_EQ(consoleLine(rs[0]),
            "[ops] f16-storage: not supported on this machine (missing f16c) — using f32");
  EXPECT_EQ(toJson(rs[0])["verdict"], "not supported");
  EXPECT_TRUE(set.activePills().empty());
  EXPECT_EQ(gDispatches.load(), 0);
  EXPECT_EQ(log.get(), std::vector<std::string>{consoleLine(rs[0])});
}

TEST_F(Gate, OtherDeviceIsNotSupported) {
  PathEntry e = realEntry();
  e.device = Device::CUDA;
  LogCapture log;
  PathSet set(*ops, PathSelection{}, caps, {e});
  EXPECT_EQ(set.forwardPath(), nullptr);
  EXPECT_FALSE(set.results()[0].supported);
}

TEST_F(Gate, PathsF32RunsNoGate) {
  gDispatches = 0;
  LogCapture log;
  PathSet set(*ops, PathSelection::parse("f32"), caps, {variant("f16-storage", countingF16)});
  EXPECT_EQ(set.forwardPath(), nullptr);
  GateResult r = set.ready("f16-storage").get();
  EXPECT_FALSE(r.selected);
  EXPECT_FALSE(r.ran);
  EXPECT_EQ(gDispatches.load(), 0);
  EXPECT_TRUE(set.activePills().empty());
}

TEST_F(Gate, PathsNamedSelectsOnlyThose) {
  if (!caps.has("f16c")) GTEST_SKIP() << "no F16C here";
  gDispatches = 0;
  LogCapture log;
  std::vector<PathEntry> entries{variant("counting", countingF16), realEntry()};
  PathSet set(*ops, PathSelection::parse("f16-storage", entries), caps, entries);
  const PathEntry* p = set.forwardPath();
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->name, "f16-storage");
  EXPECT_FALSE(set.ready("counting").get().selected);
  EXPECT_EQ(gDispatches.load(), 0);
  EXPECT_THROW(set.ready("unknown"), Error);
}

TEST(PathSelectionParse, AutoF32AndNames) {
  EXPECT_EQ(PathSelection::parse("auto").mode, PathSelection::Mode::Auto);
  EXPECT_EQ(PathSelection::parse("").mode, PathSelection::Mode::Auto);
  EXPECT_TRUE(PathSelection::parse("auto").allows("f16-storage"));
  PathSelection f32 = PathSelection::parse("f32");
  EXPECT_EQ(f32.mode, PathSelection::Mode::F32Only);
  EXPECT_FALSE(f32.allows("f16-storage"));
  EXPECT_EQ(f32.toString(), "f32");
  PathSelection only = PathSelection::parse(" f16-storage ");
  EXPECT_EQ(only.mode, PathSelection::Mode::Only);
  EXPECT_TRUE(only.allows("f16-storage"));
  EXPECT_FALSE(only.allows("other"));
  EXPECT_EQ(only.toString(), "f16-storage");
}

TEST(PathSelectionParse, UnknownNameThrowsListingTheKnownOnes) {
  try {
    PathSelection::parse("f16-storage,bogus");
    FAIL() << "no throw";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'bogus'"), std::string::npos) << what;
    EXPECT_NE(what.find("f16-storage"), std::string::npos) << what;
    EXPECT_NE(what.find("f32"), std::string::npos) << what;
  }
  EXPECT_THROW(PathSelection::parse("f32,f16-storage"), Error);
  EXPECT_THROW(PathSelection::parse("f16-storage,"), Error);
}

TEST_F(Gate, PillOnlyWhenActive) {
  if (!caps.has("f16c")) GTEST_SKIP() << "no F16C here";
  LogCapture log;
  {
    PathSet set(*ops, PathSelection{}, caps, pathsFor(Device::CPU));
    const auto pills = set.activePills();
    EXPECT_NE(std::find(pills.begin(), pills.end(), "+f16 storage"), pills.end());
  }
  {
    PathSet set(*ops, PathSelection::parse("f32"), caps, pathsFor(Device::CPU));
    EXPECT_TRUE(set.activePills().empty());
  }
  {
    PathSet set(*ops, PathSelection{}, caps.withOut("f16c"), pathsFor(Device::CPU));
    EXPECT_TRUE(set.activePills().empty());
  }
  {
    PathSet set(*ops, PathSelection{}, caps, {variant("f16-storage", corruptOne)});
    EXPECT_TRUE(set.activePills().empty());
  }
}

TEST_F(Gate, ConcurrentWaitersWhileTheGateRuns) {
  if (!caps.has("f16c")) GTEST_SKIP() << "no F16C here";
  LogCapture log;
  for (int round = 0; round < 3; ++round) {
    std::vector<PathEntry> entries{variant("broken", corruptOne), realEntry(),
                                   variant("late", countingF16)};
    PathSet set(*ops, PathSelection{}, caps, entries);
    std::atomic<int> wrong{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < 20; ++i) {
          switch ((t + i) % 5) {
            case 0: {
              const PathEntry* p = set.forwardPath();
              if (!p || p->name != "f16-storage") wrong++;
              break;
            }
            case 1:
              if (set.ready("broken").get().pass) wrong++;
              break;
            case 2: {
              auto rs = set.results();
              if (rs.size() != 3 || !rs[1].active() || rs[0].active()) wrong++;
              break;
            }
            case 3:
              if (set.activePills().size() != 2) wrong++;  // f16-storage and late
              break;
            case 4:
              if (!set.isActive("late") || set.statusClause().empty()) wrong++;
              break;
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    EXPECT_EQ(wrong.load(), 0);
  }
  EXPECT_EQ(summaryCount(log.get()), 9u);  // 3 rounds x 3 gates, once each
}

PathEntry singleShape(PathEntry e) {
  e.gateShapes.resize(1);
  e.gateProbes.clear();
  return e;
}

TEST_F(Gate, FaultKTileBugPassesSingleShapeFailsMultiShape) {
  const PathEntry bug = variant("k-tile-bug", kTileBug);
  EXPECT_TRUE(runGate(*ops, singleShape(bug)).pass);  // the old gate would let it through
  PathEntry noProbes = bug;
  noProbes.gateProbes.clear();
  const GateResult r = runGate(*ops, noProbes);
  EXPECT_FALSE(r.pass);
  EXPECT_TRUE(r.metric.pass);  // the spec shape is fine...
  EXPECT_TRUE(r.shapes[1].second.pass);
  EXPECT_FALSE(r.shapes[2].second.pass);  // ...64x1024x256 is not
  EXPECT_FALSE(r.shapes[3].second.pass);
  const std::string line = consoleLine(r);
  std::printf("%s\n", line.c_str());
  EXPECT_NE(line.find("FAIL (at 64x1024x256: "), std::string::npos) << line;
  EXPECT_NE(line.find("2/4 shapes"), std::string::npos) << line;
  EXPECT_FALSE(runGate(*ops, bug).pass);
}

TEST_F(Gate, FaultInputToF16CaughtByOutlierProbe) {
  const PathEntry bad = variant("input-f16", inputToF16);
  PathEntry shapesOnly = bad;
  shapesOnly.gateProbes.clear();
  EXPECT_TRUE(runGate(*ops, shapesOnly).pass);  // every typical shape passes
  const GateResult r = runGate(*ops, bad);
  EXPECT_FALSE(r.pass);
  for (const auto& p : r.probes) {
    SCOPED_TRACE(p.probe.name);
    if (p.probe.kind == ProbeKind::Outliers) {
      EXPECT_TRUE(p.eligible);
      EXPECT_FALSE(p.ok());
      EXPECT_NE(p.metric.reason.find("Inf in fast output"), std::string::npos) << p.metric.reason;
    }
  }
  for (const auto& l : consoleLines(r)) std::printf("%s\n", l.c_str());
  EXPECT_NE(consoleLine(r).find("probe outliers 8x256x64"), std::string::npos);
}

TEST_F(Gate, FaultF16AccumulationCaughtByF16LimitProbe) {
  const GateResult r = runGate(*ops, variant("acc-f16", accumulateF16));
  EXPECT_FALSE(r.pass);
  bool caught = false;
  for (const auto& p : r.probes)
    if (p.probe.kind == ProbeKind::F16Limit) {
      caught = p.eligible && !p.ok() && p.metric.reason.find("Inf") != std::string::npos;
      std::printf("f16-limit probe on acc-f16: %s\n", p.metric.reason.c_str());
    }
  EXPECT_TRUE(caught);
}

TEST_F(Gate, FaultSaturatingPackCaughtByBeyondF16Probe) {
  PathEntry e = realEntry();
  e.name = "saturating-pack";
  e.prepare = saturatingPack;
  const GateResult r = runGate(*ops, e);
  EXPECT_FALSE(r.pass);
  for (const auto& [s, m] : r.shapes) EXPECT_TRUE(m.pass);
  for (const auto& p : r.probes) {
    SCOPED_TRACE(p.probe.name);
    EXPECT_TRUE(p.eligible);                                  // it never refuses...
    EXPECT_EQ(p.ok(), p.probe.kind != ProbeKind::BeyondF16);  // ...so its numbers must hold
  }
}

TEST_F(Gate, RunGateOnData) {
  const int M = 3, K = 96, N = 40;
  std::vector<float> in(M * K), w(K * N), bias(N), wide(K * N);
  Rng rng(7);
  for (auto& x : in) x = rng.uniform(-1.0f, 1.0f);
  for (auto& x : w) x = rng.uniform(-0.1f, 0.1f);
  for (auto& x : bias) x = rng.uniform(-0.5f, 0.5f);
  wide = w;
  wide[5] = 1.0e5f;  // past f16: this matrix is not eligible
  const std::vector<GateCase> cases{{"h0.qkv", M, K, N, in.data(), w.data(), bias.data()},
                                    {"h0.fc", M, K, N, in.data(), wide.data(), nullptr},
                                    {"h1.proj", M, K, N, in.data(), w.data(), nullptr}};
  const GateResult r = runGateOnData(*ops, realEntry(), cases);
  for (const auto& l : consoleLines(r)) std::printf("%s\n", l.c_str());
  EXPECT_TRUE(r.pass) << consoleLine(r);
  ASSERT_EQ(r.shapes.size(), 2u);
  EXPECT_EQ(r.shapes[0].first.label, "h0.qkv");
  ASSERT_EQ(r.ineligible.size(), 1u);
  EXPECT_EQ(r.ineligible[0].label, "h0.fc");
  EXPECT_EQ(r.metric.meanAbsRef, r.shapes[0].second.meanAbsRef);
  EXPECT_NE(consoleLine(r).find("PASS (2/2 shapes, 1 not eligible)"), std::string::npos);

  // Same poisoning and metric: a path that skips a row or is off fails on real data too.
  EXPECT_EQ(runGateOnData(*ops, variant("skips", skipsLastRow), cases).metric.reason,
            fmt::format("NaN in fast output at index {}", (M - 1) * N));
  EXPECT_FALSE(runGateOnData(*ops, variant("drop", dropLowBits), cases).pass);
  // Nothing eligible: nothing to trust the path with.
  const GateResult none = runGateOnData(*ops, realEntry(), {cases[1]});
  EXPECT_FALSE(none.pass);
  EXPECT_EQ(none.metric.reason, "no eligible case");
}

TEST_F(Gate, JsonRoundTrip) {
  const GateResult r = runGate(*ops, realEntry());
  const GateResult back = gateResultFromJson(toJson(r));
  EXPECT_EQ(consoleLines(back), consoleLines(r));
  EXPECT_EQ(toJson(back)["probes"], toJson(r)["probes"]);
}

TEST_F(Gate, DestroyedWhileGatesRun) {
  LogCapture log;
  for (int i = 0; i < 5; ++i) PathSet set(*ops, PathSelection{}, caps, pathsFor(Device::CPU));
}

}  // namespace
}  // namespace ptllm
