// Checkpoints and training runs: bit-exact round trips, exact resume, HF GPT-2 layout, and the
// errors a malformed checkpoint gives (library and CLI).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>

#include "core/error.h"
#include "core/file_io.h"
#include "core/rng.h"
#include "kernels/ops.h"
#include "model/checkpoint.h"
#include "model/safetensors.h"
#include "model/trainer.h"
#include "test_util.h"

namespace ptllm {
namespace {

ModelConfig smallConfig(int vocab) {
  ModelConfig c;
  c.nLayer = 2;
  c.nHead = 2;
  c.nEmbd = 16;
  c.blockSize = 16;
  c.vocabSize = vocab;
  return c;
}

std::vector<float> params(Gpt2& m) {
  std::vector<float> p(size_t(m.numParams()));
  m.ops().download(p.data(), m.paramData());
  return p;
}

TEST(Checkpoint, RoundTripIsBitExactWithConfigAndTokenizer) {
  test::TempDir dir;
  auto ops = makeCpuOps();
  auto tok = CharTokenizer::fromText("abcdefg hij\n", "t");
  Gpt2 m(*ops, smallConfig(tok.size()));
  m.initRandom(5);
  saveCheckpoint(m, &tok, dir.file("a.safetensors"), {{"note", "x"}});
  auto lm = loadCheckpoint(*ops, dir.file("a.safetensors"));
  EXPECT_EQ(lm.model->config().nEmbd, 16);
  ASSERT_TRUE(lm.tokenizer);
  EXPECT_EQ(lm.tokenizer->vocab(), tok.vocab());
  EXPECT_EQ(lm.metadata.at("note"), "x");
  auto a = params(m), b = params(*lm.model);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
}

TEST(Checkpoint, F16AndBf16StoredWeightsLoadIntoF32) {
  test::TempDir dir;
  auto ops = makeCpuOps();
  Gpt2 m(*ops, smallConfig(10));
  m.initRandom(5);
  auto a = params(m);
  for (auto [dt, tol] : {std::pair{StoreDType::F16, 1e-3}, std::pair{StoreDType::BF16, 8e-3}}) {
    saveCheckpoint(m, nullptr, dir.file("h.safetensors"), {}, dt);
    auto lm = loadCheckpoint(*ops, dir.file("h.safetensors"));
    auto b = params(*lm.model);
    EXPECT_LE(test::worstRatio(b.data(), a.data(), a.size(), 1e-6, tol), 1.0);
  }
}

// Writes the model as Hugging Face does: transformer. prefix, attention-mask buffers, the tied
// lm_head, config.json beside model.safetensors, weights in F16.
TEST(Checkpoint, HuggingFaceDirectoryLoadsWithTheSameLogits) {
  test::TempDir dir;
  auto ops = makeCpuOps();
  ModelConfig c = smallConfig(11);
  Gpt2 m(*ops, c);
  m.initRandom(8);
  // Round the weights to f16 first so the F16 copy holds exactly the same values.
  auto p = params(m);
  for (auto& x : p) x = safetensors::f16ToF32(safetensors::f32ToF16(x));
  ops->upload(m.paramData(), p.data());
  std::vector<safetensors::TensorToWrite> ts;
  std::vector<float> mask(size_t(c.blockSize) * c.blockSize, 1.0f);
  for (const auto& info : m.paramInfos())
    ts.push_back(
        {"transformer." + info.name, info.shape, p.data() + info.offset, safetensors::DType::F16});
  for (int l = 0; l < c.nLayer; ++l)
    ts.push_back({"transformer.h." + std::to_string(l) + ".attn.bias",
                  {1, 1, c.blockSize, c.blockSize},
                  mask.data(),
                  safetensors::DType::F32});
  ts.push_back({"lm_head.weight",
                {c.vocabSize, c.nEmbd},
                p.data() + m.findParam("wte.weight")->offset,
                safetensors::DType::F32});
  safetensors::write(dir.file("model.safetensors"), ts, {{"format", "pt"}});
  writeFileAtomic(dir.file("config.json"),
                  R"({"model_type":"gpt2","n_layer":2,"n_head":2,"n_embd":16,"n_positions":16,)"
                  R"("n_ctx":16,"vocab_size":11,"layer_norm_epsilon":1e-05})");
  auto lm = loadCheckpoint(*ops, dir.path());
  EXPECT_FALSE(lm.tokenizer);
  std::vector<int32_t> x = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  m.forward(x.data(), nullptr, 1, 10);
  lm.model->forward(x.data(), nullptr, 1, 10);
  auto la = m.logitsHost(), lb = lm.model->logitsHost();
  EXPECT_EQ(std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)), 0);
}

