// The gate end to end: the real f16-storage path passes on this machine; broken variants
// registered only here fail and are never used; unsupported is reported apart from FAIL;
// --paths; pills; concurrent waiting on the background gate (run under TSan in CI);
// determinism.
#include <gtest/gtest.h>

#include <cstdio>

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
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
  ASSERT_EQ(e.gateShapes.size(), 1u);
  EXPECT_EQ(e.gateShapes[0].M, 64);
  EXPECT_EQ(e.gateShapes[0].K, 128);
  EXPECT_EQ(e.gateShapes[0].N, 128);
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
  GateResult r = runGate(*ops, realEntry());
  std::printf("%s\n", consoleLine(r).c_str());
  EXPECT_TRUE(r.ran);
  EXPECT_TRUE(r.pass) << consoleLine(r);
  EXPECT_TRUE(r.active());
  EXPECT_TRUE(r.metric.reason.empty());
  // mean|ref| of a K=128 dot product of U(-0.2,0.2) values: sqrt(128) * 0.2^2/3 * sqrt(2/pi).
  EXPECT_NEAR(r.metric.meanAbsRef, 0.12, 0.01);
  EXPECT_GT(r.metric.maxAbs, 0.0);  // f16 storage is not bit-exact
  EXPECT_LT(r.metric.maxAbs, r.metric.maxAbsLimit);
  EXPECT_LT(r.metric.meanRel, r.metric.meanRelLimit);
  const std::string line = consoleLine(r);
  EXPECT_EQ(line.rfind("[ops] f16-storage gate: mean|ref|=", 0), 0u) << line;
  EXPECT_NE(line.find(" — PASS — f16 path active"), std::string::npos) << line;
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
    const std::string verdict = c.reason.empty() ? "— FAIL —" : "— FAIL (" + c.reason + ") —";
    EXPECT_NE(line.find(verdict), std::string::npos) << line;
    EXPECT_NE(line.find("falling back to f32"), std::string::npos) << line;

    LogCapture log;
    PathSet set(*ops, PathSelection{}, caps.withOut("nothing"), {c.entry});
    EXPECT_EQ(set.forwardPath(), nullptr);  // the model runs f32
    EXPECT_TRUE(set.activePills().empty());
    EXPECT_EQ(set.statusClause(), "");
    EXPECT_FALSE(set.isActive(c.entry.name));
    EXPECT_EQ(log.get(), std::vector<std::string>{line});  // logged once
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
  EXPECT_EQ(log.get().size(), 2u);
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
    PathSet set(*ops, PathSelection{}, caps, registeredPaths());
    const auto pills = set.activePills();
    EXPECT_NE(std::find(pills.begin(), pills.end(), "+f16 storage"), pills.end());
  }
  {
    PathSet set(*ops, PathSelection::parse("f32"), caps, registeredPaths());
    EXPECT_TRUE(set.activePills().empty());
  }
  {
    PathSet set(*ops, PathSelection{}, caps.withOut("f16c"), registeredPaths());
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
  EXPECT_EQ(log.get().size(), 9u);  // 3 rounds x 3 gates, once each
}

TEST_F(Gate, DestroyedWhileGatesRun) {
  LogCapture log;
  for (int i = 0; i < 5; ++i) PathSet set(*ops, PathSelection{}, caps, registeredPaths());
}

}  // namespace
}  // namespace ptllm
