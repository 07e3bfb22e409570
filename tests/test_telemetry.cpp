// Precision telemetry (gate/telemetry.h): one JSON line per gate in the state file, and the
// optional POST sink, against a cpp-httplib server on 127.0.0.1 inside this test. A dead URL
// neither blocks nor fails. XDG_STATE_HOME points at a temp dir; loopback only; every wait is
// bounded.
#include <gtest/gtest.h>
#include <httplib.h>
#include <stdlib.h>

#include <chrono>
#include <filesystem>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "core/file_io.h"
#include "gate/paths.h"
#include "gate/telemetry.h"

namespace ptllm {
namespace {

using namespace std::chrono_literals;

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t nl = text.find('\n', pos);
    out.push_back(text.substr(pos, nl - pos));
    if (nl == std::string::npos) break;
    pos = nl + 1;
  }
  return out;
}

class Telemetry : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ptllm-telemetry-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir = tmpl;
    setenv("XDG_STATE_HOME", dir.c_str(), 1);
    quiet = setGateLogSink([](const std::string&) {});
  }
  void TearDown() override {
    setTelemetryUrl("");
    setGateLogSink(quiet);
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  std::vector<GateResult> gate() {
    PathSetOptions o;
    o.telemetry = true;
    PathSet set(*ops, PathSelection{}, detectCapabilities(), pathsFor(Device::CPU), o);
    return set.results();
  }
  size_t ran(const std::vector<GateResult>& rs) {
    size_t n = 0;
    for (const auto& r : rs) n += r.ran ? 1 : 0;
    return n;
  }
  std::string dir;
  GateLogSink quiet;
  std::unique_ptr<Ops> ops = makeCpuOps();
};

TEST_F(Telemetry, JsonlGetsOneLinePerGate) {
  EXPECT_EQ(telemetryFile(), dir + "/ptllm/telemetry.jsonl");
  const auto rs = gate();
  const auto rs2 = gate();
  const size_t n = ran(rs) + ran(rs2);
  if (n == 0) GTEST_SKIP() << "no path runs here";
  const auto ls = lines(readTextFile(telemetryFile()));
  ASSERT_EQ(ls.size(), n);
  for (const auto& l : ls) {
    const auto j = nlohmann::json::parse(l);
    EXPECT_EQ(j["event"], "gate");
    EXPECT_TRUE(j["metric"]["mean_abs_ref"].is_number());
    EXPECT_TRUE(j.contains("cpu_model"));
    EXPECT_EQ(j["build_id"].get<std::string>().size(), 16u);
  }
}

TEST_F(Telemetry, SinkPostsEveryRecord) {
  httplib::Server server;
  std::mutex mu;
  std::vector<std::string> bodies;
  server.Post("/gate", [&](const httplib::Request& req, httplib::Response& res) {
    std::lock_guard<std::mutex> lock(mu);
    bodies.push_back(req.body);
    res.status = 204;
  });
  const int port = server.bind_to_any_port("127.0.0.1");
  ASSERT_GT(port, 0);
  std::thread th([&] { server.listen_after_bind(); });

  setTelemetryUrl("http://127.0.0.1:" + std::to_string(port) + "/gate");
  const auto rs = gate();
  EXPECT_TRUE(flushTelemetry(10s));
  server.stop();
  th.join();

  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(bodies.size(), ran(rs));
  for (const auto& b : bodies) {
    const auto j = nlohmann::json::parse(b);  // valid JSON
    const GateResult* r = nullptr;
    for (const auto& x : rs)
      if (x.path == j["path"].get<std::string>()) r = &x;
    ASSERT_NE(r, nullptr);
    EXPECT_EQ(j["pass"], r->pass);
    EXPECT_DOUBLE_EQ(j["metric"]["max_abs"].get<double>(), r->metric.maxAbs);
    EXPECT_DOUBLE_EQ(j["metric"]["mean_rel"].get<double>(), r->metric.meanRel);
    EXPECT_EQ(j["shapes"].size(), r->shapes.size());
    EXPECT_EQ(j["probes"].size(), r->probes.size());
  }
}

TEST_F(Telemetry, DeadUrlNeitherBlocksNorFails) {
  int port = 0;
  {  // a port that was just free: nothing listens there now
    httplib::Server s;
    port = s.bind_to_any_port("127.0.0.1");
  }
  ASSERT_GT(port, 0);
  const auto t0 = std::chrono::steady_clock::now();
  setTelemetryUrl("http://127.0.0.1:" + std::to_string(port) + "/gate");
  std::vector<GateResult> rs;
  EXPECT_NO_THROW(rs = gate());
  flushTelemetry(5s);
  setTelemetryUrl("");  // joins the sender
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 8.0);
  for (const auto& r : rs) {
    if (r.ran) {
      EXPECT_TRUE(r.pass) << consoleLine(r);
    }
  }
  // The JSONL file is written whatever the sink does.
  EXPECT_EQ(lines(readTextFile(telemetryFile())).size(), ran(rs));
}

TEST_F(Telemetry, BadUrlIsNoSink) {
  EXPECT_NO_THROW(setTelemetryUrl("https://example.invalid/x"));
  EXPECT_TRUE(flushTelemetry(10ms));
  EXPECT_NO_THROW(setTelemetryUrl("ftp://x"));
}

}  // namespace
}  // namespace ptllm
