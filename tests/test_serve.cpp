// ptllm serve over real HTTP on loopback: every endpoint with good and bad requests, the event
// stream, streaming generation, a fine-tune from start to download, the limits, concurrent
// clients, and a clean shutdown with streams open. The server runs in-process on a tiny model
// the test makes; gate cache and telemetry go to a temp dir.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <thread>

#include "app/serve/http_api.h"
#include "app/serve/playground.h"
#include "core/file_io.h"
#include "model/checkpoint.h"
#include "model/sampler.h"
#include "test_util.h"

namespace ptllm {
namespace {

using app::GlobalOptions;
using app::HttpApi;
using app::Playground;
using app::PlaygroundLimits;
using nlohmann::json;

// A small random model with a character tokenizer over the test's own text.
std::string makeTinyModel(const test::TempDir& dir) {
  auto ops = makeCpuOps();
  std::string text = "\n";  // every printable ASCII character: any sampleText() encodes
  for (char ch = ' '; ch <= '~'; ++ch) text += ch;
  CharTokenizer tok = CharTokenizer::fromText(text, "tiny");
  ModelConfig c;
  c.nLayer = 2;
  c.nHead = 2;
  c.nEmbd = 32;
  c.blockSize = 32;
  c.vocabSize = tok.size();
  Gpt2 m(*ops, c);
  m.initRandom(5);
  const std::string path = dir.file("tiny.safetensors");
  saveCheckpoint(m, &tok, path);
  return path;
}

// A fine-tune text in the tiny model's vocabulary.
std::string trainText() {
  return test::sampleText(3000, 11);
}

class Server {
 public:
  explicit Server(const std::string& model, PlaygroundLimits limits = {}) {
    GlobalOptions g;
    g.threads = 2;
    pg_ = std::make_unique<Playground>(g, model, limits);
    api_ = std::make_unique<HttpApi>(*pg_);
    port_ = api_->bind("127.0.0.1", 0);
    thread_ = std::thread([this] { api_->listen(); });
    EXPECT_TRUE(pg_->waitReady(60));
  }
  ~Server() { shutdown(); }
  void shutdown() {
    if (!api_) return;
    api_->stop();
    thread_.join();
    api_.reset();
    pg_.reset();
  }
  int port() const { return port_; }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(60, 0);
    return c;
  }
  Playground& playground() { return *pg_; }

 private:
  std::unique_ptr<Playground> pg_;
  std::unique_ptr<HttpApi> api_;
  int port_ = 0;
  std::thread thread_;
};

json parse(const httplib::Result& r) {
  EXPECT_TRUE(r) << "no response";
  if (!r) return {};
  json j = json::parse(r->body, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << r->body;
  return j;
}

httplib::Result postJson(httplib::Client& c, const std::string& path, const std::string& body) {
  return c.Post(path, body, "application/json");
}

// Parses a text/event-stream body into (event, data) pairs.
std::vector<std::pair<std::string, json>> parseSse(const std::string& body) {
  std::vector<std::pair<std::string, json>> out;
  size_t pos = 0;
  while (pos < body.size()) {
    const size_t end = body.find("\n\n", pos);
    if (end == std::string::npos) break;
    const std::string block = body.substr(pos, end - pos);
    pos = end + 2;
    if (block.rfind(':', 0) == 0) continue;  // a comment (keep-alive)
    std::string name, data;
    size_t lp = 0;
    while (lp < block.size()) {
      size_t le = block.find('\n', lp);
      if (le == std::string::npos) le = block.size();
      const std::string line = block.substr(lp, le - lp);
      if (line.rfind("event: ", 0) == 0) name = line.substr(7);
      if (line.rfind("data: ", 0) == 0) data = line.substr(6);
      lp = le + 1;
    }
    out.emplace_back(name, json::parse(data));
  }
  return out;
}

class Serve : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("XDG_CACHE_HOME", dir_.file("cache").c_str(), 1);
    setenv("XDG_STATE_HOME", dir_.file("state").c_str(), 1);
    model_ = makeTinyModel(dir_);
  }
  test::TempDir dir_;
  std::string model_;
};