// A checkpoint with one thing wrong, and the words its error must contain.
struct BadCase {
  const char* what;
  std::function<void(std::vector<safetensors::TensorToWrite>&, std::map<std::string, std::string>&)>
      edit;
  const char* expect;
};

TEST(Checkpoint, MalformedModelsGiveOneLineErrorsNamingTheProblem) {
  test::TempDir dir;
  auto ops = makeCpuOps();
  Gpt2 m(*ops, smallConfig(10));
  m.initRandom(1);
  auto p = params(m);
  std::vector<float> extra(64, 0.0f), bad;
  const std::vector<BadCase> cases = {
      {"missing tensor", [](auto& ts, auto&) { ts.erase(ts.begin() + 3); }, "missing tensor"},
      {"unknown tensor",
       [&](auto& ts, auto&) {
         ts.push_back({"h.0.mystery", {64}, extra.data()});
       },
       "unknown tensor h.0.mystery"},
      {"wrong shape",
       [](auto& ts, auto&) {
         ts[0].shape = {16, 10};
       },
       "expected [10, 16]"},
      {"bad config", [](auto&, auto& meta) { meta["config"] = "{\"n_layer\": 2}"; },
       "missing field n_head"},
      {"config not json", [](auto&, auto& meta) { meta["config"] = "[nope"; }, "not a JSON object"},
      {"indivisible heads",
       [](auto&, auto& meta) {
         meta["config"] = R"({"n_layer":2,"n_head":3,"n_embd":16,"block_size":16,"vocab_size":10})";
       },
       "not divisible"},
      {"bad tokenizer",
       [](auto&, auto& meta) { meta["tokenizer"] = R"({"type":"char","vocab":[3,2]})"; },
       "not sorted"},
      {"surrogate in the tokenizer",
       [](auto&, auto& meta) { meta["tokenizer"] = R"({"type":"char","vocab":[10,65,55296]})"; },
       "55296 is not a Unicode scalar value"},
      // The config decides the allocation: one that the tensors do not fill is refused first
      // (a block size of 2^20 would otherwise ask for far more than the file holds).
      {"config larger than the tensors",
       [](auto&, auto& meta) {
         meta["config"] =
             R"({"n_layer":2,"n_head":2,"n_embd":16,"block_size":1048576,"vocab_size":10})";
       },
       "wpe.weight has shape [16, 16], expected [1048576, 16]"},
      {"non-finite weight",
       [&](auto& ts, auto&) {
         auto& wpe = ts[1];  // [block, embd]
         ASSERT_EQ(wpe.name, "wpe.weight");
         bad.assign(wpe.data, wpe.data + wpe.shape[0] * wpe.shape[1]);
         bad[17] = std::numeric_limits<float>::infinity();
         wpe.data = bad.data();
       },
       "tensor wpe.weight holds inf at element 17"},
  };
  for (const auto& bc : cases) {
    std::vector<safetensors::TensorToWrite> ts;
    for (const auto& info : m.paramInfos())
      ts.push_back({info.name, info.shape, p.data() + info.offset});
    std::map<std::string, std::string> meta = {{"config", configToJson(m.config())}};
    bc.edit(ts, meta);
    const std::string path = dir.file("bad.safetensors");
    safetensors::write(path, ts, meta);
    try {
      loadCheckpoint(*ops, path);
      ADD_FAILURE() << bc.what << ": no error";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(path), std::string::npos) << bc.what << ": " << msg;
      EXPECT_NE(msg.find(bc.expect), std::string::npos) << bc.what << ": " << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << bc.what << ": " << msg;
    }
  }
  EXPECT_THROW(loadCheckpoint(*ops, dir.file("absent.safetensors")), Error);
  EXPECT_THROW(loadCheckpoint(*ops, dir.path()), Error);  // directory without config.json
}

TrainOptions tinyRun(const test::TempDir& dir, int steps) {
  TrainOptions o;
  o.dataPath = dir.file("data.txt");
  o.outPath = dir.file("run.safetensors");
  o.model = smallConfig(0);
  o.batchSize = 4;
  o.steps = steps;
  o.warmup = 3;
  o.evalEvery = 5;
  o.evalBatches = 2;
  o.seed = 99;
  return o;
}

