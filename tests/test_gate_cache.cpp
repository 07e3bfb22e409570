// The gate cache (gate/gate_cache.h): a warm start reuses the verdict, --regate re-runs it,
// a corrupt or foreign file is ignored and rewritten, a kernel variant never reuses another's
// verdict. XDG_CACHE_HOME points at a temp dir: the real home is never touched.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <string>
#include <system_error>

#include "core/file_io.h"
#include "gate/gate_cache.h"
#include "gate/paths.h"
#include "kernels/cpu/cpu_kernels.h"

namespace ptllm {
namespace {

std::atomic<int> gCalls{0};
void counting(float* out, const float* in, const void* w, const float* bias, int M, int K, int N) {
  gCalls.fetch_add(1);
  cpu::matmulF16(out, in, w, bias, M, K, N);
}
void countingToo(float* out, const float* in, const void* w, const float* bias, int M, int K,
                 int N) {
  gCalls.fetch_add(1);
  cpu::matmulF16(out, in, w, bias, M, K, N);
}

class GateCache : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ptllm-gate-cache-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir = tmpl;
    setenv("XDG_CACHE_HOME", dir.c_str(), 1);
    quiet = setGateLogSink([](const std::string&) {});
  }
  void TearDown() override {
    setGateLogSink(quiet);
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  PathEntry entry(MatmulFn fn = counting) {
    PathEntry e = *findPath("f16-storage");
    e.dispatch = fn;
    return e;
  }
  GateResult run(const PathEntry& e, bool regate = false) {
    PathSetOptions o;
    o.useCache = true;
    o.regate = regate;
    PathSet set(*ops, PathSelection{}, caps, {e}, o);
    return set.results()[0];
  }
  std::string file() const { return dir + "/ptllm/gate-f16-storage.json"; }

  std::string dir;
  GateLogSink quiet;
  std::unique_ptr<Ops> ops = makeCpuOps();
  Capabilities caps = detectCapabilities();
};

TEST_F(GateCache, DirFollowsXdg) {
  EXPECT_EQ(gateCacheDir(), dir + "/ptllm");
  EXPECT_NE(binaryBuildId(), 0u);
  EXPECT_EQ(binaryBuildId(), binaryBuildId());
  EXPECT_EQ(binaryBuildIdHex().size(), 16u);
}

TEST_F(GateCache, WarmStartReusesTheVerdict) {
  if (!caps.has("f16c")) GTEST_SKIP() << "no F16C here";
  gCalls = 0;
  const GateResult cold = run(entry());
  EXPECT_FALSE(cold.cached);
  EXPECT_TRUE(cold.pass);
  const int calls = gCalls.load();
  EXPECT_GT(calls, 0);
  ASSERT_TRUE(fileExists(file()));

  const GateResult warm = run(entry());
  EXPECT_EQ(gCalls.load(), calls);  // no kernel ran
  EXPECT_TRUE(warm.cached);
  EXPECT_TRUE(warm.active());
  EXPECT_EQ(warm.metric.maxAbs, cold.metric.maxAbs);
  EXPECT_EQ(warm.shapes.size(), cold.shapes.size());
  EXPECT_EQ(warm.probes.size(), cold.probes.size());
  const std::string line = consoleLine(warm);
  EXPECT_NE(line.find("(cached)"), std::string::npos) << line;
  EXPECT_EQ(consoleLine(cold) + " (cached)", line);
  std::printf("cold %.1f ms, cached %.3f ms\n", cold.millis, warm.millis);
  EXPECT_LT(warm.millis, cold.millis);

  const GateResult again = run(entry(), /*regate=*/true);  // --regate
  EXPECT_FALSE(again.cached);
  EXPECT_GT(gCalls.load(), calls);
  EXPECT_TRUE(run(entry()).cached);  // rewritten, valid
}

TEST_F(GateCache, CorruptOrForeignFileIsIgnoredAndRewritten) {
  if (!caps.has("f16c")) GTEST_SKIP() << "no F16C here";
  run(entry());
  for (const std::string& junk :
       {std::string("not json {"), std::string(""),
        std::string("{\"format\":\"ptllm-gate-cache-1\",\"key\":\"x\"}"), std::string("[1,2,3]")}) {
    writeFileAtomic(file(), junk);
    gCalls = 0;
    GateResult r;
    EXPECT_NO_THROW(r = run(entry()));
    EXPECT_FALSE(r.cached);
    EXPECT_GT(gCalls.load(), 0);
    EXPECT_TRUE(nlohmann::json::parse(readTextFile(file())).is_object());
    EXPECT_TRUE(run(entry()).cached);
  }
  // A well-formed file whose result lies about its path: foreign, ignored.
  nlohmann::json j = nlohmann::json::parse(readTextFile(file()));
  j["result"]["path"] = "other";
  writeFileAtomic(file(), j.dump());
  EXPECT_FALSE(run(entry()).cached);
}

TEST_F(GateCache, AnotherKernelNeverReusesTheVerdict) {
  if (!caps.has("f16c")) GTEST_SKIP() << "no F16C here";
  run(entry(counting));
  EXPECT_NE(gateCacheKey(entry(counting), caps, "cpu"),
            gateCacheKey(entry(countingToo), caps, "cpu"));
  gCalls = 0;
  EXPECT_FALSE(run(entry(countingToo)).cached);  // same name, other dispatch: re-gated
  EXPECT_GT(gCalls.load(), 0);
  PathEntry shapes = entry(countingToo);
  shapes.gateShapes.pop_back();
  EXPECT_FALSE(run(shapes).cached);  // other shape set
  Capabilities other = caps;
  other.cpuModel += " (other)";
  EXPECT_NE(gateCacheKey(entry(), caps, "cpu"), gateCacheKey(entry(), other, "cpu"));
}

TEST_F(GateCache, OffByDefaultAndUnwritableIsNotAnError) {
  if (!caps.has("f16c")) GTEST_SKIP() << "no F16C here";
  {
    PathSet set(*ops, PathSelection{}, caps, {entry()});
    EXPECT_FALSE(set.results()[0].cached);
  }
  EXPECT_FALSE(fileExists(file()));
  setenv("XDG_CACHE_HOME", "/proc/no-such-dir", 1);
  GateResult r;
  EXPECT_NO_THROW(r = run(entry()));
  EXPECT_TRUE(r.pass);
  EXPECT_FALSE(r.cached);
  setenv("XDG_CACHE_HOME", dir.c_str(), 1);
}

}  // namespace
}  // namespace ptllm