TEST_F(Serve, ServesThePageWithItsAssetsAndAStrictPolicy) {
  Server s(model_);
  auto c = s.client();
  auto page = c.Get("/");
  ASSERT_TRUE(page);
  EXPECT_EQ(page->status, 200);
  EXPECT_NE(page->get_header_value("Content-Type").find("text/html"), std::string::npos);
  EXPECT_NE(page->body.find("id=\"pills\""), std::string::npos);
  EXPECT_NE(page->body.find("id=\"status\""), std::string::npos);
  EXPECT_NE(page->get_header_value("Content-Security-Policy").find("default-src 'self'"),
            std::string::npos);
  auto js = c.Get("/app.js");
  ASSERT_TRUE(js);
  EXPECT_EQ(js->status, 200);
  EXPECT_NE(js->get_header_value("Content-Type").find("javascript"), std::string::npos);
  auto css = c.Get("/style.css");
  ASSERT_TRUE(css);
  EXPECT_EQ(css->status, 200);
  EXPECT_NE(css->get_header_value("Content-Type").find("text/css"), std::string::npos);
  // Nothing beyond the three files, and no path reaches the file system.
  for (const char* p : {"/index.html/../../etc/passwd", "/../README.md", "/web/app.js", "/nope"}) {
    auto r = c.Get(p);
    ASSERT_TRUE(r) << p;
    EXPECT_EQ(r->status, 404) << p;
    EXPECT_TRUE(parse(r).contains("error")) << p;
  }
}

TEST_F(Serve, InfoCapsStatusAndGatesDescribeTheEngine) {
  Server s(model_);
  auto c = s.client();
  json info = parse(c.Get("/api/info"));
  EXPECT_EQ(info["model"]["name"], "tiny.safetensors");
  EXPECT_EQ(info["model"]["n_layer"], 2);
  EXPECT_EQ(info["model"]["block_size"], 32);
  EXPECT_EQ(info["backend"], "cpu");
  EXPECT_EQ(info["limits"]["max_tokens"], 2000);
  EXPECT_EQ(info["speculative_lanes"], Gpt2::kDefaultSpeculativeLanes);

  json caps = parse(c.Get("/api/caps"));
  ASSERT_TRUE(caps["paths"].is_array());
  bool sawF16 = false;
  for (const json& p : caps["paths"])
    if (p["path"] == "f16-storage") {
      sawF16 = true;
      EXPECT_TRUE(p.contains("pill"));
      EXPECT_TRUE(p.contains("lines"));
    }
  EXPECT_TRUE(sawF16);
  EXPECT_TRUE(caps.contains("model_gates"));

  json st = parse(c.Get("/api/status"));
  EXPECT_TRUE(st["ready"]);
  const std::string line = st["line"];
  EXPECT_EQ(line.rfind("inference warmed up in ", 0), 0u) << line;
  EXPECT_NE(line.find("ready to generate."), std::string::npos);
  // The status clause and the pills agree with what inference runs on.
  const bool f16 = st["forward_path"] == "f16-storage";
  EXPECT_EQ(line.find("· f16-storage matmul active") != std::string::npos, f16) << line;
  EXPECT_EQ(caps["pills"], st["pills"]);
  EXPECT_EQ(std::find(st["pills"].begin(), st["pills"].end(), "+f16 storage") != st["pills"].end(),
            f16);

  json gates = parse(c.Get("/api/gates"));
  ASSERT_TRUE(gates["lines"].is_array());
  bool sawGateLine = false;
  for (const json& l : gates["lines"])
    if (l.get<std::string>().rfind("[ops] f16-storage gate", 0) == 0) sawGateLine = true;
  EXPECT_TRUE(sawGateLine) << gates.dump();
}