TEST(Training, ResumeContinuesExactly) {
  test::TempDir dir;
  test::writeText(dir.file("data.txt"), test::sampleText(5000));
  auto ops = makeCpuOps();
  // 20 steps straight.
  Trainer straight(*ops, tinyRun(dir, 20));
  straight.run(nullptr, {});
  const auto want = params(straight.model());
  // 10 steps, stop (as Ctrl-C does), save, resume for the rest.
  {
    Trainer first(*ops, tinyRun(dir, 20));
    std::atomic<bool> stop{false};
    first.run(&stop, [&](const StepReport& r) { stop = r.step == 10; });
    EXPECT_EQ(first.stepsDone(), 10);
  }
  TrainOptions resume;
  resume.resumePath = dir.file("run.safetensors");
  resume.outPath = dir.file("run.safetensors");
  resume.steps = 0;  // keep the saved run's step count
  Trainer second(*ops, resume);
  EXPECT_EQ(second.stepsDone(), 10);
  EXPECT_EQ(second.options().steps, 20);
  second.run(nullptr, {});
  const auto got = params(second.model());
  ASSERT_EQ(got.size(), want.size());
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
  // The log has a header and one row per step.
  std::ifstream log(second.logPath());
  std::string line;
  int rows = 0;
  while (std::getline(log, line)) ++rows;
  EXPECT_EQ(rows, 21);
}

TEST(Training, FineTuneRejectsCharactersTheTokenizerLacks) {
  test::TempDir dir;
  test::writeText(dir.file("data.txt"), test::sampleText(3000));
  auto ops = makeCpuOps();
  Trainer t(*ops, tinyRun(dir, 2));
  t.run(nullptr, {});
  test::writeText(dir.file("new.txt"), test::sampleText(3000) + "Zebra");
  TrainOptions ft = tinyRun(dir, 2);
  ft.initPath = dir.file("run.safetensors");
  ft.dataPath = dir.file("new.txt");
  ft.outPath = dir.file("ft.safetensors");
  try {
    Trainer bad(*ops, ft);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'Z'"), std::string::npos) << e.what();
  }
  test::writeText(dir.file("new.txt"), test::sampleText(3000, 8));
  Trainer good(*ops, ft);
  EXPECT_EQ(good.model().config().vocabSize, t.model().config().vocabSize);
  good.run(nullptr, {});
  EXPECT_TRUE(fileExists(dir.file("ft.safetensors")));
}

// The CLI turns every bad input into one line on stderr and a non-zero exit.
struct CliResult {
  int status;
  std::string err;
};
CliResult runCli(const std::string& args, const test::TempDir& dir) {
  const std::string errFile = dir.file("stderr.txt");
  const std::string cmd = std::string(PTLLM_BINARY) + " " + args + " >/dev/null 2>" + errFile;
  const int rc = std::system(cmd.c_str());
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : 128, readTextFile(errFile)};
}

TEST(Training, RefusesOutputsThatWouldOverwriteItsInputs) {
  test::TempDir dir;
  const std::string text = test::sampleText(3000);
  test::writeText(dir.file("data.txt"), text);
  auto ops = makeCpuOps();
  Trainer t(*ops, tinyRun(dir, 2));
  t.run(nullptr, {});
  ASSERT_EQ(::symlink(dir.file("data.txt").c_str(), dir.file("link.safetensors").c_str()), 0);
  test::writeText(dir.file("x.log.csv"), text);
  ASSERT_TRUE(makeDirs(dir.file("sub")));
  struct Case {
    const char* what;
    std::function<void(TrainOptions&)> edit;
    std::string expect;
  };
  const Case cases[] = {
      {"out is the data", [&](TrainOptions& o) { o.outPath = o.dataPath; }, "--data input"},
      {"out links to the data", [&](TrainOptions& o) { o.outPath = dir.file("link.safetensors"); },
       "--data input"},
      {"the log would be the data",
       [&](TrainOptions& o) {
         o.dataPath = dir.file("x.log.csv");
         o.outPath = dir.file("x.safetensors");
       },
       "x.log.csv over its --data input"},
      {"out is the data through dot segments",
       [&](TrainOptions& o) { o.outPath = dir.file("sub/../data.txt"); }, "--data input"},
      {"out is the --init checkpoint",
       [&](TrainOptions& o) {
         o.initPath = dir.file("run.safetensors");
         o.outPath = dir.file("run.safetensors");
       },
       "--init input"},
      {"out is a directory", [&](TrainOptions& o) { o.outPath = dir.file("sub"); },
       "is a directory"},
      {"out's directory is missing",
       [&](TrainOptions& o) { o.outPath = dir.file("nowhere/run.safetensors"); }, "does not exist"},
  };
  for (const Case& c : cases) {
    TrainOptions o = tinyRun(dir, 2);
    c.edit(o);
    try {
      Trainer bad(*ops, o);
      ADD_FAILURE() << c.what << ": no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(c.expect), std::string::npos)
          << c.what << ": " << e.what();
    }
  }
  // Nothing was written over: the inputs are as they were.
  EXPECT_EQ(readTextFile(dir.file("data.txt")), text);
  EXPECT_EQ(readTextFile(dir.file("x.log.csv")), text);
  EXPECT_FALSE(fileExists(dir.file("nowhere")));
  // Resuming in place (no --out) still writes its own checkpoint.
  TrainOptions resume;
  resume.resumePath = dir.file("run.safetensors");
  resume.steps = 3;
  Trainer again(*ops, resume);
  again.run(nullptr, {});
  EXPECT_EQ(again.stepsDone(), 3);
}