TEST_F(Serve, GreedyGenerationIsIdenticalOnAutoAndF32AndSeededSamplingRepeats) {
  Server s(model_);
  auto c = s.client();
  const std::string prompt = json(test::sampleText(12, 3)).dump();
  json a = parse(
      postJson(c, "/api/generate", R"({"prompt":)" + prompt + R"(,"tokens":60,"temperature":0})"));
  json f =
      parse(postJson(c, "/api/generate",
                     R"({"prompt":)" + prompt + R"(,"tokens":60,"temperature":0,"path":"f32"})"));
  EXPECT_EQ(a["tokens"], 60);
  EXPECT_EQ(f["path"], "f32");
  EXPECT_EQ(a["text"], f["text"]);
  EXPECT_EQ(a["model"], "base");
  // "speculative" picks the lanes of a greedy generation (the server's default otherwise); the
  // text is the same. The CPU backend has no speculative runs: none of its tokens came from one.
  EXPECT_EQ(a["speculative"]["lanes"], Gpt2::kDefaultSpeculativeLanes);
  for (int lanes : {0, 2, 8}) {
    json k = parse(postJson(c, "/api/generate",
                            R"({"prompt":)" + prompt + R"(,"tokens":60,"temperature":0,)" +
                                R"("speculative":)" + std::to_string(lanes) + "}"));
    EXPECT_EQ(k["text"], a["text"]) << lanes;
    EXPECT_EQ(k["speculative"]["lanes"], lanes);
    EXPECT_EQ(k["speculative"]["lanes_run"], 0);
    EXPECT_EQ(k["speculative"]["tokens"], 0);
    EXPECT_EQ(k["speculative"]["steps"], 0);
  }
  const std::string seeded = R"({"prompt":)" + prompt +
                             R"(,"tokens":40,"temperature":0.9,"top_k":5,"top_p":0.9,"seed":7})";
  json s1 = parse(postJson(c, "/api/generate", seeded));
  json s2 = parse(postJson(c, "/api/generate", seeded));
  EXPECT_EQ(s1["text"], s2["text"]);
  EXPECT_GT(s1["tok_s"].get<double>(), 0);
}

TEST_F(Serve, StreamingGenerationSendsStartTokensAndDone) {
  Server s(model_);
  auto c = s.client();
  auto r = postJson(c, "/api/generate",
                    R"({"prompt":"the ","tokens":25,"temperature":0,"stream":true})");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_NE(r->get_header_value("Content-Type").find("text/event-stream"), std::string::npos);
  auto events = parseSse(r->body);
  ASSERT_GE(events.size(), 27u);
  EXPECT_EQ(events.front().first, "start");
  EXPECT_EQ(events.back().first, "done");
  std::string joined;
  int tokens = 0;
  for (const auto& [name, data] : events)
    if (name == "token") {
      joined += data["text"].get<std::string>();
      ++tokens;
    }
  EXPECT_EQ(tokens, 25);
  EXPECT_EQ(joined, events.back().second["text"].get<std::string>());
  json plain =
      parse(postJson(c, "/api/generate", R"({"prompt":"the ","tokens":25,"temperature":0})"));
  EXPECT_EQ(plain["text"], joined);
}

TEST_F(Serve, BadRequestsGetAClearErrorAndTheServerStaysHealthy) {
  PlaygroundLimits limits;
  limits.maxBodyBytes = 64 * 1024;
  Server s(model_, limits);
  auto c = s.client();
  struct Case {
    const char* body;
    int status;
    const char* mentions;
  } cases[] = {
      {"{bad", 400, "not valid JSON"},
      {"[1,2]", 400, "JSON object"},
      {R"({"prompt":"a","tokenz":5})", 400, "tokenz"},
      {R"({"prompt":"a","tokens":0})", 400, "tokens"},
      {R"({"prompt":"a","tokens":2001})", 400, "tokens"},
      {R"({"prompt":"a","tokens":1.5})", 400, "tokens"},
      {R"({"prompt":"a","tokens":4294967297})", 400, "4294967297 is out of range"},
      {R"({"prompt":"a","tokens":-4294967295})", 400, "out of range"},
      {R"({"prompt":"a","seed":18446744073709551616})", 400, "seed"},
      {R"({"prompt":"a","temperature":"hot"})", 400, "temperature"},
      {R"({"prompt":"a","temperature":-1})", 400, "temperature"},
      {R"({"prompt":"a","top_p":0})", 400, "top_p"},
      {R"({"prompt":"a","seed":-3})", 400, "seed"},
      {R"({"prompt":"a","path":"fast"})", 400, "path"},
      {R"({"prompt":"a","model":"other"})", 400, "model"},
      {R"({"prompt":""})", 400, "prompt"},
      {R"({"tokens":5})", 400, "prompt"},
      {R"({"prompt":"\u2603"})", 400, "U+2603"},
      {R"({"prompt":"a","model":"finetuned"})", 409, "fine-tune"},
      {R"({"prompt":"a","stream":"yes"})", 400, "stream"},
      {R"({"prompt":"a","speculative":1})", 400, "speculative: 1 is not 0 (off)"},
      {R"({"prompt":"a","speculative":9})", 400, "speculative: 9 is out of range"},
      {R"({"prompt":"a","speculative":-2})", 400, "speculative"},
  };
  for (const Case& k : cases) {
    auto r = postJson(c, "/api/generate", k.body);
    ASSERT_TRUE(r) << k.body;
    EXPECT_EQ(r->status, k.status) << k.body << " -> " << r->body;
    const std::string err = parse(r).value("error", "");
    EXPECT_NE(err.find(k.mentions), std::string::npos) << k.body << " -> " << err;
    EXPECT_EQ(err.find('\n'), std::string::npos) << "one line: " << err;
  }
  auto plain = c.Post("/api/generate", R"({"prompt":"a"})", "text/plain");
  ASSERT_TRUE(plain);
  EXPECT_EQ(plain->status, 415);
  auto huge = postJson(c, "/api/generate", std::string(100 * 1024, ' '));
  ASSERT_TRUE(huge);
  EXPECT_EQ(huge->status, 413);
  auto wrongMethod = c.Get("/api/generate");
  ASSERT_TRUE(wrongMethod);
  EXPECT_GE(wrongMethod->status, 400);
  // DNS rebinding: a loopback server answers loopback names only.
  auto rebound = c.Get("/api/status", {{"Host", "evil.example:80"}});
  ASSERT_TRUE(rebound);
  EXPECT_EQ(rebound->status, 421);
  json ok = parse(postJson(c, "/api/generate", R"({"prompt":"a","tokens":5})"));
  EXPECT_EQ(ok["tokens"], 5);
}

TEST_F(Serve, AFullQueueIsABusyAnswerNotACrash) {
  PlaygroundLimits limits;
  limits.maxQueue = 0;  // nothing may wait: every request is refused as busy
  Server s(model_, limits);
  auto c = s.client();
  auto r = postJson(c, "/api/generate", R"({"prompt":"a","tokens":5})");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503);
  EXPECT_NE(parse(r)["error"].get<std::string>().find("busy"), std::string::npos);
}

TEST_F(Serve, EventStreamStartsWithHelloAndIsLimited) {
  PlaygroundLimits limits;
  limits.maxSubscribers = 1;
  Server s(model_, limits);
  std::atomic<bool> gotHello{false};
  std::string received;
  std::thread reader([&] {
    auto c = s.client();
    c.Get("/api/events", [&](const char* data, size_t n) {
      received.append(data, n);
      if (received.find("\n\n") != std::string::npos) {
        gotHello = true;
        return false;  // enough: close the stream
      }
      return true;
    });
  });
  for (int i = 0; i < 200 && !gotHello; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_TRUE(gotHello);
  reader.join();
  auto events = parseSse(received);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events[0].first, "hello");
  const json& h = events[0].second;
  EXPECT_TRUE(h["status"]["ready"]);
  EXPECT_TRUE(h["caps"]["paths"].is_array());
  EXPECT_TRUE(h["gates"].is_array());
  EXPECT_EQ(h["train"]["state"], "idle");
  // One subscriber at a time here: a second one while the first is open is refused.
  std::atomic<bool> open{false}, release{false};
  std::thread holder([&] {
    auto c = s.client();
    c.Get("/api/events", [&](const char*, size_t) {
      open = true;
      return !release.load();
    });
  });
  for (int i = 0; i < 200 && !open; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_TRUE(open);
  auto c = s.client();
  auto second = c.Get("/api/events");
  ASSERT_TRUE(second);
  EXPECT_EQ(second->status, 503);
  release = true;
  s.shutdown();  // ends the open stream: the holder returns
  holder.join();
}

TEST_F(Serve, FineTuneRunsStreamsProgressAndItsCheckpointLoads) {
  Server s(model_);
  auto c = s.client();
  // Progress arrives as train events on the stream.
  std::atomic<int> trainEvents{0};
  std::atomic<bool> sawDone{false}, subscribed{false};
  std::thread reader([&] {
    auto rc = s.client();
    std::string buf;
    rc.Get("/api/events", [&](const char* data, size_t n) {
      buf.append(data, n);
      size_t end;
      while ((end = buf.find("\n\n")) != std::string::npos) {
        auto evs = parseSse(buf.substr(0, end + 2));
        buf.erase(0, end + 2);
        for (const auto& [name, d] : evs)
          if (name == "hello") {
            subscribed = true;
          } else if (name == "train") {
            ++trainEvents;
            if (d["state"] == "done") sawDone = true;
          }
      }
      return !sawDone.load();
    });
  });
  for (int i = 0; i < 500 && !subscribed; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_TRUE(subscribed);
  auto ck = c.Get("/api/checkpoint");
  ASSERT_TRUE(ck);
  EXPECT_EQ(ck->status, 404);
  json start = parse(postJson(c, "/api/train",
                              json{{"text", trainText()}, {"steps", 8}, {"batch_size", 2}}.dump()));
  EXPECT_EQ(start["state"], "running");
  EXPECT_EQ(start["steps"], 8);
  auto again = postJson(c, "/api/train", json{{"text", trainText()}, {"steps", 8}}.dump());
  ASSERT_TRUE(again);
  EXPECT_EQ(again->status, 409);
  // Generation is served while the fine-tune runs.
  json mid =
      parse(postJson(c, "/api/generate", R"({"prompt":"the ","tokens":10,"temperature":0})"));
  EXPECT_EQ(mid["tokens"], 10);
  json st;
  for (int i = 0; i < 600; ++i) {
    st = parse(c.Get("/api/train"));
    if (st["state"] != "running") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_EQ(st["state"], "done") << st.dump();
  EXPECT_EQ(st["step"], 8);
  ASSERT_EQ(st["losses"].size(), 8u);
  EXPECT_TRUE(st["checkpoint"]);
  EXPECT_LT(st["losses"][7]["train_loss"].get<double>(),
            st["losses"][0]["train_loss"].get<double>());
  reader.join();
  EXPECT_EQ(trainEvents.load(), 10);  // running, one per step, done

  ck = c.Get("/api/checkpoint");
  ASSERT_TRUE(ck);
  ASSERT_EQ(ck->status, 200);
  EXPECT_NE(ck->get_header_value("Content-Disposition").find("finetuned.safetensors"),
            std::string::npos);
  const std::string saved = dir_.file("downloaded.safetensors");
  writeFileAtomic(saved, ck->body);
  auto ops = makeCpuOps();
  LoadedModel lm = loadCheckpoint(*ops, saved);
  ASSERT_TRUE(lm.tokenizer);
  // The fine-tuned model the server generates with is the downloaded one (greedy, f32).
  const std::string prompt = "the ";
  json fine = parse(postJson(
      c, "/api/generate",
      R"({"prompt":"the ","tokens":30,"temperature":0,"path":"f32","model":"finetuned"})"));
  ASSERT_EQ(fine["model"], "finetuned");
  SampleOptions so;
  so.tokens = 30;
  so.temperature = 0;
  Generator gen(*lm.model);
  const auto ids = gen.generate(lm.tokenizer->encode(prompt, "prompt"), so);
  EXPECT_EQ(fine["text"], lm.tokenizer->decode(ids));
  // The fine-tuned weights were gated again.
  bool sawHeader = false;
  const json gates = parse(c.Get("/api/gates"));
  for (const json& l : gates["lines"])
    if (l == "[serve] model-level gates on the fine-tuned weights:") sawHeader = true;
  EXPECT_TRUE(sawHeader) << gates.dump(1);
}

TEST_F(Serve, FineTuneRequestsAreCheckedAndStopEndsARun) {
  PlaygroundLimits limits;
  limits.maxTrainTextBytes = 8000;
  Server s(model_, limits);
  auto c = s.client();
  struct Case {
    json body;
    int status;
    const char* mentions;
  } cases[] = {
      {json{{"steps", 5}}, 400, "text"},
      {json{{"text", "ab"}}, 400, "block size"},
      {json{{"text", trainText() + "\u2603"}}, 400, "U+2603"},
      {json{{"text", trainText()}, {"steps", 0}}, 400, "steps"},
      {json{{"text", trainText()}, {"lr", 0}}, 400, "lr"},
      {json{{"text", trainText()}, {"batch_size", 1000}}, 400, "batch_size"},
      {json{{"text", trainText()}, {"file", "/etc/passwd"}}, 400, "file"},
      {json{{"text", std::string(9000, 'a')}}, 413, "text"},
  };
  for (const Case& k : cases) {
    auto r = postJson(c, "/api/train", k.body.dump());
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, k.status) << k.body.dump().substr(0, 80) << " -> " << r->body;
    EXPECT_NE(parse(r).value("error", "").find(k.mentions), std::string::npos) << r->body;
  }
  EXPECT_EQ(parse(c.Get("/api/train"))["state"], "idle");
  json start = parse(postJson(
      c, "/api/train", json{{"text", trainText()}, {"steps", 2000}, {"batch_size", 1}}.dump()));
  ASSERT_EQ(start["state"], "running");
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  parse(postJson(c, "/api/train/stop", "{}"));
  json st;
  for (int i = 0; i < 600; ++i) {
    st = parse(c.Get("/api/train"));
    if (st["state"] != "running") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(st["state"], "stopped");
  EXPECT_LT(st["step"].get<int>(), 2000);
  EXPECT_TRUE(st["checkpoint"]);  // a stopped run keeps what it learned
  auto ck = c.Get("/api/checkpoint");
  ASSERT_TRUE(ck);
  EXPECT_EQ(ck->status, 200);
}

TEST_F(Serve, ConcurrentClientsAreAllServed) {
  Server s(model_);
  constexpr int kThreads = 8, kEach = 6;
  std::atomic<int> ok{0}, bad{0};
  std::vector<std::string> texts(kThreads);
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t)
    ts.emplace_back([&, t] {
      auto c = s.client();
      for (int i = 0; i < kEach; ++i) {
        auto r = postJson(c, "/api/generate", R"({"prompt":"the ","tokens":12,"temperature":0})");
        auto st = c.Get("/api/status");
        if (r && r->status == 200 && st && st->status == 200) {
          ++ok;
          const std::string text = json::parse(r->body)["text"];
          if (texts[size_t(t)].empty()) texts[size_t(t)] = text;
          if (text != texts[size_t(t)]) ++bad;
        } else {
          ++bad;
        }
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(ok.load(), kThreads * kEach);
  EXPECT_EQ(bad.load(), 0);
  for (const auto& t : texts) EXPECT_EQ(t, texts[0]);  // same greedy request, same text
}

// A slow-loris client: many connections that send part of a request head and then stall. They
// must neither take the threads every other client needs nor keep the server from stopping.
TEST_F(Serve, StalledConnectionsDoNotStarveOtherClients) {
  Server s(model_);
  std::vector<int> stalled;
  for (int i = 0; i < 80; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(uint16_t(s.port()));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    const std::string part = "GET /api/status HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ";
    ASSERT_EQ(::send(fd, part.data(), part.size(), MSG_NOSIGNAL), ssize_t(part.size()));
    stalled.push_back(fd);
  }
  // Every stalled connection now holds a thread (the old fixed pool had 48): a normal client
  // is still answered, without waiting for any of them to time out.
  httplib::Client c("127.0.0.1", s.port());
  c.set_read_timeout(4, 0);  // below the server's per-read timeout of 5 s
  auto r = c.Get("/api/status");
  ASSERT_TRUE(r) << "no answer while 80 connections stall";
  EXPECT_EQ(r->status, 200);
  json ok = parse(postJson(c, "/api/generate", R"({"prompt":"a","tokens":3})"));
  EXPECT_EQ(ok["tokens"], 3);
  for (int fd : stalled) ::close(fd);
}

TEST_F(Serve, ShutdownWithOpenStreamsDoesNotHang) {
  auto s = std::make_unique<Server>(model_);
  // The clients are made here: the threads must not touch `s`, which is destroyed under them.
  auto sseClient = s->client();
  auto genClient = s->client();
  std::atomic<bool> open{false};
  std::thread sse([&] {
    sseClient.Get("/api/events", [&](const char*, size_t) {
      open = true;
      return true;
    });
  });
  std::thread gen([&] {
    postJson(genClient, "/api/generate", R"({"prompt":"the ","tokens":2000,"stream":true})");
  });
  for (int i = 0; i < 200 && !open; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_TRUE(open);
  const auto t0 = std::chrono::steady_clock::now();
  s.reset();
  sse.join();
  gen.join();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0);
}

TEST_F(Serve, AModelWithoutATokenizerOrAMissingFileIsAClearError) {
  GlobalOptions g;
  try {
    Playground pg(g, dir_.file("missing.safetensors"));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing.safetensors"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace ptllm