TEST(Cli, BadInputGivesOneLineErrorAndNonZeroExit) {
  test::TempDir dir;
  test::writeText(dir.file("junk.safetensors"), "not a checkpoint at all");
  test::writeText(dir.file("short.txt"), "abc");
  test::writeText(dir.file("one.txt"), "a");
  const std::pair<std::string, std::string> cases[] = {
      {"info " + dir.file("junk.safetensors"), "junk.safetensors"},
      {"sample --paths f32 --model " + dir.file("missing.safetensors"), "missing.safetensors"},
      {"sample --paths f32 --model " + dir.file("junk.safetensors"), "junk.safetensors"},
      {"train --paths f32 --data " + dir.file("short.txt") + " --out " + dir.file("o.safetensors"),
       "short.txt"},
      {"train --paths f32 --data " + dir.file("nofile.txt") + " --out " + dir.file("o.safetensors"),
       "nofile.txt"},
      {"sample --paths nosuchpath", "nosuchpath"},
      {"sample --paths ''", "--paths"},
      {"--threads 100000 caps", "'100000' is not an integer from 0 to 1024"},
      {"--threads abc caps", "'abc' is not an integer"},
      {"--threads -1 caps", "'-1' is not an integer from 0"},
      {"train --log-every 0 --data " + dir.file("short.txt") + " --out " +
           dir.file("o.safetensors"),
       "--log-every"},
      {"train --init a.safetensors --resume b.safetensors --out " + dir.file("o.safetensors"),
       "exclude each other"},
      {"train --init a.safetensors --n-layer 2 --data x --out " + dir.file("o.safetensors"),
       "--n-layer cannot be combined with --init"},
      {"train --resume b.safetensors --lr 0.1", "--lr cannot be combined with --resume"},
      {"train --data " + dir.file("short.txt") + " --out " + dir.path(), "is a directory"},
      {"eval --batch-size 0 --data " + dir.file("short.txt"), "--batch-size"},
      {"eval --paths f32 --data " + dir.file("one.txt"), "one.txt"},
      {"bench train --steps 0", "--steps"},
      {"bench train --batch-size 0", "--batch-size"},
      {"bench gemm --iters 0", "--iters"},
      {"bench matmul --iters -3", "--iters"},
      {"bench sample --tokens 0", "--tokens"},
      {"sample --speculative 1", "'1' is not 0 (off) or an integer from 2 to 8"},
      {"sample --speculative 9", "'9' is not 0 (off) or an integer from 2 to 8"},
      {"serve --speculative x", "'x' is not 0 (off) or an integer from 2 to 8"},
      {"bench sample --speculative -1", "--speculative"},
  };
  for (const auto& [args, needle] : cases) {
    auto r = runCli(args, dir);
    EXPECT_NE(r.status, 0) << args;
    // Gate lines may precede it; the error itself is the last line, and a single one.
    const auto start = r.err.rfind("ptllm: error: ");
    ASSERT_NE(start, std::string::npos) << args << ": " << r.err;
    const std::string line = r.err.substr(start);
    EXPECT_NE(line.find(needle), std::string::npos) << args << ": " << r.err;
    EXPECT_EQ(std::count(line.begin(), line.end(), '\n'), 1) << args << ": " << r.err;
    EXPECT_EQ(r.err.find("error"), start + 7) << "more than one error line: " << r.err;
  }
}

}  // namespace
}  // namespace ptllm
